"""`ModelEntry`: one registered model, its lifecycle state, and its FIFO of waiters.

The only place a model changes state (unloaded → loading → ready → reconfiguring/unloading →
unloaded), under one condition variable per model. Requests and managers wait in ONE queue, in
the order they called in:
- a request is admitted when it is at the head, no manager holds the model and a slot is free;
  consecutive requests fill spare slots. The first admitted request of an unloaded model loads
  it; other admitted requests wait for that load (and retry it if it fails).
- a manager (register, reconfigure, unload) is admitted when it is at the head and every earlier
  admitted request has finished; it then holds the model alone. Requests behind it wait, even
  when slots are free: nothing barges past a manager.
A waiter that outlives its timeout leaves the queue with `QueueTimeout`. No lock here is held
while a model loads, runs or is torn down.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from semif_serve.runtime.specs import ModelSpec

UNLOADED, LOADING, READY, RECONFIGURING, UNLOADING = (
    "unloaded",
    "loading",
    "ready",
    "reconfiguring",
    "unloading",
)


class QueueTimeout(Exception):
    """Waited longer than the queue timeout; the waiter left the queue and holds nothing."""


@dataclass(eq=False)
class _Waiter:
    is_request: bool  # else a manager
    enqueued: float = field(default_factory=time.monotonic)


class ModelEntry:
    def __init__(self, spec: ModelSpec, clock: Callable[[], float] = time.monotonic):
        self.spec = spec
        self.state = UNLOADED
        self.engine: Any = None
        self.capacity: int | None = None
        self.last_used: float | None = None
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[_Waiter] = deque()
        self._active = 0
        self._managed = False

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
                "revision": self.spec.revision,
                "keep_alive_s": self.spec.keep_alive_s,
                "last_used": self.last_used,
            }

    @property
    def is_idle(self) -> bool:
        """Loaded, nothing running, nobody waiting, no manager: a model that may be retired."""
        return self.state == READY and not self._active and not self._queue and not self._managed

    # -- requests -------------------------------------------------------------------------------

    def acquire(self, timeout: float | None, load: Callable[[ModelEntry], None]) -> Any:
        """Wait for a slot (FIFO), load the model if needed, and return its engine."""
        waiter = _Waiter(is_request=True)
        with self._cond:
            self._queue.append(waiter)
            self._wait_for(waiter, timeout, self._request_may_enter)
            self._queue.popleft()
            self._active += 1
            self._cond.notify_all()  # the next request may take a spare slot
        try:
            return self._ready_engine(load)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        with self._cond:
            self._active -= 1
            self.last_used = self._clock()
            self._cond.notify_all()

    def _request_may_enter(self, waiter: _Waiter) -> bool:
        return (
            self._queue[0] is waiter
            and not self._managed
            and self._active < self.spec.slots
            and self.state in (UNLOADED, LOADING, READY)
        )

    def _ready_engine(self, load: Callable[[ModelEntry], None]) -> Any:
        """An admitted request's engine: wait for a load in progress, or do the load itself."""
        with self._cond:
            while self.state == LOADING:
                self._cond.wait()
            if self.state == READY:
                return self.engine
            self.state = LOADING
        try:
            load(self)
        except BaseException:
            with self._cond:
                self.state = UNLOADED  # nothing partial is published; a later request retries
                self._cond.notify_all()
            raise
        with self._cond:
            self._cond.notify_all()
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
            self._wait_for(waiter, timeout, self._manager_may_enter)
            self._queue.popleft()
            self._managed = True
        try:
            return operation(self)
        finally:
            with self._cond:
                self._managed = False
                self._cond.notify_all()

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

    def _manager_may_enter(self, waiter: _Waiter) -> bool:
        return self._queue[0] is waiter and not self._managed and not self._active

    # -- transitions, called by the holder of the model (manager or loader) ---------------------

    def publish(self, engine: Any, capacity: int | None) -> None:
        with self._cond:
            self.engine, self.capacity, self.state = engine, capacity, READY
            self.last_used = self._clock()
            self._cond.notify_all()

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

    def replace_spec(self, spec: ModelSpec) -> None:
        with self._cond:
            self.spec = spec
            self._cond.notify_all()

    # -- waiting --------------------------------------------------------------------------------

    def _wait_for(self, waiter: _Waiter, timeout: float | None, may_enter) -> None:
        deadline = None if not timeout else time.monotonic() + timeout
        while not may_enter(waiter):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self._queue.remove(waiter)
                self._cond.notify_all()  # the waiter behind may now be at the head
                raise QueueTimeout(f"waited {timeout:g} s for model {self.spec.id!r}")
            self._cond.wait(remaining)
