"""Deadlines and bounded waits: how every wait in the runtime ends.

A request's deadline is fixed once, when it arrives (`deadline_after`: its `timeout_s`, or the
queue timeout), and every wait it makes is bounded by that one instant: for its model's queue,
for company in a batch, for a load, for the device. `wait_until` is the one wait loop: it
returns once its predicate holds, raises `QueueTimeout` once the deadline has passed and
`WaiterGone` once the caller's `gone` check (asked every GONE_POLL_S) says it left.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# The longest a waiter waits (30 days). Longer timeouts are clamped before any arithmetic: a
# 400-digit integer overflows a float deadline, and Condition.wait refuses more than ~9.2e9 s.
MAX_WAIT_S = 30 * 24 * 3600.0
GONE_POLL_S = 0.25  # how often a waiting request asks whether its caller is still there

Gone = Callable[[], bool]  # True once the request's caller has closed its connection


class QueueTimeout(Exception):
    """Waited past the deadline; the waiter left its queue and holds nothing."""


class WouldTimeOut(QueueTimeout):
    """Refused as it queued: the work ahead of it (`ahead_s`, as `pace.Pace` estimates it)
    would not be done before its deadline; it never entered the queue."""

    def __init__(self, ahead_s: float, timeout_s: float | None):
        super().__init__(
            f"the model's queue holds about {ahead_s:.1f} s of work, more than this request's "
            f"timeout of {timeout_s:g} s allows it to wait"
        )
        self.ahead_s = ahead_s


class WaiterGone(Exception):
    """The request's caller went away while it waited; it left its queue and holds nothing."""


@dataclass(frozen=True)
class Deadline:
    """When a request's waits end: `at` (monotonic; None: never), `timeout_s` after it arrived."""

    at: float | None
    timeout_s: float | None

    @property
    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def remaining(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()


NEVER = Deadline(None, None)


def deadline_after(timeout: float | None, now: float | None = None) -> Deadline:
    """The deadline of a wait of `timeout` seconds from `now` (None or 0: never)."""
    if not timeout:
        return NEVER
    timeout = min(MAX_WAIT_S, timeout)  # in this order, a NaN becomes MAX_WAIT_S too
    return Deadline((time.monotonic() if now is None else now) + timeout, timeout)


def wait_until(
    cond: threading.Condition,
    ready: Callable[[], bool],
    deadline: Deadline,
    gone: Gone | None,
    what: str,
) -> None:
    """Wait on `cond` (held by the caller) until `ready()`; `what` names the wait in errors."""
    while not ready():
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            raise QueueTimeout(f"waited {deadline.timeout_s:g} s for {what}")
        if gone is not None:
            if gone():
                raise WaiterGone(f"the caller left while waiting for {what}")
            remaining = GONE_POLL_S if remaining is None else min(remaining, GONE_POLL_S)
        cond.wait(remaining)
