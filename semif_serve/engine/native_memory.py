"""The C heap of a CPU worker (glibc malloc): how many heaps it keeps, and handing free pages back.

torch allocates CPU tensors with malloc. glibc gives every thread that allocates a heap of its
own (an arena; at most 8 per core), and once a big block has been freed it raises its mmap
threshold (up to 32 MiB), so from then on nearly every tensor of a call is carved from those
heaps rather than mapped on its own. A heap hands memory back to the system only from its top:
the pages of blocks freed below a block still in use stay resident. A worker serves each request
on whichever of its threads is free, so after a stream of long calls each of up to 16 heaps kept
its own high-water mark (docs/performance.md, "Memory bounded by the budget").

- `limit_arenas(ARENAS)` at worker start (semif_serve/server.py): the worker's threads share
  ARENAS heaps instead of up to 8 per core.
- `resident_bytes()` and `trim()`: the process's resident bytes, and glibc's `malloc_trim(0)`,
  which hands every heap's free pages back.
- `release_over(baseline, held)` after a call: trims when the process holds more than its
  post-warm-up `baseline` + the `held` bytes it keeps on purpose (stored state prefixes) +
  RELEASE_MARGIN_BYTES, as the engine empties torch's CUDA cache on a GPU. A trim costs tens of
  milliseconds and the next call's page faults, so it is not done after every call.

Without glibc (musl, macOS) or /proc, the calls change nothing and say so (False, None).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

ARENAS = 2  # the worker's heaps: scorer calls hold the engine's lock, so few allocate at once
RELEASE_MARGIN_BYTES = 128 * 1024 * 1024  # what a CPU call may leave resident before a trim
M_ARENA_MAX = -8  # mallopt's parameter number (malloc.h)


@functools.cache
def _libc() -> Any:
    """The C library the process runs on (None where ctypes cannot open it)."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _function(name: str) -> Any:
    return getattr(_libc(), name, None)


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Let the process's threads share at most `arenas` malloc heaps from now on (heaps that
    already exist stay); False where the C library is not glibc."""
    mallopt = _function("mallopt")
    if mallopt is None or _function("malloc_trim") is None:  # mallopt alone: not glibc's
        log.info("no glibc malloc: the worker keeps the C library's own heap policy")
        return False
    return mallopt(M_ARENA_MAX, arenas) == 1


def trim() -> bool:
    """Hand the free pages of every malloc heap back to the system (glibc's `malloc_trim(0)`);
    whether any went back. False where the C library is not glibc."""
    malloc_trim = _function("malloc_trim")
    return malloc_trim is not None and malloc_trim(0) == 1


def resident_bytes() -> int | None:
    """The process's resident bytes now (None without /proc)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def release_over(baseline: int | None, held: int, margin: int = RELEASE_MARGIN_BYTES) -> bool:
    """After a call: when the process holds more than `baseline` + `held` + `margin` resident
    bytes, hand the heaps' free pages back (`trim`); whether it tried. `baseline` None: never
    recorded (a GPU engine, or no /proc)."""
    if baseline is None:
        return False
    resident = resident_bytes()
    if resident is None or resident <= baseline + held + margin:
        return False
    trim()
    return True
