"""The state-prefix cache: prefilled state prefixes kept across calls, within a byte budget.

A call's state prefix is the token ids the shared scorer prefills (`shared_prompts`: the longest
start every row's direct prompt provably has). Its entry is the transformers cache after that
prefill: the attention layers' keys and values AND the linear-attention layers' conv and
recurrent states at the prefix end. Entries are keyed by the model's identity (source, revision,
dtype, device), the callers' session (`Row.cache_key`: X-Semif-Session or a Decisions request's
prompt_cache_key; None for calls that name none) and their exact ids. A call finds and stores
entries of its own session only: no session's `cache_hit` or timing tells of another's states.

A call resumes from the stored entry sharing the longest start with its ids (`prefix_tree`),
when that start is at least `min_tokens` long; otherwise it is a miss:
- the whole prefix stored: a hit, resumed from a working copy (`cache.working_copy`);
- a stored entry that is a strict prefix of the ids ("end"): resumed at its end, the rest
  prefilled (a state that grew);
- an attention-only entry that diverges later ("crop"): its keys and values cut at the common
  length, the rest prefilled;
- linear-attention layers cannot be cut, so an entry of a hybrid model (Qwen3.5) also keeps
  checkpoints: copies of those layers' states at chosen positions (every `checkpoint_tokens`
  tokens, and any marked ones); it resumes at the latest checkpoint inside the common start.
Results are the same as a cold prefill's within float rounding (tests/test_prefix_growth.py).
A grown entry supersedes the entry it grew from (but for its last few tokens: a JSON state's
closing characters): that one goes as soon as no call holds it, so a log that grows a hundred
times holds about one entry, not a hundred.

Entries never change once stored. The budget counts the entries' real tensor bytes, checkpoints
included; the least recently used entries are evicted first, but never one that a running call
holds (each use pins its entry). Prefixes shorter than `min_tokens` are not worth a lookup and
are not cached. One `PrefixCache` serves the process; each loaded model uses it through its
`ModelPrefixCache` view; the entries of a weights identity go when the last model using them
goes (two model ids on the same weights share them).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from semif_serve.scoring.cache import (
    cache_bytes,
    can_share_prefix,
    checkpoint_bytes,
    has_linear_layers,
    move_to_own_mapping,
    resumed_at,
    working_copy,
)
from semif_serve.scoring.checkpoints import (
    BREAKPOINT,
    CHECKPOINT_TOKENS,
    checkpoint_stops,
    resume_point,
)
from semif_serve.scoring.prefix_tree import PrefixTree

GIB = 1 << 30
MIN_PREFIX_TOKENS = 128  # shorter prefixes cost less to prefill again than to store and copy
# A new entry supersedes the one it resumed from when that one's ids differ from its own in at
# most this many last tokens: a grown state (none), or a grown JSON state, whose earlier version
# ended in closing characters (`"}]}`) where the new one goes on.
SUPERSEDED_TAIL = 16
COUNTERS = ("hits", "partial_hits", "misses", "evictions", "reused_tokens", "prefilled_tokens")
# prefill(base, start, stops) -> (cache after all the ids, {stop: linear_checkpoint there}):
# from `base` (a cache positioned after ids[:start]; None: nothing, start 0), prefilling the
# rest and taking a checkpoint at each stop when the model has linear-attention layers.
Prefill = Callable[[Any, int, list[int]], tuple[Any, dict[int, Any]]]


@dataclass(frozen=True)
class Reuse:
    """What a call's prefix was resumed from: `tokens` of it came from a stored entry (0: a
    miss), at a point of kind `point`; `hit`: all of it; `stored`: this call stored it."""

    tokens: int = 0
    point: str | None = None
    hit: bool = False
    stored: bool = False


@dataclass
class _Entry:
    model: tuple
    partition: str | None  # the callers' session that may reuse it (None: sessionless calls)
    ids: tuple[int, ...]
    cache: Any
    nbytes: int
    pins: int = field(default=0)
    checkpoints: dict[int, tuple[str, Any]] = field(default_factory=dict)  # position: kind, states
    recurrent: bool = False  # has linear-attention layers: resumes only at checkpoints or its end
    superseded: bool = False  # a grown entry replaced it: it goes when no call holds it


@dataclass(frozen=True)
class _Found:
    entry: _Entry
    shared: int  # the tokens the call's ids have in common with the entry's, from the start
    tokens: int  # of those, the ones it resumes
    point: str
    states: Any  # the linear checkpoint at `tokens` (None: the entry's own, or none needed)


def _key(space: tuple, ids: list[int] | tuple[int, ...]) -> tuple:
    """An entry's key: its space (the model's identity, the session) and the exact prefix ids."""
    return *space, tuple(ids)


def _space(entry: _Entry) -> tuple:
    """Where `entry` can be found: its model's identity and its session."""
    return entry.model, entry.partition


def _copy(found: _Found) -> Any:
    """A cache positioned where `found` resumes, for a call to consume."""
    entry = found.entry
    if found.tokens == len(entry.ids):
        return working_copy(entry.cache)
    return resumed_at(entry.cache, found.tokens, found.states)


class PrefixCache:
    """Stored state prefixes of every loaded model, least recently used first, within
    `budget_bytes` (0: nothing is stored). Thread-safe: parallel slots share it."""

    def __init__(
        self,
        budget_bytes: int,
        min_tokens: int = MIN_PREFIX_TOKENS,
        checkpoint_tokens: int = CHECKPOINT_TOKENS,
    ):
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
        self.checkpoint_tokens = checkpoint_tokens
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._trees: dict[tuple, PrefixTree] = {}  # each (model, session)'s stored ids
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
        self,
        model: tuple,
        ids: list[int],
        prefill: Prefill,
        marks: dict[int, str] | None = None,
        partition: str | None = None,
        chunk: int = 1,
    ) -> Iterator[tuple[Any, Reuse]]:
        """(a cache positioned after `ids` for the caller to consume, what it reused).

        The longest stored start of `ids` among the entries of `model` and the caller's session
        `partition` is resumed and the rest prefilled (`prefill`); the result is stored, in
        that session, when the budget allows. `marks`: positions where a hybrid entry keeps a
        checkpoint besides every `checkpoint_tokens`, and their kinds; each checkpoint is taken
        at the start of its `chunk` (`checkpoints.checkpoint_stops`). The entries the call uses
        stay pinned until the block ends."""
        if not self.caches(len(ids)):
            yield prefill(None, 0, [])[0], Reuse()
            return
        space = (model, partition)
        found = self._take(space, ids)
        try:
            if found is not None and found.tokens == len(ids):  # nothing left to prefill
                yield _copy(found), Reuse(len(ids), found.point, hit=True)
                return
            prefilled, entry, reuse = self._prefill_rest(
                space, ids, prefill, marks or {}, found, chunk
            )
            if entry is None:  # not stored: the call consumes its own prefill
                yield prefilled, reuse
                return
            try:
                yield working_copy(entry.cache), reuse
            finally:
                self._release(entry)
        finally:
            if found is not None:
                self._release(found.entry)

    def _prefill_rest(
        self,
        space: tuple,
        ids: list[int],
        prefill: Prefill,
        marks: dict[int, str],
        found: _Found | None,
        chunk: int,
    ) -> tuple[Any, _Entry | None, Reuse]:
        """Prefill what `found` (None: a miss) does not resume, taking the checkpoints, and
        store the result: (the prefilled cache, its entry pinned or None, what was reused)."""
        start = 0 if found is None else found.tokens
        base = None if found is None else _copy(found)
        stops = checkpoint_stops(start, len(ids), self.checkpoint_tokens, marks, chunk)
        prefilled, states = prefill(base, start, sorted(stops))
        checkpoints = {at: (stops[at], taken) for at, taken in states.items()}
        entry = self._insert(space, ids, prefilled, checkpoints, found)
        self._count(space[0], "prefilled_tokens", len(ids) - start)
        point = None if found is None else found.point
        return prefilled, entry, Reuse(start, point, stored=entry is not None)

    def finds(self, model: tuple, ids: list[int], partition: str | None = None) -> bool:
        """Whether `resume` would resume `ids` from a stored entry (nothing counted or pinned)."""
        with self._lock:
            return bool(self._usable((model, partition), ids))

    def keep(self, model: tuple, ids: list[int], prefilled: Any, partition: str | None = None):
        """Store `prefilled`, a cache after exactly `ids` that a batch forward made, as `resume`
        stores a miss's prefill (counted as one: a miss, its tokens prefilled); True if stored
        (not when it is not cached at all, already stored, or does not fit)."""
        if not self.caches(len(ids)):
            return False
        with self._lock:
            self._count(model, "misses")
            self._count(model, "prefilled_tokens", len(ids))
        entry = self._insert((model, partition), ids, prefilled, {}, None)
        if entry is None:
            return False
        self._release(entry)
        return True

    def stats(self, model: tuple) -> dict[str, int]:
        """The counters (since the process started), and bytes, entries and checkpoints (now)."""
        with self._lock:
            counts = self._counts.get(model, Counter())
            held = [entry for entry in self._entries.values() if entry.model == model]
            return {
                **{name: counts[name] for name in COUNTERS},
                "bytes": sum(entry.nbytes for entry in held),
                "entries": len(held),
                "checkpoints": sum(len(entry.checkpoints) for entry in held),
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

    def _take(self, space: tuple, ids: list[int]) -> _Found | None:
        """The stored entry of `space` to resume from, pinned, and where (None: a miss);
        counted for its model."""
        model = space[0]
        with self._lock:
            usable = self._usable(space, ids)
            best = max(usable, key=lambda one: one.tokens, default=None)  # the first of a tie
            if best is None:
                self._count(model, "misses")
                return None
            self._count(model, "hits" if best.tokens == len(ids) else "partial_hits")
            self._count(model, "reused_tokens", best.tokens)
            self._entries.move_to_end(_key(space, best.entry.ids))
            best.entry.pins += 1
            return best

    def _usable(self, space: tuple, ids: list[int]) -> list[_Found]:
        """The stored entries of `space` a call over `ids` could resume from, and where (call
        with the lock held)."""
        tree = self._trees.get(space)
        matched = tree.matches(ids, self.min_tokens) if tree else []
        found = [
            _Found(self._entries[key], shared, *resume_point(self._entries[key], shared))
            for key, shared in matched
        ]
        return [one for one in found if one.tokens >= self.min_tokens]

    def _insert(
        self,
        space: tuple,
        ids: list[int],
        prefilled: Any,
        checkpoints: dict[int, tuple[str, Any]],
        parent: _Found | None,
    ) -> _Entry | None:
        """Store `prefilled` pinned once, evicting unpinned least recently used entries to make
        room; None when it cannot be shared, cannot fit (nothing is evicted then) or another call
        stored it. It keeps the parent's checkpoints inside the part it resumed, and supersedes
        a parent that is a start of `ids` but for at most SUPERSEDED_TAIL last tokens (it goes
        when no call holds it)."""
        if not can_share_prefix(prefilled):
            return None
        if parent is not None:
            inherited = {at: c for at, c in parent.entry.checkpoints.items() if at <= parent.tokens}
            checkpoints = inherited | checkpoints
        nbytes = cache_bytes(prefilled) + sum(checkpoint_bytes(c) for _, c in checkpoints.values())
        if nbytes > self.budget_bytes:
            return None
        move_to_own_mapping(prefilled)  # outside the lock: a copy of nbytes
        key = _key(space, ids)
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
                self._count(self._entries[old].model, "evictions")
                self._remove(old)
            entry = _Entry(
                model=space[0],
                partition=space[1],
                ids=key[-1],
                cache=prefilled,
                nbytes=nbytes,
                pins=1,
                checkpoints=checkpoints,
                recurrent=has_linear_layers(prefilled),
            )
            self._entries[key] = entry
            self._trees.setdefault(space, PrefixTree()).add(key, key[-1])
            self._bytes += nbytes
            if parent is not None and len(parent.entry.ids) - parent.shared <= SUPERSEDED_TAIL:
                parent.entry.superseded = True
            return entry

    def _release(self, entry: _Entry) -> None:
        """End one call's use of `entry`; unpinned, it can be evicted again, and a superseded
        entry goes."""
        with self._lock:
            entry.pins -= 1
            key = _key(_space(entry), entry.ids)
            if not entry.pins and entry.superseded and self._entries.get(key) is entry:
                self._remove(key)

    def _remove(self, key: tuple) -> int:
        entry = self._entries.pop(key)
        tree = self._trees[_space(entry)]
        tree.remove(key, entry.ids)
        if not len(tree):
            del self._trees[_space(entry)]
        self._bytes -= entry.nbytes
        return entry.nbytes

    def _count(self, model: tuple, name: str, amount: int = 1) -> None:
        self._counts.setdefault(model, Counter())[name] += amount


@dataclass(frozen=True)
class ModelPrefixCache:
    """One loaded model's view of the process-wide `PrefixCache`."""

    store: PrefixCache
    model: tuple
    partition: str | None = None  # the session whose entries `resume` finds and stores
    breakpoints: tuple[int, ...] = ()  # the call's marked prefix positions (a checkpoint each)

    def within(self, partition: str | None, breakpoints: tuple[int, ...] = ()) -> ModelPrefixCache:
        """This view for the calls of session `partition` (None: sessionless calls), whose
        callers marked the prefix positions `breakpoints` (`scoring.breakpoints`)."""
        return replace(self, partition=partition, breakpoints=breakpoints)

    def caches(self, prefix_length: int) -> bool:
        return self.store.caches(prefix_length)

    def resume(self, ids: list[int], prefill: Prefill, chunk: int = 1):
        marks = {at: BREAKPOINT for at in self.breakpoints}
        return self.store.resume(self.model, ids, prefill, marks, self.partition, chunk)

    def finds(self, ids: list[int]) -> bool:
        return self.store.finds(self.model, ids, self.partition)

    def keep(self, ids: list[int], prefilled: Any) -> bool:
        return self.store.keep(self.model, ids, prefilled, self.partition)

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
