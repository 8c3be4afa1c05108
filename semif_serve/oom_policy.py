"""What an out-of-memory error in a scorer call may cost the state-prefix cache, and whether the
call runs again: the one home of that policy (issue 22, finding 4).

A call that ran out of memory while its model has stored prefixes may drop them — only its own
model's (no caller can empty a neighbour's cache), oldest first, and only as many as cover what
the failed allocation lacked — and then runs once more without the cache. What it lacked is read
from torch's message: CUDA's "Tried to allocate X. ... of which Y is free" (X - Y), the CPU
allocator's "you tried to allocate N bytes" (N: no free figure is given). When the model's stored
prefixes cannot cover it, nothing is dropped and the call is a 503 at once: a request too big for
an empty cache never costs anyone's cache nor a second failing pass. A message that names no
size drops the model's stored prefixes and retries once, as a cold call would have run.
"""

from __future__ import annotations

import re

UNITS = {"bytes": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
TRIED = re.compile(r"tried to allocate ([0-9.]+) ?(bytes|[kmgt]ib|b)\b", re.IGNORECASE)
FREE = re.compile(r"of which ([0-9.]+) ?(bytes|[kmgt]ib|b) is free", re.IGNORECASE)


def shortfall(message: str) -> int | None:
    """Bytes the failed allocation lacked, from torch's out-of-memory message (None: it does
    not say how much was asked)."""
    tried = _size(TRIED.search(message))
    if tried is None:
        return None
    free = _size(FREE.search(message)) or 0
    return max(tried - free, 0)


def bytes_to_drop(stored: int, lacking: int | None) -> int | None:
    """How many of the model's `stored` prefix bytes to drop before one more try (None: drop
    nothing and fail at once). An unknown shortfall drops them all."""
    if stored <= 0:
        return None
    if lacking is None:
        return stored
    lacking = max(lacking, 1)  # asked no more than was free (fragmented): drop one at least
    return lacking if lacking <= stored else None


def _size(match: re.Match | None) -> int | None:
    if match is None:
        return None
    number, unit = match.groups()
    try:
        return int(float(number) * UNITS[unit.lower()])
    except (ValueError, OverflowError):
        return None
