"""`ModelScheduler`: one registered model, its lifecycle, and the one queue of everything that
waits for it: the only place that decides who runs on the model, and when.

The model changes state (unloaded → loading → ready → reconfiguring/unloading → unloaded) only
here, under one condition variable. Requests and managers wait in ONE queue, in the order they
called in, and the scheduler decides each step:
- the request at the head enters when no manager holds the model, a slot is free and no batch
  is being gathered. A plain request leases the model (`lease`). A batched one (`serve`, its
  input encoded as a `Job`) leads: it waits for company while its batch is not full (until
  its own wait of SEMIF_BATCH_WAIT_MS ends, or just before the earliest deadline of the jobs it
  would take, or until anyone it cannot take queues), then takes the oldest batched requests
  queued behind it (`selection.select`, stopping at the first request it cannot take, so
  nothing is overtaken) and runs them as one engine call; the requests it took leave the queue
  and wait for their outcome. A leader takes its own job as it enters, so no job is left
  queued for nobody.
- a manager (register, reconfigure, unload) enters when it is at the head, nothing is admitted
  and no load runs; it then holds the model alone. Nothing is admitted past a queued manager.
- a new model whose registering load failed is withdrawn: everyone queued for it leaves
  (`Withdrawn`), and it never loads (the registry has already dropped it).
- the first request to find the model unloaded starts its load, in a thread of its own; every
  request then waits for the load within its own deadline (the load goes on for the next ones),
  and when it fails they all get its error (a later request tries a new load).
Every wait is bounded by the request's one deadline (`waiting.Deadline`) and ends when its
caller leaves; a waiter leaves the queue on every path out of its wait, and the waiters behind
it are woken. No lock here is held while a model loads, runs or is torn down.
The scheduler also keeps the model's pace (`pace.Pace`, measured on its served engine calls):
each request's estimated wait as it queues, and a request whose deadline that wait would pass
is refused at once (`waiting.WouldTimeOut`) instead of waiting to be abandoned.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from semif_serve.errors import ScoringFailed, same_failure, told_to_callers
from semif_serve.runtime.jobs import STOPPED, Job, RunBatch, Waiter, awaited
from semif_serve.runtime.pace import Pace
from semif_serve.runtime.selection import BatchLimits, gather_ends, select
from semif_serve.runtime.specs import ModelSpec
from semif_serve.runtime.waiting import Deadline, Gone, deadline_after, wait_until

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
        self._cond = threading.Condition()
        self._queue: deque[Waiter] = deque()
        self._active = 0
        self._managed = False
        self._gathering = False  # a leader is choosing its batch: nobody else enters meanwhile
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
        load: Callable[[ModelScheduler], None],
        gone: Gone | None = None,
        tokens: int = 0,
    ) -> Any:
        """Wait for a slot (FIFO), the model loaded if needed, and return its engine; `release`
        ends the lease. `gone`: asked while it waits; True makes it leave (`WaiterGone`).
        `tokens`: the request's work, when known (`selection.Cost.tokens`)."""
        waiter = Waiter(deadline, gone, tokens=tokens)
        with self._cond:
            self._admit(waiter)  # a leader gathering its batch stops for it
            self._enter(waiter, lambda: False)
        try:
            return self._ready_engine(load, deadline, gone)
        except BaseException:
            self.release()
            raise

    def serve(self, job: Job, load: Callable[[ModelScheduler], None], run: RunBatch) -> Any:
        """`job`'s outcome (its `Batched` result, or the exception its request raises), run in
        a batch: its own, when it enters first (`run` is then called with the engine and the
        batch it chose), else the leader's that took it (ClientGone as soon as its caller
        leaves: `jobs.awaited`). `QueueTimeout` or `WaiterGone` when it left the queue
        untaken."""
        waiter = Waiter(job.deadline, job.gone, job, tokens=job.cost.tokens)
        with self._cond:
            self._admit(waiter)  # a leader gathering its batch sees it
            leads = not self._enter(waiter, lambda: job.taken)
            if leads:
                job.taken = True
        if leads:
            self._lead(job, load, run)  # it ran its own batch: the job is finished
        return awaited(job)  # taken: its leader runs it, and every batch finishes every job

    def release(self, served: bool = False) -> None:
        """End a lease (or a batch leader's slot); `served`: its engine call ran to its end,
        and its time counts in the model's pace."""
        with self._cond:
            self._active -= 1
            self._cond.notify_all()  # before the clock: if it fails, the next waiter still goes
            self.last_used = self._clock()
            self.pace.end_call(served)

    def _admit(self, waiter: Waiter) -> None:
        """Queue a request (holding the condition) with its estimated wait, or refuse it at
        once (`WouldTimeOut`) when that wait would pass its deadline."""
        self.pace.admit(waiter, self._queue, self.spec.slots)
        self._queue.append(waiter)
        self._cond.notify_all()

    def _enter(self, waiter: Waiter, served: Callable[[], bool]) -> bool:
        """Wait (holding the condition) until `waiter` may enter, and hold a slot; or until
        `served` (a batch took its job: True, no slot). Any other way out leaves the queue."""
        try:
            wait_until(
                self._cond,
                lambda: served() or self._may_enter(waiter) or self.state == WITHDRAWN,
                waiter.deadline,
                waiter.gone,
                f"model {self.spec.id!r}",
            )
            if not served() and self.state == WITHDRAWN:
                raise Withdrawn(self.spec.id)
        except BaseException:
            self._leave(waiter)
            raise
        if served():  # the batch that took it removed it from the queue (and timed its wait)
            return True
        self.pace.waited(waiter)
        self._queue.popleft()
        self._active += 1
        self._cond.notify_all()  # the next request may take a spare slot
        return False

    def _may_enter(self, waiter: Waiter) -> bool:
        return (
            self._queue[0] is waiter
            and not self._managed
            and not self._gathering
            and self._active < self.spec.slots
            and self.state in (UNLOADED, LOADING, READY)
        )

    def _lead(self, job: Job, load: Callable[[ModelScheduler], None], run: RunBatch) -> None:
        """Holding a slot, with its own job taken: get the engine, choose the batch, run it."""
        try:
            engine = self._ready_engine(load, job.deadline, job.gone)
            batch = self._gather(job, engine.batch_tokens)
        except BaseException:
            self.release()
            raise  # only its own job was taken, and its own request raises this
        served = False
        try:
            run(engine, batch)
            served = True
        finally:  # whatever happened, no request waits for a job left unfinished
            for taken in batch:
                taken.finish(ScoringFailed(STOPPED))
            self.release(served)

    def _gather(self, leader: Job, tokens: Callable[[int, int], int]) -> list[Job]:
        """The leader's batch: itself, then the oldest batched requests queued behind it, within
        the limits. While the batch is not full and everyone queued could join it, it waits for
        company until `selection.gather_ends` (its wait, or the earliest deadline it holds).
        `tokens`: the engine's count of a forward's tokens (its shape buckets included)."""
        limits = self.batching
        with self._cond:
            self._gathering = True
            try:
                while True:
                    behind = self._companions()
                    costs = [leader.cost, *(job.cost for job in behind)]
                    count = select(costs, limits.max_rows, limits.max_tokens, tokens)
                    chosen = [leader, *behind[: count - 1]]
                    rows = sum(cost.rows for cost in costs[:count])
                    full = count < len(costs) or rows >= limits.max_rows
                    blocked = any(waiter.job is None for waiter in self._queue)
                    deadlines = [job.deadline for job in chosen]
                    ends = gather_ends(leader.submitted, limits.wait_s, deadlines)
                    remaining = ends - time.monotonic()
                    if full or blocked or remaining <= 0:
                        break
                    self._cond.wait(remaining)
                for job in chosen[1:]:
                    job.taken = True
                for waiter in self._queue:
                    if waiter.job is not None and waiter.job.taken:
                        self.pace.waited(waiter)
                self._queue = deque(w for w in self._queue if w.job is None or not w.job.taken)
                return chosen
            finally:
                self._gathering = False
                self._cond.notify_all()  # those taken leave the queue; the next may enter

    def _companions(self) -> list[Job]:
        """The batched requests at the head of the queue, up to the first it cannot take (a
        manager, or a request leasing the model on its own), less those already past their
        deadline (they are leaving)."""
        jobs = []
        for waiter in self._queue:
            if waiter.job is None:
                break
            if not waiter.deadline.passed:
                jobs.append(waiter.job)
        return jobs

    def _ready_engine(
        self, load: Callable[[ModelScheduler], None], deadline: Deadline, gone: Gone | None
    ) -> Any:
        """An admitted request's engine: the loaded one, or, after the load (started by the first
        request to find the model unloaded, in a thread of its own), within its deadline and
        while its caller stays. A failed load's error is every waiting request's."""
        with self._cond:
            if self.state == UNLOADED:
                self._start_load(load)
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

    def _start_load(self, load: Callable[[ModelScheduler], None]) -> None:
        """Load the model in a thread of its own (holding the condition): the requests waiting
        for it each wait within their own deadline, and the load serves those that come next."""
        self.state = LOADING

        def run() -> None:
            try:
                load(self)
            except BaseException as error:  # noqa: BLE001 - handed to the waiting requests
                self.abort_load(error)  # (the registry logs a build's failure)
            finally:
                with self._cond:
                    self._loader = None
                    self._cond.notify_all()

        self._loader = threading.Thread(target=run, name=f"semif-load-{self.spec.id}", daemon=True)
        try:
            self._loader.start()
        except BaseException:  # no thread ("can't start new thread"): nothing is loading
            self.state, self._loader = UNLOADED, None
            raise

    # -- management ----------------------------------------------------------------------------

    def manage(self, operation: Callable[[ModelScheduler], Any]) -> Any:
        """Run `operation` alone, after every earlier request and manager, before later ones,
        however long they take (startup loads, shutdown unloads)."""
        return self.run_managed(self.enqueue_manager(), operation, timeout=None)

    def enqueue_manager(self) -> Waiter:
        """Publish a manager's barrier: from now on, later requests queue behind it."""
        waiter = Waiter(is_request=False)
        with self._cond:
            self._queue.append(waiter)
            self._cond.notify_all()  # a leader gathering its batch stops for it
        return waiter

    def run_managed(
        self, waiter: Waiter, operation: Callable[[ModelScheduler], Any], timeout: float | None
    ) -> Any:
        with self._cond:
            try:
                deadline = deadline_after(timeout)
                wait_until(
                    self._cond,
                    lambda: self._manager_may_enter(waiter) or self.state == WITHDRAWN,
                    deadline,
                    None,
                    f"model {self.spec.id!r}",
                )
                if self.state == WITHDRAWN:
                    raise Withdrawn(self.spec.id)
            except BaseException:
                self._leave(waiter)
                raise
            self._queue.popleft()
            self._managed = True
        try:
            return operation(self)
        finally:
            with self._cond:
                self._managed = False
                self._cond.notify_all()

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
                self._cond.notify_all()

    def _manager_may_enter(self, waiter: Waiter) -> bool:
        return (
            self._queue[0] is waiter
            and not self._managed
            and not self._active
            and self._loader is None
        )

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
            self._cond.notify_all()

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
            self._cond.notify_all()

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
            self._cond.notify_all()

    def retire(self) -> Any:
        """Clear the logical residency first and hand back the engine to tear down."""
        with self._cond:
            engine, self.engine, self.capacity = self.engine, None, None
            self.state = UNLOADING if engine is not None else UNLOADED
            return engine

    def _leave(self, waiter: Waiter) -> None:
        if waiter in self._queue:
            self._queue.remove(waiter)
        self._cond.notify_all()  # the waiter behind may now be at the head
