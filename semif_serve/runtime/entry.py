"""`ModelEntry`: one registered model, its lifecycle state, and its FIFO of waiters.

The only place a model changes state (unloaded → loading → ready → reconfiguring/unloading →
unloaded), under one condition variable per model. Requests and managers wait in ONE queue, in
the order they called in:
- a request is admitted when it is at the head, no manager holds the model and a slot is free;
  consecutive requests fill spare slots. The first admitted request of an unloaded model loads
  it; other admitted requests wait for that load, within their own queue timeout, and when it
  fails they all get its error (a later request tries a new load).
- a manager (register, reconfigure, unload) is admitted when it is at the head and every earlier
  admitted request has finished; it then holds the model alone. Requests behind it wait, even
  when slots are free: nothing barges past a manager.
A waiter leaves the queue on every path out of its wait: admitted, past its timeout
(`QueueTimeout`), its caller gone (`WaiterGone`: a request's `gone` check, asked every
GONE_POLL_S while it waits, says its client closed the connection), or whatever else raised (a
clock, the condition, an interrupt); the waiters behind it are woken. No lock here is held
while a model loads, runs or is torn down.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from semif_serve.errors import same_failure
from semif_serve.runtime.specs import ModelSpec

UNLOADED, LOADING, READY, RECONFIGURING, UNLOADING = (
    "unloaded",
    "loading",
    "ready",
    "reconfiguring",
    "unloading",
)
# The longest a waiter waits (30 days). Longer timeouts are clamped before any arithmetic: a
# 400-digit integer overflows a float deadline, and Condition.wait refuses more than ~9.2e9 s.
MAX_WAIT_S = 30 * 24 * 3600.0
GONE_POLL_S = 0.25  # how often a waiting request asks whether its caller is still there


class QueueTimeout(Exception):
    """Waited longer than the queue timeout; the waiter left the queue and holds nothing."""


class WaiterGone(Exception):
    """The request's caller went away while it waited; it left the queue and holds nothing."""


@dataclass(eq=False)
class _Waiter:
    is_request: bool  # else a manager
    batched: bool = False  # a request whose work the batcher may take (it queued a job)
    enqueued: float = field(default_factory=lambda: time.monotonic())  # the clock tests move


class ModelEntry:
    def __init__(self, spec: ModelSpec, clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.state = UNLOADED
        self.engine: Any = None
        self.capacity: int | None = None
        self.last_used: float | None = None
        self.last_load_error: dict[str, str] | None = None
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[_Waiter] = deque()
        self._active = 0
        self._managed = False
        self._failed_load: BaseException | None = None  # why the last failed load failed

    # -- observation (no reservation, no timer reset) -----------------------------------------

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
            }

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

    def acquire(
        self,
        timeout: float | None,
        load: Callable[[ModelEntry], None],
        gone: Callable[[], bool] | None = None,
        served: Callable[[], bool] | None = None,
    ) -> Any:
        """Wait for a slot (FIFO), load the model if needed, and return its engine. `gone`:
        asked while the request waits; True makes it leave the queue (`WaiterGone`). `served`
        (the batcher's): True once another request took this one's work; it then leaves the
        queue without a slot, and None is returned."""
        waiter = _Waiter(is_request=True, batched=served is not None)
        with self._cond:
            self._queue.append(waiter)
            if self._admit(waiter, timeout, self._request_may_enter, gone, served):
                return None
            self._active += 1
            self._cond.notify_all()  # the next request may take a spare slot
        try:
            return self._ready_engine(load, timeout, waiter.enqueued, gone)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()  # before the clock: if it fails, the next waiter still goes
            self.last_used = self._clock()

    def _request_may_enter(self, waiter: _Waiter) -> bool:
        return (
            self._queue[0] is waiter
            and not self._managed
            and self._active < self.spec.slots
            and self.state in (UNLOADED, LOADING, READY)
        )

    def _ready_engine(
        self,
        load: Callable[[ModelEntry], None],
        timeout: float | None,
        since: float,
        gone: Callable[[], bool] | None = None,
    ) -> Any:
        """An admitted request's engine: wait for a load in progress (within what is left of
        its queue timeout, counted from `since`, while its caller stays; its failure is this
        request's too), or do the load itself."""
        with self._cond:
            if self.state == LOADING:
                self._wait_until(
                    lambda: self.state != LOADING, timeout, gone, since, " (it was loading)"
                )
                # Only a failed load leaves LOADING for anything but READY while requests hold
                # slots (managers wait for them), so the failure is the awaited load's.
                if self.state != READY and self._failed_load is not None:
                    raise same_failure(self._failed_load)
            if self.state == READY:
                return self.engine
            self.state = LOADING
        try:
            load(self)
        except BaseException as error:
            self.abort_load(error)
            raise
        return self.engine

    # -- management ----------------------------------------------------------------------------

    def manage(self, operation: Callable[[ModelEntry], Any], timeout: float | None) -> Any:
        """Run `operation` alone, after every earlier request and manager, before later ones."""
        return self.run_managed(self.enqueue_manager(), operation, timeout)

    def enqueue_manager(self) -> _Waiter:
        """Publish a manager's barrier: from now on, later requests queue behind it."""
        waiter = _Waiter(is_request=False)
        with self._cond:
            self._queue.append(waiter)
        return waiter

    def run_managed(
        self, waiter: _Waiter, operation: Callable[[ModelEntry], Any], timeout: float | None
    ) -> Any:
        with self._cond:
            self._admit(waiter, timeout, self._manager_may_enter, None)
            self._managed = True
        try:
            return operation(self)
        finally:
            with self._cond:
                self._managed = False
                self._cond.notify_all()

    def abandon(self, waiter: _Waiter) -> None:
        """Withdraw a published barrier whose manager will never run (its thread did not start)."""
        with self._cond:
            self._leave(waiter)

    def try_manage(self, operation: Callable[[ModelEntry], Any]) -> bool:
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

    def unbatched_arrival(self) -> float | None:
        """When the first queued waiter whose work the batcher cannot take arrived: a manager,
        or a request leasing the model on its own (it found the model unloaded). None: none is.
        The batcher takes no job that arrived after it, so nothing barges past it."""
        with self._cond:
            return min((w.enqueued for w in self._queue if not w.batched), default=None)

    def wake(self) -> None:
        """Wake every waiter to look again (the batcher took some of their work)."""
        with self._cond:
            self._cond.notify_all()

    def _manager_may_enter(self, waiter: _Waiter) -> bool:
        return self._queue[0] is waiter and not self._managed and not self._active

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
        hands it to them."""
        with self._cond:
            if self.state == LOADING:
                self.state = UNLOADED
            if error is not None:
                self._failed_load = error
            self._cond.notify_all()

    def record_load_error(self, message: str) -> None:
        """Shown in the status until the next successful load (`publish`)."""
        at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        with self._cond:
            self.last_load_error = {"message": message, "at": at}

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

    # -- waiting --------------------------------------------------------------------------------

    def _admit(
        self,
        waiter: _Waiter,
        timeout: float | None,
        may_enter,
        gone: Callable[[], bool] | None,
        served: Callable[[], bool] | None = None,
    ) -> bool:
        """Wait (holding the condition) until `may_enter`, then leave the head of the queue;
        or until `served`, then leave it wherever the waiter is (True: served, no slot).
        Any other way out of the wait also leaves the queue, so no waiter is ever stranded."""

        def was_served() -> bool:
            return served is not None and served()

        try:
            self._wait_until(lambda: was_served() or may_enter(waiter), timeout, gone)
        except BaseException:
            self._leave(waiter)
            raise
        if was_served():
            self._leave(waiter)
            return True
        self._queue.popleft()
        return False

    def _wait_until(
        self,
        ready: Callable[[], bool],
        timeout: float | None,
        gone: Callable[[], bool] | None,
        since: float | None = None,
        waiting_for: str = "",
    ) -> None:
        """Wait (holding the condition) until `ready()`: `QueueTimeout` once `timeout` has
        passed since `since` (default: now), `WaiterGone` once `gone` (asked every GONE_POLL_S)
        says the caller left."""
        if timeout:
            timeout = min(MAX_WAIT_S, timeout)  # in this order, a NaN becomes MAX_WAIT_S too
        start = time.monotonic() if since is None else since
        deadline = None if not timeout else start + timeout
        while not ready():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise QueueTimeout(f"waited {timeout:g} s for model {self.spec.id!r}{waiting_for}")
            if gone is not None:
                if gone():
                    raise WaiterGone(f"the caller left while waiting for model {self.spec.id!r}")
                remaining = GONE_POLL_S if remaining is None else min(remaining, GONE_POLL_S)
            self._cond.wait(remaining)

    def _leave(self, waiter: _Waiter) -> None:
        if waiter in self._queue:
            self._queue.remove(waiter)
        self._cond.notify_all()  # the waiter behind may now be at the head
