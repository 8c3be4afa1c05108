"""`Runtime`: the registry of models (id → its `ModelScheduler`) and the calls that reach them.

Requests ask it for a lease on a model (`lease`) or to score a batched job (`score_batched`);
management asks it to register, reconfigure or unload, each a manager in the model's own queue
that records the change (`management`) while it still holds the model. Every transition of a
model's engine is `lifecycle.Lifecycle`'s (load, reconfigure, unload); which models stay loaded
is `residency.Residency`'s (eviction, the memory budget, idle retirement, run by this runtime's
idle loop). The registry lock only guards the id → entry map and is never held while anything
waits, loads or tears down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from semif_serve.errors import (
    BadManagementRequest,
    ClientGone,
    ModelNotFound,
    QueueTimedOut,
    ServerBusy,
)
from semif_serve.runtime.jobs import (
    LEFT,
    Job,
    Waiter,
    abandoned,
    forwards,
    pinned_to,
    run_jobs,
)
from semif_serve.runtime.lifecycle import Lifecycle
from semif_serve.runtime.pinning import Pinned
from semif_serve.runtime.residency import Residency
from semif_serve.runtime.scheduler import UNLOADED, ModelScheduler, Withdrawn
from semif_serve.runtime.selection import BatchLimits
from semif_serve.runtime.specs import ModelSpec, SpecError, parse_spec
from semif_serve.runtime.waiting import (
    Deadline,
    QueueTimeout,
    WaiterGone,
    WouldTimeOut,
    deadline_after,
)

log = logging.getLogger(__name__)
IDLE_CHECK_INTERVAL_S = 1.0


class Runtime:
    def __init__(
        self,
        settings: Any,
        engine_factory: Callable[[ModelSpec], Any],
        specs: list[ModelSpec],
        default_id: str,
        clock: Callable[[], float] = time.monotonic,
        source_check: Callable[[ModelSpec], int | None] | None = None,
        device: Any = None,
        management: Any = None,
    ):
        self._settings = settings
        # Where management changes are recorded (`management_state.ManagementState`: its
        # `registered(id, table)` and `unloaded(ids)`), each while its manager still holds the
        # model, so the file takes a model's changes in the order they were served. None: not
        # recorded.
        self.management = management
        self._factory = engine_factory
        # From the layer that knows models (boot.check_source): raises BadManagementRequest when
        # a spec's source cannot load at all, else estimates its weights' resident bytes (None:
        # unknown). Absent, every source is taken as given (fake engines in tests).
        self._source_check = source_check or (lambda spec: None)
        self._clock = clock
        self._lock = threading.Lock()
        self._bulk_publication = threading.Lock()
        # The one device every model's engine shares (a `device.DeviceQueue`: the single-lock
        # runtime, INV-2), taken in turn after the model's own queue; None: each model's own.
        self._device = device
        self._batching = BatchLimits(
            settings.max_batch_rows, settings.max_batch_tokens, settings.batch_wait_ms / 1000
        )
        self._entries = {spec.id: self._scheduler(spec) for spec in specs}
        self.default_id = default_id
        self._stop = threading.Event()
        self._idle_thread: threading.Thread | None = None
        # Told (model id, event) on load, load_failed, unload, evict and retire (the metrics,
        # through `listen`); until then the events are kept (the startup loads).
        self._early_events: list[tuple[str, str]] = []
        # Told (model id, the forwards it ran: `scoring.inputs.Forward`) of each batched call.
        self.on_batch: Callable[[str, list[Any]], None] = lambda *batch: None
        self.on_event: Callable[[str, str], None] = lambda *event: self._early_events.append(event)
        self._residency = Residency(settings, self._snapshot, clock)
        # Through the attributes, read at each call: `listen` replaces `on_event`.
        self._lifecycle = Lifecycle(
            lambda spec: self._factory(spec),
            self._residency,
            lambda model_id, event: self.on_event(model_id, event),
        )

    # -- startup and shutdown -------------------------------------------------------------------

    def start(self, idle_interval_s: float | None = IDLE_CHECK_INTERVAL_S) -> None:
        """Load every load_on_startup model (a failure stops startup), then start retirement
        (checked every `idle_interval_s`; None: no retirement thread, for tests)."""
        for entry in list(self._entries.values()):
            if entry.spec.load_on_startup:
                entry.manage(self._lifecycle.load)
        if idle_interval_s is None:
            return
        self._idle_thread = threading.Thread(
            target=self._retire_idle_loop, args=(idle_interval_s,), name="semif-idle", daemon=True
        )
        self._idle_thread.start()

    def listen(self, hook: Callable[[str, str], None]) -> None:
        """Tell `hook` every lifecycle event: first those before this call (the startup loads,
        which run before the app and its metrics exist), then each as it happens."""
        early, self._early_events = self._early_events, []
        self.on_event = hook
        for model_id, event in early:
            hook(model_id, event)

    def close(self) -> None:
        """Stop retirement, join it, then unload every model (after requests have drained)."""
        self._stop.set()
        if self._idle_thread is not None:
            self._idle_thread.join()
        entries = self._snapshot()
        for entry in entries:
            entry.manage(self._lifecycle.unload)
        log.info("runtime closed: %d models unloaded", len(entries))

    # -- requests -------------------------------------------------------------------------------

    @contextmanager
    def lease(
        self,
        model_id: str | None,
        timeout_s: float | None = None,
        gone: Callable[[], bool] | None = None,
        tokens: int = 0,
        arrived: float | None = None,
        pinned: Pinned | None = None,
    ) -> Iterator[Any]:
        """The model's engine for one request, admitted in FIFO order, then given the device's
        turn when models share one, all within one deadline (every wait ends at it: 503; a
        deadline the estimated wait would pass is refused at once: 429); a request whose `gone`
        check says its caller left meanwhile, or by the time it holds both, leaves unscored
        (499). `tokens`: the request's work when known (the model's pace counts it);
        `arrived`: when the request arrived (`deadline`); `pinned`: the configuration its
        earlier calls ran under (checked once it holds the model: 503 if changed)."""
        entry = self.entry(model_id)
        deadline = self.deadline(timeout_s, arrived)
        with _queue_errors(entry, self._wait_for(entry)):
            engine = entry.lease(deadline, self._lifecycle.load_requested, gone, tokens)
        served = False
        try:
            if pinned is not None:
                pinned.check(entry.spec)
            with _queue_errors(entry, self._wait_for(entry)), self._device_turn(deadline, gone):
                if gone is not None and gone():  # it left as its wait ended: never scored
                    entry.count_abandoned("queued")
                    raise ClientGone(LEFT)
                entry.call_started(tokens, 1)
                yield engine
            served = True
            if gone is not None and gone():  # before its reply: it was scored for no one
                entry.count_abandoned("scoring")
        finally:
            entry.release(served)

    def score_batched(
        self, model_id: str | None, timeout_s: float | None, job: Job, arrived: float | None = None
    ) -> Any:
        """`job`'s outcome, scored with the model's other queued requests in one engine call
        (`ModelScheduler.serve`), within the request's deadline as `lease` is; a job whose
        request pinned another configuration (`Job.pinned`) is finished unscored (503)."""
        entry = self.entry(model_id)
        job.deadline = self.deadline(timeout_s, arrived)
        model = entry.spec.id

        def started(live: list[Job]) -> None:
            entry.call_started(sum(job.cost.tokens for job in live), len(live))

        def run(engine: Any, jobs: list[Job]) -> None:
            ran = run_jobs(engine, pinned_to(entry.spec, jobs), self._device, started)
            before, during = abandoned(jobs)
            entry.count_abandoned("queued", before)
            entry.count_abandoned("scoring", during)
            try:
                self.on_batch(model, forwards(ran))
            except Exception:  # the metrics' failure: logged, never a scored request's
                log.exception("recording a batch of model %s failed", model)

        with _queue_errors(entry, self._wait_for(entry)):
            return entry.serve(job, self._lifecycle.load_requested, run)

    def _wait_for(self, entry: ModelScheduler) -> Callable[[], float | None]:
        """What a request to `entry` would wait: its own model's estimate, or every model's
        when they share the device (a request waits for the others' calls too)."""
        return entry.estimated_wait if self._device is None else self.estimated_wait

    def estimated_wait(self) -> float | None:
        """Seconds until every model's queued and running work is done, at each one's recent
        pace: their sum (models share the device one call at a time); None: none measured."""
        estimates = [entry.estimated_wait() for entry in self._snapshot()]
        known = [estimate for estimate in estimates if estimate is not None]
        return sum(known) if known else None

    @contextmanager
    def _device_turn(self, deadline: Deadline, gone: Callable[[], bool] | None) -> Iterator[None]:
        if self._device is None:
            yield
            return
        self._device.take(deadline, gone)
        try:
            yield
        finally:
            self._device.give()

    def deadline(self, timeout_s: float | None, arrived: float | None = None) -> Deadline:
        """A request's one deadline: its `timeout_s`, or the queue timeout, from when it arrived
        (`arrived`, `time.monotonic`; default now). Every call of a request of several (an
        ecosystem request over SEMIF_MAX_DECISIONS questions) passes the same `arrived`, so
        they all wait within one deadline, never a fresh one each."""
        return deadline_after(self.queue_timeout(timeout_s), arrived)

    def queue_timeout(self, requested: float | None) -> float | None:
        """SEMIF_QUEUE_TIMEOUT_S (0: unbounded); a request may only lower it."""
        configured = self._settings.queue_timeout_s or None
        if requested is None:
            return configured
        return requested if configured is None else min(requested, configured)

    def entry(self, model_id: str | None) -> ModelScheduler:
        """The model `model_id` names as it is (None: the default model; an empty id names
        none, on a management path as anywhere)."""
        with self._lock:
            entry = self._entries.get(self.default_id if model_id is None else model_id)
        if entry is None:
            raise ModelNotFound(f"model {model_id!r} is not registered")
        return entry

    def default_model_info(self) -> dict[str, Any]:
        """The default model as loaded (its engine's own account), else as configured."""
        return self.default_model_state()[0]

    def default_model_state(self) -> tuple[dict[str, Any], bool]:
        """(`default_model_info`; whether the default model is unloaded because its last load
        failed, until a load succeeds), from one reading (`/health` reads this while a retire
        or a load may run)."""
        engine, spec, failed = self.entry(None).serving()
        return (engine.model_info() if engine is not None else spec.identity()), failed

    # -- management -----------------------------------------------------------------------------

    def status(self) -> list[dict[str, Any]]:
        return [self._status(entry) for entry in self._snapshot()]

    def _status(self, entry: ModelScheduler) -> dict[str, Any]:
        """A model's status, and the dynamic batcher's limits it is served with."""
        settings = self._settings
        batching = {
            "max_rows": settings.max_batch_rows,
            "max_tokens": settings.max_batch_tokens,
            "wait_ms": settings.batch_wait_ms,
        }
        return {**entry.status(), "batching": batching}

    def register(self, model_id: str, table: dict[str, Any], record: bool = True) -> dict[str, Any]:
        """Register a new model or reconfigure one, then load it; 200 with its status.

        The table and its source are checked before anything changes (400). A success is
        recorded (`record`: False when replaying the record itself)."""
        try:
            spec = parse_spec(model_id, table, self._settings)
        except SpecError as error:
            raise BadManagementRequest(str(error)) from None
        estimate = self._source_check(spec)
        while True:
            with self._lock:
                entry = self._entries.get(model_id)
                new = entry is None
                if new:  # listed, its manager first in its queue; withdrawn if its load fails
                    entry = self._entries[model_id] = self._scheduler(spec)
                waiter = entry.enqueue_manager()
            try:
                operation = partial(self._register_held, table, spec, estimate, new, record)
                self._managed(entry, operation, waiter)
            except Withdrawn:  # an earlier registration of this new id failed as this one queued
                continue
            return self._status(entry)

    def _register_held(
        self,
        table: dict[str, Any],
        spec: ModelSpec,
        estimate: int | None,
        new: bool,
        record: bool,
        entry: ModelScheduler,
    ) -> None:
        """`register`'s change, holding the model alone; recorded while still held. A new
        model whose load fails is withdrawn: no longer listed, and whoever queued for it meanwhile
        is told it is not registered (404), as a server restarted from the record would say."""
        try:
            self._lifecycle.reconfigure(entry, spec, estimate)
        except BaseException:
            if new:
                self._withdraw(entry)
            raise
        if record and self.management is not None:
            self.management.registered(spec.id, table)

    def _withdraw(self, entry: ModelScheduler) -> None:
        with self._lock:
            if self._entries.get(entry.spec.id) is entry:
                del self._entries[entry.spec.id]
        entry.withdraw()

    def unload(self, model_id: str, record: bool = True) -> dict[str, Any]:
        """Unload a model (it stays registered); recorded as `register`'s changes are."""
        try:
            self._managed(self.entry(model_id), partial(self._unload_recorded, record=record))
        except Withdrawn as error:
            raise ModelNotFound(str(error)) from None
        return {"id": model_id, "loaded": False}

    def _unload_recorded(self, entry: ModelScheduler, record: bool = True) -> None:
        """Unload `entry` (held alone), then record that, still holding it: also when its
        engine's close failed, since the model is unloaded all the same."""
        try:
            self._lifecycle.unload(entry)
        finally:
            if record and self.management is not None and entry.state == UNLOADED:
                self.management.unloaded([entry.spec.id])

    def bulk_unload(self, model_ids: list[str]) -> dict[str, Any]:
        """Publish every barrier first, then wait; idle models are freed without waiting."""
        with self._lock:
            selected = {i: self._entries[i] for i in dict.fromkeys(model_ids) if i in self._entries}
        not_found = [i for i in dict.fromkeys(model_ids) if i not in selected]
        with self._bulk_publication:
            waiters = {i: entry.enqueue_manager() for i, entry in selected.items()}
        errors: list[BaseException] = []
        withdrawn: list[str] = []

        def unload(model_id: str) -> None:
            try:
                entry = selected[model_id]
                entry.run_managed(waiters[model_id], self._unload_recorded, timeout=None)
            except Withdrawn:  # its registration failed as this waited: not found after all
                withdrawn.append(model_id)
            except BaseException as error:  # reported after every selection was handled
                errors.append(error)

        threads = {i: threading.Thread(target=unload, args=(i,)) for i in selected}
        try:
            for thread in threads.values():
                thread.start()
        finally:
            for model_id, thread in threads.items():
                if thread.ident is None:  # never started: its barrier must not block the model
                    selected[model_id].abandon(waiters[model_id])
            for thread in threads.values():
                if thread.ident is not None:
                    thread.join()
        if errors:
            raise errors[0]
        unloaded = [model_id for model_id in selected if model_id not in withdrawn]
        return {"unloaded": unloaded, "not_found": not_found + withdrawn}

    def _managed(
        self,
        entry: ModelScheduler,
        operation: Callable[[ModelScheduler], Any],
        waiter: Waiter | None = None,
    ) -> Any:
        """`operation`, holding the model alone, after everyone queued before its `waiter`
        (default: queued now); `Withdrawn` passes (`register` retries, `unload` says 404)."""
        try:
            waiter = waiter or entry.enqueue_manager()
            return entry.run_managed(waiter, operation, self.queue_timeout(None))
        except QueueTimeout as error:
            raise QueueTimedOut(str(error)) from None

    # -- residency ------------------------------------------------------------------------------

    def _retire_idle_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.retire_idle()

    def retire_idle(self) -> list[str]:
        """Unload every idle model past its keep_alive_s; returns their ids."""
        return self._residency.retire_idle(self._lifecycle.unload)

    def _scheduler(self, spec: ModelSpec) -> ModelScheduler:
        return ModelScheduler(spec, self._clock, self._batching)

    def _snapshot(self) -> list[ModelScheduler]:
        with self._lock:
            return list(self._entries.values())


@contextmanager
def _queue_errors(entry: ModelScheduler, estimate: Callable[[], float | None]) -> Iterator[None]:
    """A request's way out of its waits, as the HTTP layer knows it: 429 (refused for its
    deadline), 503 (its deadline passed: it says when to retry, `estimate`), 499 (its caller
    left: counted as abandoned while queued) or 404 (the model's registration failed)."""
    try:
        yield
    except WouldTimeOut as error:
        raise ServerBusy(str(error), retry_after_s=error.ahead_s) from None
    except QueueTimeout as error:
        raise QueueTimedOut(str(error), retry_after_s=estimate()) from None
    except WaiterGone as error:
        entry.count_abandoned("queued")
        raise ClientGone(f"the client closed its connection: {error}") from None
    except Withdrawn as error:
        raise ModelNotFound(str(error)) from None
