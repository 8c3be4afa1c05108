"""What an out-of-memory error costs, and what runs again: the one home of that policy (issue 22,
finding 4; issue 30). The engine runs every scorer call through it, and the warm-up its shapes.

In this order:
1. a batch of several requests that ran out of memory is split in halves, and each half runs
   again by these same rules (`split`): what fits runs, and nothing is dropped for it;
2. a single request that ran out of memory while its model has stored prefixes may drop them —
   only its own model's (no caller can empty a neighbour's cache), oldest first, and only as
   many as cover what the failed allocation lacked — and then runs once more without the cache
   (`relieved`); otherwise, or on a second out-of-memory error, it is a 503. What it lacked is read
from torch's message: CUDA's "Tried to allocate X. ... of which Y is free" (X - Y), the CPU
allocator's "you tried to allocate N bytes" (N: no free figure is given). When the model's stored
prefixes cannot cover it, nothing is dropped and the call is a 503 at once: a request too big for
an empty cache never costs anyone's cache nor a second failing pass. A message that names no
size drops the model's stored prefixes and retries once, as a cold call would have run.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from semif_serve.errors import OutOfMemory

T = TypeVar("T")
Attempt = Callable[[bool], T]  # runs the call, with the prefix cache (True) or without it
Relieve = Callable[[str], bool]  # drops the model's own prefixes for a shortfall: True if enough
OOM_MESSAGES = (
    "out of memory",  # CUDA, cuBLAS, cuDNN
    "can't allocate memory",  # torch's CPU allocator: "DefaultCPUAllocator: can't allocate ..."
)

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


def is_out_of_memory(error: BaseException, torch_module: Any) -> bool:
    """torch's OOM error, or a RuntimeError (CPU allocator, cuBLAS, cuDNN, CUDA) whose message
    says so, Python's MemoryError, or an `OutOfMemory` a scorer raised itself."""
    if isinstance(error, (OutOfMemory, MemoryError)):
        return True
    oom_type = getattr(torch_module, "OutOfMemoryError", None)  # torch.cuda's, exported at top
    if oom_type is not None and isinstance(error, oom_type):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(words in text for words in OOM_MESSAGES)


def relieved(attempt: Attempt[T], relieve: Relieve | None) -> T:
    """`attempt` with the cache; after an `OutOfMemory`, once more without it when `relieve`
    freed what was lacking from the model's own stored prefixes, else that error (step 2)."""
    try:
        return attempt(True)
    except OutOfMemory as error:
        failure = error  # raised below, outside the block (its frames are gone by then)
    if relieve is None or not relieve(str(failure)):
        raise failure
    return attempt(False)


def split(
    items: Sequence[Any],
    attempt: Callable[[Sequence[Any], bool], list[Any]],
    relieve: Relieve | None,
) -> list[Any]:
    """Each item's outcome, in as few calls as memory allows: all at once; after an
    `OutOfMemory`, each half by this same rule; a single item as `relieved` runs it (step 1,
    then step 2). A part's failure (its out-of-memory error included) is each of its items'."""
    if len(items) <= 1:
        try:
            return relieved(lambda cached: attempt(items, cached), relieve)
        except Exception as error:  # noqa: BLE001 - the item's outcome, raised in its request
            return [error] * len(items)
    try:
        return attempt(items, True)
    except OutOfMemory:
        pass
    except Exception as error:  # noqa: BLE001 - each item's outcome
        return [error] * len(items)
    middle = len(items) // 2
    return split(items[:middle], attempt, relieve) + split(items[middle:], attempt, relieve)


def ran_out_of_memory(call: Callable[[], Any], torch_module: Any) -> str | None:
    """Run `call` (the warm-up's shapes): None when it ran, its message when it ran out of
    memory (collected, and the device's cache emptied, once its frames are gone); any other
    error raises."""
    try:
        call()
        return None
    except Exception as error:
        if not is_out_of_memory(error, torch_module):
            raise
        message = str(error)
    gc.collect()  # the except block has ended: the failed call's tensors are unreachable
    cuda = getattr(torch_module, "cuda", None)
    if cuda is not None and cuda.is_available():
        cuda.empty_cache()
    return message
