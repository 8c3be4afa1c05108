"""`InFlightLimit`: at most N requests in progress (queued + scoring); the next is refused at once.

The HTTP layer asks before reading a body, so a refused request costs no body bytes (C6). The
refusal says when to retry: `estimate`, the runtime's estimated wait for the work in progress
(`Runtime.estimated_wait`; None until a call has been measured).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from semif_serve.errors import ServerBusy


class InFlightLimit:
    def __init__(self, limit: int, estimate: Callable[[], float | None] = lambda: None):
        self.limit = limit
        self.estimate = estimate
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
            f"{self.limit} requests are already in progress; retry later",
            retry_after_s=self.estimate(),
        )

    def release(self) -> None:
        with self._lock:
            if self._in_flight <= 0:
                raise RuntimeError("InFlightLimit.release() without a matching acquire()")
            self._in_flight -= 1
