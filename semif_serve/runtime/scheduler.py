"""`ModelScheduler`: one registered model, its lifecycle, and the one queue of everything that
waits for it, with the model's dispatcher: the one thread that decides who runs on it, and when.

The model changes state (unloaded → loading → ready → reconfiguring/unloading → unloaded) only
here, under one lock. Requests and managers wait in ONE queue, in the order they called in; a
caller only queues (`_queued`) and waits to be let in (`Waiter.granted`), within its one
deadline (`waiting.Deadline`), leaving the queue when it ends or its caller leaves. The
model's dispatcher (a thread of its own while anything is queued: `_dispatch`) decides each
step, always for the head of the queue, so nobody is ever overtaken:
- a request enters when no manager holds the model and a slot is free; if the model is
  unloaded, the dispatcher starts its load, in a thread of its own, and every admitted request
  then waits for it within its own deadline (the load goes on for the next ones); when it fails
  they all get its error (a later request tries a new load). A plain request then leases the
  model (`lease`) and runs its own engine call.
- a batched request (`serve`, its input encoded as a `Job`) at the head of an unloaded model
  has its load started by the dispatcher and waits in the queue (those queued meanwhile join
  its batch; a failed load is its error). Once the model is loaded it leads a batch: the
  dispatcher waits for company while the batch is not full (until the leader's wait of
  SEMIF_BATCH_WAIT_MS ends, or just before the earliest
  deadline of the jobs it would take, or until anyone it cannot take queues), takes the oldest
  batched requests queued behind it (`selection.select`, stopping at the first it cannot take)
  and hands the batch to a thread of its own, which runs it as one engine call and finishes
  every job in it. Every batched request, leader or not, only waits for its job's outcome
  (`jobs.awaited`: its thread is free as soon as its caller leaves).
- a manager (register, reconfigure, unload) enters when nothing is admitted and no load runs;
  it then holds the model alone. Nothing is admitted past a queued manager.
- a new model whose registering load failed is withdrawn: everyone queued for it leaves
  (`Withdrawn`), and it never loads (the registry has already dropped it).
No lock here is held while a model loads, runs or is torn down.
The scheduler also keeps the model's pace (`pace.Pace`, measured on its served engine calls):
each request's estimated wait as it queues, and a request whose deadline that wait would pass
is refused at once (`waiting.WouldTimeOut`) instead of waiting to be abandoned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from semif_serve.errors import ScoringFailed, same_failure, told_to_callers
from semif_serve.runtime.jobs import STOPPED, Job, Load, RunBatch, Waiter, awaited
from semif_serve.runtime.pace import Pace
from semif_serve.runtime.selection import BatchLimits, gather_ends, select
from semif_serve.runtime.specs import ModelSpec
from semif_serve.runtime.waiting import (
    Deadline,
    Gone,
    deadline_after,
    wait_until,
)

log = logging.getLogger(__name__)
# How long a model's dispatcher waits for the next request once its queue is empty, before its
# thread ends (the next request starts another).
DISPATCHER_LINGER_S = 1.0
# How long a request whose turn has come as it queues waits for the dispatcher to let it in
# before its deadline and its caller count again (the dispatcher is at most choosing a batch,
# within SEMIF_BATCH_WAIT_MS): a request that waits for no one is never refused for the time
# the dispatcher takes to answer.
TURN_GRACE_S = 1.0

UNLOADED, LOADING, READY, RECONFIGURING, UNLOADING, WITHDRAWN = (
    "unloaded",
    "loading",
    "ready",
    "reconfiguring",
    "unloading",
    "withdrawn",  # a new model whose registration failed: it never served, and never will
)


class Withdrawn(Exception):
    """The model's registration failed while this waiter queued for it: it is not registered
    (the waiter left its queue and holds nothing)."""

    def __init__(self, model_id: str):
        super().__init__(f"model {model_id!r} is not registered (its registration failed)")


class ModelScheduler:
    def __init__(
        self,
        spec: ModelSpec,
        clock: Callable[[], float] = time.monotonic,
        batching: BatchLimits | None = None,
    ):
        self.spec = spec
        self.state = UNLOADED
        self.engine: Any = None
        self.capacity: int | None = None
        self.last_used: float | None = None
        self.last_load_error: dict[str, str] | None = None
        self.batching = batching or BatchLimits(1, 1, 0.0)
        self._clock = clock
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # what requests, managers and loads wait on
        self._work = threading.Condition(lock)  # what the dispatcher waits on
        self._queue: deque[Waiter] = deque()
        self._active = 0
        self._managed = False
        self._dispatcher: threading.Thread | None = None  # while anything is queued
        self._loader: threading.Thread | None = None  # a request's load, running on its own
        self._failed_load: BaseException | None = None  # why the last failed load failed (a copy)
        self.pace = Pace(clock)

    # -- observation (no reservation, no timer reset) -----------------------------------------

    def serving(self) -> tuple[Any, ModelSpec, bool]:
        """(its engine, None when not loaded; its spec; whether it is unloaded because its last
        load failed), read together: a retire, a reconfigure or a load changes them under the
        condition, never between them."""
        with self._cond:
            engine = self.engine
            return engine, self.spec, engine is None and self.last_load_error is not None

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {
                "id": self.spec.id,
                "state": self.state,
                "loaded": self.state == READY,
                "slots": self.spec.slots,
                "active_slots": self._active,
                "queued_requests": sum(1 for w in self._queue if w.is_request),
                "max_parallel_slots": self.capacity,
                "source": self.spec.source,
                "revision": self._revision(),
                "keep_alive_s": self.spec.keep_alive_s,
                "last_used": self.last_used,
                "last_load_error": self.last_load_error,
                "prefix_cache": self._cache_stats(),
                "queue": {
                    "estimated_wait_s": self.pace.ahead(self._queue, self.spec.slots),
                    **self.pace.figures,
                },
            }

    def estimated_wait(self) -> float | None:
        """Seconds until the work queued and running for this model is done, at its recent
        pace (None: no engine call measured yet)."""
        with self._cond:
            return self.pace.ahead(self._queue, self.spec.slots)

    def call_started(self, tokens: int, requests: int) -> None:
        """This thread's engine call (a lease's, or a batch's: its `requests` and their
        `tokens`, 0 when not known) starts now: once the device is its own, so that the model's
        pace never counts a wait for another model's call."""
        with self._cond:
            self.pace.start_call(tokens or requests * self.pace.rate.request_tokens(), requests)

    def count_abandoned(self, stage: str, requests: int = 1) -> None:
        """Requests whose callers left: `queued` (never scored) or `scoring` (scored for no one)."""
        with self._cond:
            self.pace.figures[f"abandoned_{stage}"] += requests

    def _revision(self) -> str | None:
        """The loaded weights' revision, as results and /health report it (a built-in model's
        and a folder's are set at load), else the configured one."""
        info = getattr(self.engine, "model_info", None)
        return self.spec.revision if info is None else info().get("revision", self.spec.revision)

    def _cache_stats(self) -> dict[str, int] | None:
        """The loaded model's state-prefix cache figures (None: not loaded, or the cache off)."""
        stats = getattr(self.engine, "cache_stats", None)
        return None if stats is None else stats()

    @property
    def is_idle(self) -> bool:
        """Loaded, nothing running, nobody waiting, no manager: a model that may be retired."""
        return self.state == READY and not self._active and not self._queue and not self._managed

    # -- requests -------------------------------------------------------------------------------

    def lease(
        self,
        deadline: Deadline,
        load: Load,
        gone: Gone | None = None,
        tokens: int = 0,
    ) -> Any:
        """Wait for a slot (FIFO), the model loaded if needed, and return its engine; `release`
        ends the lease. `gone`: asked while it waits; True makes it leave (`WaiterGone`).
        `tokens`: the request's work, when known (`selection.Cost.tokens`)."""
        waiter = Waiter(deadline, gone, tokens=tokens, load=load)
        with self._cond:
            self._admit(waiter)  # a batch gathering its company stops for it
            self._wait_for_turn(waiter, lambda: False)
        try:
            if waiter.refused is not None:
                raise waiter.refused
            return self._loaded_engine(deadline, gone)
        except BaseException:
            self.release()
            raise

    def serve(self, job: Job, load: Load, run: RunBatch) -> Any:
        """`job`'s outcome (its `Batched` result, or the exception its request raises), run in
        a batch: its own, when it is at the head of the queue (`run` is then called, in a
        thread of the dispatcher's, with the engine and the batch chosen), else the batch that
        took it (ClientGone as soon as its caller leaves: `jobs.awaited`). `QueueTimeout` or
        `WaiterGone` when it left the queue untaken (a batch is chosen only once the model is
        loaded: a request waits for a load in the queue)."""
        waiter = Waiter(job.deadline, job.gone, job, tokens=job.cost.tokens, load=load, run=run)
        with self._cond:
            self._admit(waiter)  # a batch gathering its company sees it
            self._wait_for_turn(waiter, job.done.is_set)
        return awaited(job)  # taken: the batch finishes every job it took

    def release(self, served: bool = False) -> None:
        """End a lease (or a batch's slot); `served`: its engine call ran to its end, and its
        time counts in the model's pace."""
        with self._cond:
            self._active -= 1
            self._changed()  # before the clock: if it fails, the next waiter still goes
            self.last_used = self._clock()
            self.pace.end_call(served)

    def _admit(self, waiter: Waiter) -> None:
        """Queue a request (holding the lock) with its estimated wait, or refuse it at once
        (`WouldTimeOut`) when that wait would pass its deadline."""
        self.pace.admit(waiter, self._queue, self.spec.slots)
        self._queued(waiter)

    def _wait_for_turn(
        self, waiter: Waiter, ended: Callable[[], bool], timeout: float | None = None
    ) -> None:
        """Wait (holding the lock) until the dispatcher lets `waiter` in, or `ended` (its job was
        finished before it was taken: the model's load it waited for failed). Any other way
        out leaves the queue, handing back whatever a grant at that instant gave it. `timeout`:
        a manager's (a request's deadline is its own)."""
        what = f"model {self.spec.id!r}"

        def let_in() -> bool:
            return waiter.granted or ended() or self.state == WITHDRAWN

        def its_turn() -> bool:  # the dispatcher is letting it in (nothing else can change that)
            return bool(self._queue) and self._queue[0] is waiter and self._may_enter(waiter)

        try:
            deadline = waiter.deadline if timeout is None else deadline_after(timeout)
            if its_turn():  # it waits for no one: its deadline and its caller count once it is in
                self._cond.wait_for(let_in, TURN_GRACE_S)
            wait_until(self._cond, let_in, deadline, waiter.gone, what)
            if not waiter.granted and not ended():
                raise Withdrawn(self.spec.id)
        except BaseException:
            self._leave(waiter)
            raise

    def _loaded_engine(self, deadline: Deadline, gone: Gone | None) -> Any:
        """An admitted request's engine: the loaded one, or, once the load the dispatcher started
        ends, within its deadline and while its caller stays. A failed load's error is every
        waiting request's."""
        with self._cond:
            if self.state == LOADING:
                wait_until(
                    self._cond,
                    lambda: self.state != LOADING,
                    deadline,
                    gone,
                    f"model {self.spec.id!r} (it was loading)",
                )
            # Only a failed load leaves LOADING for anything but READY while requests hold
            # slots (managers wait for them), so the failure is the awaited load's.
            if self.state != READY and self._failed_load is not None:
                raise told_to_callers(self._failed_load)
            return self.engine

    def _start_load(self, load: Load | None) -> None:
        """Load the model in a thread of its own (holding the lock): the requests waiting for
        it each wait within their own deadline, and the load serves those that come next."""
        self.state, self._failed_load = LOADING, None

        def run() -> None:
            try:
                if load is not None:
                    load(self)
            except BaseException as error:  # noqa: BLE001 - handed to the waiting requests
                self.abort_load(error)  # (the registry logs a build's failure)
            finally:
                with self._cond:
                    self._loader = None
                    self._changed()

        self._loader = threading.Thread(target=run, name=f"semif-load-{self.spec.id}", daemon=True)
        try:
            self._loader.start()
        except BaseException:  # no thread ("can't start new thread"): nothing is loading
            self.state, self._loader = UNLOADED, None
            raise

    # -- the dispatcher ---------------------------------------------------------------------------

    def _queued(self, waiter: Waiter) -> None:
        """Queue `waiter` (holding the lock), the model's dispatcher running to let it in; a
        dispatcher that cannot start ("can't start new thread") queues nothing."""
        if self._dispatcher is None or not self._dispatcher.is_alive():  # (none after a fork)
            dispatcher = threading.Thread(
                target=self._dispatch, name=f"semif-queue-{self.spec.id}", daemon=True
            )
            dispatcher.start()
            self._dispatcher = dispatcher
        self._queue.append(waiter)
        self._changed()

    def _dispatch(self) -> None:
        """The dispatcher: lets in the head of the queue, each in its turn, while anything is
        queued, and for DISPATCHER_LINGER_S after (a steady stream of requests keeps one
        thread; an idle model none)."""
        with self._cond:
            try:
                while self._queue or self._work.wait_for(lambda: self._queue, DISPATCHER_LINGER_S):
                    head = self._queue[0]
                    if self._may_enter(head):
                        self._let_in(head)
                    elif head.job is None or not self._loads_for(head, head.job):
                        self._work.wait()  # every change of what it waits for notifies
            finally:
                self._dispatcher = None

    def _may_enter(self, head: Waiter) -> bool:
        if self._managed or self.state == WITHDRAWN:
            return False
        if not head.is_request:
            return not self._active and self._loader is None
        if self._active >= self.spec.slots:
            return False
        if head.job is not None:  # a batch is chosen from what queued while the model loaded
            return self.state == READY
        return self.state in (UNLOADED, LOADING, READY)

    def _loads_for(self, head: Waiter, job: Job) -> bool:
        """A batched request at the head waits for the model's load (holding the lock): start
        it when the model is unloaded and no manager holds it, or, when the load it waited for
        failed, end the request with the failure (the next one tries a new load). True: it
        acted."""
        if self._managed:
            return False
        if self.state == LOADING:
            head.awaits_load = True
        if self.state != UNLOADED:
            return False
        try:
            if head.awaits_load and self._failed_load is not None:
                raise told_to_callers(self._failed_load)
            self._start_load(head.load)  # (seen loading at its next look: it awaits the load)
        except BaseException as error:  # noqa: BLE001 - the request's outcome
            self._queue.popleft()
            job.finish(error)
            self._changed()
        return True

    def _let_in(self, head: Waiter) -> None:
        """Let the head of the queue in (holding the lock): a manager holds the model alone; a
        request a slot, the model's load started if it is unloaded; a batched one leads."""
        if head.is_request:
            self.pace.waited(head)  # first: a clock that fails lets no one in half-way
        self._queue.popleft()
        head.granted = True
        if not head.is_request:
            self._managed = True
            self._changed()
            return
        self._active += 1
        self._changed()  # the next request may take a spare slot
        if head.job is not None:
            self._lead(head, head.job)
        elif self.state == UNLOADED:
            try:
                self._start_load(head.load)
            except Exception as error:  # noqa: BLE001 - the request is told, and releases
                head.refused = error

    def _lead(self, head: Waiter, job: Job) -> None:
        """Holding a slot for the head's job (and the lock), the model loaded: choose the
        batch, and hand it to a thread of its own that runs it."""
        engine = self.engine
        try:
            batch = self._gather(job, engine.batch_tokens)
            runner = threading.Thread(
                target=self._run_batch,
                args=(head.run, engine, batch),
                name=f"semif-batch-{self.spec.id}",
                daemon=True,
            )
        except BaseException as error:  # noqa: BLE001 - the job's outcome, raised by its request
            self._batch_ended([job], error)
            return
        try:
            runner.start()
        except BaseException as error:  # noqa: BLE001 - no thread: the batch ends unscored
            self._batch_ended(batch, error)

    def _run_batch(self, run: RunBatch | None, engine: Any, batch: list[Job]) -> None:
        """A batch's engine call (the runtime's `run`), in a thread of its own; the slot is
        released, and every job finished, however it ends."""
        try:
            if run is not None:
                run(engine, batch)
        except BaseException as error:  # noqa: BLE001 - the leader's outcome; logged
            log.exception("a batch of model %s stopped", self.spec.id)
            self._batch_ended(batch, error)
            return
        self._batch_ended(batch, None)

    def _batch_ended(self, batch: list[Job], error: BaseException | None) -> None:
        """No request waits for a job left unfinished: the leader's is the stop's `error`, the
        others' ScoringFailed. `error` None: the call ran to its end (its time is paced)."""
        if error is not None:
            batch[0].finish(error)
        for taken in batch:
            taken.finish(ScoringFailed(STOPPED))
        self.release(error is None)

    def _gather(self, leader: Job, tokens: Callable[[int, int], int]) -> list[Job]:
        """The leader's batch (holding the lock and the leader's slot): its job, then the oldest
        batched requests queued behind it, within the limits. While the batch is not full and
        everyone queued could join it, it waits for company until `selection.gather_ends` (its
        wait, or the earliest deadline it holds). `tokens`: the engine's count of a forward's
        tokens (its shape buckets included)."""
        limits = self.batching
        while True:
            behind = self._companions()
            costs = [leader.cost, *(job.cost for _, job in behind)]
            count = select(costs, limits.max_rows, limits.max_tokens, tokens)
            taken = behind[: count - 1]
            rows = sum(cost.rows for cost in costs[:count])
            full = count < len(costs) or rows >= limits.max_rows
            blocked = any(waiter.job is None for waiter in self._queue)
            deadlines = [leader.deadline, *(waiter.deadline for waiter, _ in taken)]
            ends = gather_ends(leader.submitted, limits.wait_s, deadlines)
            remaining = ends - time.monotonic()
            if full or blocked or remaining <= 0:
                break
            self._work.wait(remaining)
        for waiter, _ in taken:
            self.pace.waited(waiter)
            waiter.granted = True
        self._queue = deque(waiter for waiter in self._queue if not waiter.granted)
        self._changed()  # those taken left the queue: they wait for their outcome
        return [leader, *(job for _, job in taken)]

    def _companions(self) -> list[tuple[Waiter, Job]]:
        """The batched requests at the head of the queue, up to the first it cannot take (a
        manager, or a request leasing the model on its own), less those already past their
        deadline (they are leaving)."""
        companions = []
        for waiter in self._queue:
            if waiter.job is None:
                break
            if not waiter.deadline.passed:
                companions.append((waiter, waiter.job))
        return companions

    # -- management ----------------------------------------------------------------------------

    def manage(self, operation: Callable[[ModelScheduler], Any]) -> Any:
        """Run `operation` alone, after every earlier request and manager, before later ones,
        however long they take (startup loads, shutdown unloads)."""
        return self.run_managed(self.enqueue_manager(), operation, timeout=None)

    def enqueue_manager(self) -> Waiter:
        """Publish a manager's barrier: from now on, later requests queue behind it."""
        waiter = Waiter(is_request=False)
        with self._cond:
            self._queued(waiter)  # a batch gathering its company stops for it
        return waiter

    def run_managed(
        self, waiter: Waiter, operation: Callable[[ModelScheduler], Any], timeout: float | None
    ) -> Any:
        with self._cond:
            self._wait_for_turn(waiter, lambda: False, timeout)
        try:
            return operation(self)
        finally:
            with self._cond:
                self._managed = False
                self._changed()

    def abandon(self, waiter: Waiter) -> None:
        """Withdraw a published barrier whose manager will never run (its thread did not start)."""
        with self._cond:
            self._leave(waiter)

    def try_manage(self, operation: Callable[[ModelScheduler], Any]) -> bool:
        """Eviction and idle retirement: act only on an idle model, never wait in its queue."""
        with self._cond:
            if not self.is_idle:
                return False
            self._managed = True
        try:
            operation(self)
            return True
        finally:
            with self._cond:
                self._managed = False
                self._changed()

    # -- transitions, called by the holder of the model (manager or loader) ---------------------

    def publish(self, engine: Any, capacity: int | None, spec: ModelSpec | None = None) -> None:
        """`engine` (built from `spec`, default the registered one) serves: ready, with `spec`
        committed and the last load error cleared, all at once."""
        now = self._clock()  # first: a failing clock publishes nothing
        with self._cond:
            self.spec = spec or self.spec
            self.engine, self.capacity, self.state = engine, capacity, READY
            self.last_used = now
            self.last_load_error = None
            self._changed()

    def abort_load(self, error: BaseException | None = None) -> None:
        """A load that published nothing returns to unloaded (a later request retries it), and
        the admitted requests waiting for it wake; a request's load that failed with `error`
        hands it to them: a copy that says what it says and holds no traceback (the raised
        one's frames hold the model the failed build made, kept alive until the next failure)."""
        with self._cond:
            if self.state == LOADING:
                self.state = UNLOADED
            if error is not None:
                self._failed_load = same_failure(error)
            self._changed()

    def record_load_error(self, message: str) -> None:
        """Shown in the status until the next successful load (`publish`)."""
        at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        with self._cond:
            self.last_load_error = {"message": message, "at": at}

    def withdraw(self) -> None:
        """A new model's registration failed (its manager holds it, nothing was published):
        everyone queued for it leaves (`Withdrawn`), and nobody loads it."""
        self.set_state(WITHDRAWN)

    def set_state(self, state: str) -> None:
        with self._cond:
            self.state = state
            self._changed()

    def retire(self) -> Any:
        """Clear the logical residency first and hand back the engine to tear down."""
        with self._cond:
            engine, self.engine, self.capacity = self.engine, None, None
            self.state = UNLOADING if engine is not None else UNLOADED
            return engine

    def _leave(self, waiter: Waiter) -> None:
        """`waiter` leaves: out of the queue, or, let in as it was leaving, giving back its slot
        or its hold of the model (a batch that took its job runs it, for no one)."""
        if waiter in self._queue:
            self._queue.remove(waiter)
        elif waiter.granted and waiter.job is None:
            if waiter.is_request:
                self._active -= 1
            else:
                self._managed = False
        self._changed()  # the waiter behind may now be at the head

    def _changed(self) -> None:
        """What waiters or the dispatcher wait for may have changed (holding the lock)."""
        self._cond.notify_all()
        self._work.notify_all()
