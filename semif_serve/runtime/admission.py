"""`InFlightLimit`: at most N calls in progress; the next is refused at once.

Two pools: scoring requests (SEMIF_MAX_QUEUE, queued + scoring) and management calls
(MANAGEMENT_IN_FLIGHT: a PUT may hold its thread for a whole load), so that neither can take
the worker threads that `/health`, the GETs and the refusals answer on. The HTTP layer asks
before reading a body, so a refused call costs no body bytes (C6). The refusal says when to
retry: `estimate`, the runtime's estimated wait for the work in progress
(`Runtime.estimated_wait`; None until a call has been measured).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from semif_serve.errors import ServerBusy

MANAGEMENT_IN_FLIGHT = 2  # management calls (register, unload) in progress at once


class InFlightLimit:
    def __init__(
        self,
        limit: int,
        estimate: Callable[[], float | None] = lambda: None,
        what: str = "requests",
    ):
        self.limit = limit
        self.estimate = estimate
        self.what = what  # what the refusal says are in progress
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def acquire(self) -> None:
        """Count one more request in progress, or raise ServerBusy when `limit` already are."""
        with self._lock:
            if self._in_flight < self.limit:
                self._in_flight += 1
                return
        # Estimated outside the lock: it asks every model's scheduler.
        raise ServerBusy(
            f"{self.limit} {self.what} are already in progress; retry later",
            retry_after_s=self.estimate(),
        )

    def release(self) -> None:
        with self._lock:
            if self._in_flight <= 0:
                raise RuntimeError("InFlightLimit.release() without a matching acquire()")
            self._in_flight -= 1
