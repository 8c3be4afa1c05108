"""The state-prefix cache: prefilled state prefixes kept across calls, within a byte budget.

A call's state prefix is the token ids the shared scorer prefills (`shared_prompts`: the longest
start every row's direct prompt provably has). Its entry is the transformers cache after that
prefill: the attention layers' keys and values AND the linear-attention layers' conv and
recurrent states at the prefix end, so a hit resumes hybrid models (Qwen3.5) exactly too. The key
is the model's identity (source, revision, dtype, device) and those exact ids.

Entries never change once stored: a call resumes from `cache.working_copy(entry)`. The budget
counts the entries' real tensor bytes; the least recently used entries are evicted first, but
never one that a running call holds (each use pins its entry). Prefixes shorter than
`min_tokens` are not worth a lookup and are not cached. One `PrefixCache` serves the process;
each loaded model uses it through its `ModelPrefixCache` view; the entries of a weights identity
go when the last model using them goes (two model ids on the same weights share them).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from semif_serve.scoring.cache import (
    cache_bytes,
    can_share_prefix,
    move_to_own_mapping,
    working_copy,
)

GIB = 1 << 30
MIN_PREFIX_TOKENS = 128  # shorter prefixes cost less to prefill again than to store and copy
COUNTERS = ("hits", "misses", "evictions")


def _key(model: tuple, ids: list[int]) -> tuple:
    """An entry's key: the model's identity and the exact prefix ids."""
    return model, tuple(ids)


@dataclass
class _Entry:
    model: tuple
    cache: Any
    nbytes: int
    pins: int = field(default=0)


class PrefixCache:
    """Stored state prefixes of every loaded model, least recently used first, within
    `budget_bytes` (0: nothing is stored). Thread-safe: parallel slots share it."""

    def __init__(self, budget_bytes: int, min_tokens: int = MIN_PREFIX_TOKENS):
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._bytes = 0
        self._counts: dict[tuple, Counter] = {}
        self._users: Counter = Counter()  # loaded engines per model identity

    def for_model(self, model: tuple) -> ModelPrefixCache:
        """The view one loaded model uses; `model` is its identity (source, revision, ...).
        Its `close()` ends that use (the entries go with the identity's last user)."""
        self.attach(model)
        return ModelPrefixCache(self, model)

    def caches(self, prefix_length: int) -> bool:
        """Whether a prefix of this many tokens is looked up and stored at all."""
        return self.budget_bytes > 0 and prefix_length >= self.min_tokens

    # Key, lookup, insert and release live in undecorated functions so that the mutation grid
    # reaches them: mutmut 3 never mutates a decorated function such as this one.
    @contextmanager
    def resume(
        self, model: tuple, ids: list[int], prefill: Callable[[], Any]
    ) -> Iterator[tuple[Any, bool]]:
        """(a cache positioned after `ids` for the caller to consume, whether it was stored
        before, whether this call stored it).

        A miss runs `prefill()` and stores its cache when the budget allows; the entry the call
        uses stays pinned until the block ends."""
        if not self.caches(len(ids)):
            yield prefill(), False, False
            return
        key = _key(model, ids)
        entry = self._take(key)
        hit = entry is not None
        if entry is None:
            prefilled = prefill()
            entry = self._insert(key, prefilled)
            if entry is None:  # not stored: the call consumes its own prefill
                yield prefilled, False, False
                return
        try:
            yield working_copy(entry.cache), hit, not hit
        finally:
            self._release(entry)

    def stats(self, model: tuple) -> dict[str, int]:
        """hits, misses, evictions (since the process started), bytes and entries (now)."""
        with self._lock:
            counts = self._counts.get(model, Counter())
            held = [entry for entry in self._entries.values() if entry.model == model]
            return {
                **{name: counts[name] for name in COUNTERS},
                "bytes": sum(entry.nbytes for entry in held),
                "entries": len(held),
            }

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def drop(self, model: tuple | None = None) -> int:
        """Forget the entries of `model` (None: of every model) that no call holds, and the
        held ones' places (their tensors go when their calls end); returns the bytes forgotten."""
        with self._lock:
            keys = [key for key, entry in self._entries.items() if model in (None, entry.model)]
            return sum(self._remove(key) for key in keys)

    def drop_oldest(self, model: tuple, at_least: int) -> int:
        """Forget `model`'s entries that no call holds, least recently used first, until at
        least `at_least` bytes are forgotten (or none is left); returns the bytes forgotten."""
        with self._lock:
            freed = 0
            for key in [key for key, entry in self._entries.items() if entry.model == model]:
                if freed >= at_least:
                    break
                if not self._entries[key].pins:
                    freed += self._remove(key)
            return freed

    def attach(self, model: tuple) -> None:
        """One more loaded engine uses `model`'s entries (two model ids on the same weights)."""
        with self._lock:
            self._users[model] += 1

    def detach(self, model: tuple) -> int:
        """One engine of `model` is going: when it was the last, its entries go too (bytes)."""
        with self._lock:
            self._users[model] -= 1
            if self._users[model] > 0:
                return 0
            del self._users[model]
        return self.drop(model)

    def _take(self, key: tuple) -> _Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            self._count(key[0], "misses" if entry is None else "hits")
            if entry is not None:
                self._entries.move_to_end(key)
                entry.pins += 1
            return entry

    def _insert(self, key: tuple, prefilled: Any) -> _Entry | None:
        """Store `prefilled` pinned once, evicting unpinned least recently used entries to make
        room; None when it cannot be shared, cannot fit (nothing is evicted then) or another call
        stored it."""
        if not can_share_prefix(prefilled):
            return None
        nbytes = cache_bytes(prefilled)
        if nbytes > self.budget_bytes:
            return None
        move_to_own_mapping(prefilled)  # outside the lock: a copy of nbytes
        with self._lock:
            if key in self._entries:
                return None
            evictable = [k for k, entry in self._entries.items() if not entry.pins]
            freeable = sum(self._entries[k].nbytes for k in evictable)
            if self._bytes - freeable + nbytes > self.budget_bytes:
                return None
            for old in evictable:
                if self._bytes + nbytes <= self.budget_bytes:
                    break
                self._count(old[0], "evictions")
                self._remove(old)
            entry = _Entry(model=key[0], cache=prefilled, nbytes=nbytes, pins=1)
            self._entries[key] = entry
            self._bytes += nbytes
            return entry

    def _release(self, entry: _Entry) -> None:
        """End one call's use of `entry`; unpinned, it can be evicted again."""
        with self._lock:
            entry.pins -= 1

    def _remove(self, key: tuple) -> int:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        return entry.nbytes

    def _count(self, model: tuple, name: str) -> None:
        self._counts.setdefault(model, Counter())[name] += 1


@dataclass(frozen=True)
class ModelPrefixCache:
    """One loaded model's view of the process-wide `PrefixCache`."""

    store: PrefixCache
    model: tuple

    def caches(self, prefix_length: int) -> bool:
        return self.store.caches(prefix_length)

    def resume(self, ids: list[int], prefill: Callable[[], Any]):
        return self.store.resume(self.model, ids, prefill)

    def stats(self) -> dict[str, int]:
        return self.store.stats(self.model)

    def drop(self, at_least: int | None = None) -> int:
        """Forget this model's entries: all of them, or the oldest that no call holds until
        `at_least` bytes are forgotten."""
        if at_least is None:
            return self.store.drop(self.model)
        return self.store.drop_oldest(self.model, at_least)

    def close(self) -> int:
        """The model is going: its entries go too, unless another loaded model id shares them."""
        return self.store.detach(self.model)
