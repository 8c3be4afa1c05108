"""When a call is tried again, and how long it waits first; pure, so sync and async share it.

Only "come back later" replies are retried: 429 (any code: the server's `busy`, or a proxy's
rate limit) and 503 `server_busy` (the model's queue was full for the request's `timeout_s`).
Nothing else is, not even a 503 with another code: `out_of_memory` needs a smaller request,
`model_load_failed` and `insufficient_memory` need an operator, so a blind retry only adds load
(their `ApiError.retry_after_s` is there for a caller who decides otherwise). A 4xx never is.

Before retry n (n = 0, 1, ...) the call waits
    max(Retry-After, min(max_backoff_s, initial_backoff_s * 2**n)) * (1 + jitter * U[0, 1))
so it never comes back sooner than the server asked, and callers refused together spread out.
Every call has one deadline, `deadline_s` after it started: each attempt's timeouts are the time
left, and a retry whose wait would end at or after the deadline is not attempted; the last error
is raised instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from semif_serve.client.errors import ApiError

RETRIED_CODES_503 = frozenset({"server_busy"})


@dataclass(frozen=True)
class RetryPolicy:
    deadline_s: float = 600.0  # a long CPU decision or a 64-row shared call can take minutes
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 10.0
    jitter: float = 0.5  # the wait grows by up to this fraction, at random

    def __post_init__(self) -> None:
        if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ValueError(f"deadline_s: must be a positive number, got {self.deadline_s!r}")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("backoff: need 0 <= initial_backoff_s <= max_backoff_s")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter: must be within 0..1, got {self.jitter!r}")

    def wait_s(self, retry: int, retry_after_s: float | None, draw: float) -> float:
        """The wait before retry number `retry` (0 for the first); `draw` is U[0, 1)."""
        backoff = min(self.max_backoff_s, self.initial_backoff_s * 2.0**retry)
        return max(retry_after_s or 0.0, backoff) * (1.0 + self.jitter * draw)


def is_retried(error: ApiError) -> bool:
    return error.status == 429 or (error.status == 503 and error.code in RETRIED_CODES_503)


def parse_retry_after(value: str | None, wall_clock: Callable[[], float]) -> float | None:
    """Retry-After in seconds from now: delay-seconds or an HTTP-date; None when absent or not
    understood (a date in the past is 0)."""
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT; a zone-less one is read as such
        return None
    return max(0.0, when.timestamp() - wall_clock())


class Attempts:
    """One call's attempts under a policy: the time each may take, and whether to try again."""

    def __init__(
        self, policy: RetryPolicy, clock: Callable[[], float], random: Callable[[], float]
    ):
        self._policy = policy
        self._clock = clock
        self._random = random
        self._deadline = clock() + policy.deadline_s
        self._retries = 0

    def timeout_s(self) -> float:
        """The time left before the deadline: the next attempt's timeouts."""
        return max(0.0, self._deadline - self._clock())

    def wait_before_retry(self, error: ApiError) -> float | None:
        """Seconds to wait before trying again after `error`; None: raise it."""
        if not is_retried(error):
            return None
        wait = self._policy.wait_s(self._retries, error.retry_after_s, self._random())
        if self._clock() + wait >= self._deadline:
            return None
        self._retries += 1
        return wait
