"""`Pace`: how fast a model serves, measured on its own engine calls, and so how long the work
queued for it takes to drain: what a refused or timed-out caller is told to wait (Retry-After),
and what a request with a deadline is refused on at once when it cannot be met.

Work is counted in tokens (a request's rows x its longest prompt: `selection.Cost`, what a
batch holds of it); the rate is the tokens of the model's last WINDOW_CALLS engine calls over
the seconds they took, so it follows what the batcher and the device make of the traffic now
(a batch of eight short rows runs faster per token than eight calls of one). A request whose
size is not known yet (its model was not loaded when it queued) counts as the recent calls'
mean request. Until a call has been measured there is no estimate (None): nothing is refused
for its deadline, and a refusal says to retry in RETRY_AFTER_MIN_S.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from semif_serve.runtime.waiting import WouldTimeOut

WINDOW_CALLS = 16  # recent enough to follow the traffic, long enough to smooth one odd call
RETRY_AFTER_MIN_S = 1.0  # Retry-After's bounds: a caller never retries sooner than a second,
RETRY_AFTER_MAX_S = 60.0  # nor is told to wait longer than a minute for an estimate


@dataclass(frozen=True)
class Call:
    """One measured engine call: the tokens and requests it served, the seconds it took."""

    tokens: int
    requests: int
    seconds: float


class Rate:
    """A model's recent service rate (not thread-safe: its scheduler calls it under its lock)."""

    def __init__(self, window: int = WINDOW_CALLS):
        self._calls: deque[Call] = deque(maxlen=window)

    def record(self, tokens: int, requests: int, seconds: float) -> None:
        """A finished engine call; one that served nothing, or took no time, tells nothing."""
        if tokens > 0 and requests > 0 and seconds > 0:
            self._calls.append(Call(tokens, requests, seconds))

    def seconds_for(self, tokens: float) -> float | None:
        """How long `tokens` of work take at the recent rate (None: nothing measured yet)."""
        if not self._calls:
            return None
        served = sum(call.tokens for call in self._calls)
        return tokens * sum(call.seconds for call in self._calls) / served

    def request_tokens(self) -> float:
        """The recent calls' mean tokens per request: the size of a request not yet encoded."""
        requests = sum(call.requests for call in self._calls)
        return sum(call.tokens for call in self._calls) / requests if requests else 0.0


# A model's queue figures (`Pace.figures`: its status and /metrics): its waits and their seconds,
# those given an estimate as they queued (the estimates' seconds, and the waits' own), and the
# requests whose callers left before (queued) or while (scoring) their engine call ran.
FIGURES = (
    "waits",
    "waited_s",
    "estimated_waits",
    "estimated_s",
    "estimated_waited_s",
    "abandoned_queued",
    "abandoned_scoring",
)


class Pace:
    """One model's rate, its engine calls in progress and its queue figures, kept by its
    scheduler under the scheduler's lock. A queued request (a `jobs.Waiter`) carries its
    `tokens` (0: not encoded yet), when it `queued` and the `estimate_s` it was given."""

    def __init__(self, clock: Callable[[], float]):
        self.rate = Rate()
        self.figures: dict[str, float] = {
            name: 0.0 if name.endswith("_s") else 0 for name in FIGURES
        }
        self._clock = clock
        # Each engine call in progress, by the thread that holds its slot: (tokens, requests,
        # when it started), measured into the rate when its slot is released.
        self._running: dict[int, tuple[int, int, float]] = {}

    def ahead(self, queue: Iterable[Any], slots: int) -> float | None:
        """Seconds until the queued requests' work (one not encoded yet counts as the recent
        mean request), run on `slots` calls at once, and the longest rest of a running call
        are done (None: nothing measured)."""
        per_token = self.rate.seconds_for(1)
        if per_token is None:
            return None
        per_request = self.rate.request_tokens()
        queued = sum(waiter.tokens or per_request for waiter in queue if waiter.is_request)
        now = self._clock()
        running = [
            tokens * per_token - (now - started) for tokens, _, started in self._running.values()
        ]
        return queued * per_token / slots + max([0.0, *running])

    def admit(self, waiter: Any, queue: Iterable[Any], slots: int) -> None:
        """Give a request about to queue its estimated wait; `WouldTimeOut` when that wait
        would pass its deadline. A deadline bounds waits, as everywhere in the runtime, never
        the request's own scoring: with nothing ahead no one is refused, however short its
        timeout or slow the recent calls."""
        waiter.queued = self._clock()
        ahead = self.ahead(queue, slots)
        if ahead is None:
            return
        waiter.estimate_s = ahead
        remaining = waiter.deadline.remaining()
        if remaining is not None and 0 < ahead and remaining < ahead:
            raise WouldTimeOut(ahead, waiter.deadline.timeout_s)

    def waited(self, waiter: Any) -> None:
        """A request's wait in the queue ended: its time, against the estimate it was given."""
        waited = self._clock() - waiter.queued
        figures = self.figures
        figures["waits"] += 1
        figures["waited_s"] += waited
        if waiter.estimate_s is not None:
            figures["estimated_waits"] += 1
            figures["estimated_s"] += waiter.estimate_s
            figures["estimated_waited_s"] += waited

    def start_call(self, tokens: float, requests: int) -> None:
        """This thread's engine call starts now."""
        self._running[threading.get_ident()] = (int(tokens), requests, self._clock())

    def end_call(self, served: bool) -> None:
        """This thread's engine call (if it started one) ended; `served`: it ran to its end, so
        its time counts in the rate."""
        running = self._running.pop(threading.get_ident(), None)
        if served and running is not None:
            tokens, requests, started = running
            self.rate.record(tokens, requests, self._clock() - started)


def retry_after_s(estimate_s: float | None) -> float:
    """What a refused caller is told to wait: the estimate within [1 s, 60 s] (1 s unknown)."""
    if estimate_s is None or math.isnan(estimate_s):
        return RETRY_AFTER_MIN_S
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, estimate_s))
