"""When a call is tried again, how long it waits first, and how its one deadline is shared out;
pure, so sync and async share it.

Only "come back later" replies are retried: 429 (any code: the server's `busy`, or a proxy's
rate limit) and 503 `server_busy` (the model's queue was full for the request's `timeout_s`).
Nothing else is, not even a 503 with another code: `out_of_memory` needs a smaller request,
`model_load_failed` and `insufficient_memory` need an operator, so a blind retry only adds load
(their `ApiError.retry_after_s` is there for a caller who decides otherwise). A 4xx never is.
A connection that was refused (httpx.ConnectError: nothing reached the server) is tried again
too, with the same backoff; a call that got no reply after sending is not: it may be scored.

Before retry n (n = 0, 1, ...) the call waits
    max(Retry-After, min(max_backoff_s, initial_backoff_s * 2**n)) * (1 + jitter * U[0, 1))
so it never comes back sooner than the server asked, and callers refused together spread out.

Every call has one deadline, `deadline_s` after it started. Each attempt may take the time left
(`Attempts.timeout_s`). A `/decide` or `/decide/shared` body tells the server its own share,
`timeout_s` = the time left less `RetryPolicy.server_margin_s()` (capped at the server's day),
so the server gives up queueing a call in time to say so before the client gives up on it; a
caller's own smaller `timeout_s` is kept. A retry whose wait would leave no such share (at or
past the deadline for a GET) is not attempted: the last error is raised instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from semif_serve.client.errors import ApiError

RETRIED_CODES_503 = frozenset({"server_busy"})
MAX_SERVER_TIMEOUT_S = 86_400  # the most `timeout_s` the server accepts (runtime/service.py)
MARGIN_SHARE = 0.1  # the margin is at most this share of the deadline


@dataclass(frozen=True)
class RetryPolicy:
    deadline_s: float = 600.0  # a long CPU decision or a 64-row shared call can take minutes
    initial_backoff_s: float = 0.25
    max_backoff_s: float = 10.0
    jitter: float = 0.5  # the wait grows by up to this fraction, at random
    # The server's `timeout_s` ends this long before the call's deadline: time for the body to
    # reach it and its 503 `server_busy` to come back (see server_margin_s).
    margin_s: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
            raise ValueError(f"deadline_s: must be a positive number, got {self.deadline_s!r}")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("backoff: need 0 <= initial_backoff_s <= max_backoff_s")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter: must be within 0..1, got {self.jitter!r}")
        if not (math.isfinite(self.margin_s) and self.margin_s >= 0):
            raise ValueError(f"margin_s: must be a number >= 0, got {self.margin_s!r}")

    def wait_s(self, retry: int, retry_after_s: float | None, draw: float) -> float:
        """The wait before retry number `retry` (0 for the first); `draw` is U[0, 1)."""
        backoff = min(self.max_backoff_s, self.initial_backoff_s * 2.0**retry)
        return max(retry_after_s or 0.0, backoff) * (1.0 + self.jitter * draw)

    def server_margin_s(self) -> float:
        """`margin_s`, but at most a tenth of the deadline, so a short deadline still leaves the
        server most of its time (a 1 s deadline: 0.1 s)."""
        return min(self.margin_s, self.deadline_s * MARGIN_SHARE)


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


def body_timeout_s(asked: object, share_s: float) -> object:
    """The `timeout_s` a body carries: the server's share of the time left, unless the caller
    asked for less, or for something that is not a number (kept: the server's 422 names it)."""
    if asked is None:
        return share_s
    if isinstance(asked, bool) or not isinstance(asked, int | float):
        return asked
    return asked if asked <= share_s else share_s


class Attempts:
    """One call's attempts under a policy: the time each may take, the server's share of it
    (`timed`: a body that carries `timeout_s`), and whether to try again."""

    def __init__(
        self,
        policy: RetryPolicy,
        clock: Callable[[], float],
        random: Callable[[], float],
        timed: bool = False,
    ):
        self._policy = policy
        self._clock = clock
        self._random = random
        self._deadline = clock() + policy.deadline_s
        # The last moment an attempt may start: the server's share must still be > 0.
        self._last_start = self._deadline - (policy.server_margin_s() if timed else 0.0)
        self._retries = 0

    def timeout_s(self) -> float:
        """The time left before the deadline: the next attempt's timeouts."""
        return max(0.0, self._deadline - self._clock())

    def server_timeout_s(self) -> float:
        """The server's share of the time left (the time left, for a call that is not timed);
        0 or less: too late to send the call at all."""
        return min(MAX_SERVER_TIMEOUT_S, self._last_start - self._clock())

    def wait_before_retry(self, error: ApiError) -> float | None:
        """Seconds to wait before trying again after `error`; None: raise it."""
        if not is_retried(error):
            return None
        return self._next_wait(error.retry_after_s)

    def wait_before_reconnect(self) -> float | None:
        """Seconds to wait before trying again after a refused connection; None: raise it."""
        return self._next_wait(None)

    def _next_wait(self, retry_after_s: float | None) -> float | None:
        wait = self._policy.wait_s(self._retries, retry_after_s, self._random())
        if self._clock() + wait >= self._last_start:
            return None
        self._retries += 1
        return wait
