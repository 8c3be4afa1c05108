"""The state-prefix store on hand-built caches (no model, fast enough for the mutation grid): the
key (model identity and exact ids), the byte budget and its room check, LRU eviction charged to
the evicted entry's model, pins (nested, concurrent, released on exceptions), `drop`, the stats,
the per-model view, and `cache_bytes` over attention and linear-attention layers."""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from prefix_fixtures import resume_once
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from semif_serve.scoring import prefix_cache as prefix_cache_module
from semif_serve.scoring.cache import cache_bytes
from semif_serve.scoring.prefix_cache import MIN_PREFIX_TOKENS, PrefixCache

MODEL = ("source", "test")
OTHER_MODEL = ("source", "other")
ENTRY = 128  # the bytes of a 4-token `stored_prefix`
WAIT_S = 60


def stored_prefix(tokens: int) -> DynamicCache:
    """A prefill's cache of `tokens` tokens: one attention layer, 2 * tokens * 16 bytes."""
    cache = DynamicCache()
    cache.update(torch.ones(1, 1, tokens, 4), torch.ones(1, 1, tokens, 4), 0)
    return cache


def use(cache: PrefixCache, ids: list[int], tokens: int = 4, model=MODEL) -> bool:
    """Resume after `ids` once (prefilling `tokens` tokens on a miss); whether it hit."""
    with resume_once(cache, model, ids, lambda: stored_prefix(tokens)) as (_, hit, _):
        return hit


def stored(cache: PrefixCache) -> list[tuple]:
    """The stored keys' ids, least recently used first."""
    return [key[-1] for key in cache._entries]


def counts(
    hits: int = 0, misses: int = 0, evictions: int = 0, entries: int = 0, partial_hits: int = 0
) -> dict:
    """A model's expected stats when its entries are `entries` 4-token prefixes (no
    checkpoints), less the token counts (`figures`)."""
    return {
        "hits": hits,
        "partial_hits": partial_hits,
        "misses": misses,
        "evictions": evictions,
        "bytes": entries * ENTRY,
        "entries": entries,
        "checkpoints": 0,
    }


def figures(stats: dict) -> dict:
    """A model's stats without the token counts (tests/test_prefix_reuse.py checks those)."""
    return {name: value for name, value in stats.items() if not name.endswith("_tokens")}


def hybrid_prefix() -> DynamicCache:
    """Two attention layers (one float16) and a linear-attention layer with two states, the
    second one's conv state never set: 256 + 64 + (96 + 128 + 64) bytes."""
    attention, half = DynamicLayer(), DynamicLayer()
    attention.update(torch.ones(1, 2, 4, 4), torch.ones(1, 2, 4, 4))
    half.update(torch.ones(1, 1, 4, 4, dtype=torch.float16), torch.ones(1, 1, 4, 4).half())
    linear = LinearAttentionLayer(number_of_states=2)
    linear.conv_states[0] = torch.ones(1, 8, 3)
    linear.recurrent_states[0] = torch.ones(1, 2, 4, 4)
    linear.recurrent_states[1] = torch.ones(1, 4, 4)
    cache = DynamicCache()
    cache.layers = [attention, half, linear]
    return cache


# -- bytes ---------------------------------------------------------------------------------------


def test_bytes_are_the_tensors_real_bytes():
    assert cache_bytes(stored_prefix(4)) == 2 * 4 * 4 * 4 == ENTRY
    assert cache_bytes(DynamicCache()) == 0
    assert cache_bytes(hybrid_prefix()) == 256 + 64 + 96 + 128 + 64
    cache = PrefixCache(1 << 20, min_tokens=1)
    with resume_once(cache, MODEL, [1], hybrid_prefix):
        pass
    assert cache.stats(MODEL)["bytes"] == 608 == cache.total_bytes


# -- the key: the model's identity and the exact ids ---------------------------------------------


def test_only_the_same_model_and_the_exact_ids_hit():
    """Ids that start alike are the longest-prefix lookup's (test_prefix_reuse.py); here no two
    share a first token, so each is a hit of its own exact ids or a miss."""
    cache = PrefixCache(1 << 20, min_tokens=1)
    assert not use(cache, [1, 2, 3])
    misses = [[2, 1], [3, 2, 1], [4], [5, 1, 2, 3]]
    assert [use(cache, ids) for ids in misses] == [False] * 4
    assert not use(cache, [1, 2, 3], model=OTHER_MODEL)
    assert use(cache, [1, 2, 3]) and use(cache, (1, 2, 3))  # the ids, not the list, are the key
    assert use(cache, [1, 2, 3], model=OTHER_MODEL)
    assert figures(cache.stats(MODEL)) == counts(hits=2, misses=5, entries=5)
    assert figures(cache.stats(OTHER_MODEL)) == counts(hits=1, misses=1, entries=1)


def test_models_never_share_an_entry_and_drop_only_their_own():
    cache = PrefixCache(1 << 20, min_tokens=1)
    use(cache, [1])
    assert not use(cache, [1], model=OTHER_MODEL)
    assert cache.drop(MODEL) == ENTRY
    assert cache.stats(MODEL)["entries"] == 0
    assert use(cache, [1], model=OTHER_MODEL)
    assert cache.total_bytes == ENTRY


def test_each_model_view_uses_its_own_identity():
    cache = PrefixCache(1 << 20, min_tokens=2)
    view, other = cache.for_model(MODEL), cache.for_model(OTHER_MODEL)
    assert (view.store, view.model, other.model) == (cache, MODEL, OTHER_MODEL)
    assert [view.caches(1), view.caches(2)] == [False, True]
    with resume_once(view, None, [1, 2], lambda: stored_prefix(4)) as (_, hit, _):
        assert not hit
    assert use(cache, [1, 2]) and not use(cache, [1, 2], model=OTHER_MODEL)
    with resume_once(other, None, [1, 2], lambda: stored_prefix(4)) as (_, hit, _):
        assert hit
    assert (
        figures(view.stats()) == figures(cache.stats(MODEL)) == counts(hits=1, misses=1, entries=1)
    )
    assert figures(other.stats()) == counts(hits=1, misses=1, entries=1)
    assert other.drop() == ENTRY
    assert (view.stats()["entries"], other.stats()["entries"]) == (1, 0)


# -- what is cached at all -----------------------------------------------------------------------


def test_caches_needs_a_budget_and_at_least_min_tokens():
    assert PrefixCache(1, min_tokens=4).caches(4)
    assert not PrefixCache(1, min_tokens=4).caches(3)
    assert not PrefixCache(0, min_tokens=4).caches(4)
    assert not PrefixCache(0, min_tokens=0).caches(1)
    assert PrefixCache(1).caches(MIN_PREFIX_TOKENS)
    assert not PrefixCache(1).caches(MIN_PREFIX_TOKENS - 1)


def test_a_prefix_shorter_than_min_tokens_is_neither_looked_up_nor_stored():
    cache = PrefixCache(1 << 20, min_tokens=3)
    assert [use(cache, [1, 2]), use(cache, [1, 2])] == [False, False]
    assert figures(cache.stats(MODEL)) == counts() and cache.total_bytes == 0
    assert [use(cache, [1, 2, 3]), use(cache, [1, 2, 3])] == [False, True]
    assert figures(cache.stats(MODEL)) == counts(hits=1, misses=1, entries=1)


def test_a_zero_budget_stores_and_counts_nothing():
    cache = PrefixCache(0, min_tokens=1)
    assert [use(cache, [1]), use(cache, [1])] == [False, False]
    assert figures(cache.stats(MODEL)) == counts() and cache.total_bytes == 0


def test_a_prefill_that_cannot_be_shared_is_used_once_and_not_stored():
    def sliding() -> DynamicCache:
        cache = DynamicCache()
        cache.layers = [DynamicSlidingWindowLayer(sliding_window=4)]
        cache.update(torch.ones(1, 1, 4, 4), torch.ones(1, 1, 4, 4), 0)
        return cache

    cache = PrefixCache(1 << 20, min_tokens=1)
    prefills = []

    def prefill() -> DynamicCache:
        prefills.append(sliding())
        return prefills[-1]

    for _ in range(2):
        with resume_once(cache, MODEL, [1], prefill) as (resumed, hit, _):
            assert resumed is prefills[-1] and not hit  # the call consumes its own prefill
    assert figures(cache.stats(MODEL)) == counts(misses=2) and cache.total_bytes == 0


def test_a_stored_miss_resumes_from_a_copy_and_the_entry_stays():
    cache = PrefixCache(1 << 20, min_tokens=1)
    prefilled = stored_prefix(4)
    with resume_once(cache, MODEL, [1], lambda: prefilled) as (resumed, hit, _):
        assert not hit and resumed is not prefilled
    ((key, entry),) = cache._entries.items()
    assert key == (MODEL, None, (1,)) and entry.cache is prefilled
    assert (entry.model, entry.nbytes, entry.pins) == (MODEL, ENTRY, 0)


def test_resume_says_whether_this_call_stored_the_prefix():
    """(cache, hit, stored): only the miss that stored the entry says stored (usage's
    cache_write_tokens); a hit, a short prefix, no budget or a prefix too big to keep never do."""

    def flags(cache, ids, tokens=4):
        with resume_once(cache, MODEL, ids, lambda: stored_prefix(tokens)) as (_, hit, wrote):
            return hit, wrote

    cache = PrefixCache(ENTRY, min_tokens=2)
    assert flags(cache, [1, 2]) == (False, True)
    assert flags(cache, [1, 2]) == (True, False)
    assert flags(cache, [1]) == (False, False)  # shorter than min_tokens
    assert flags(cache, [3, 4], tokens=5) == (False, False)  # over the budget: not stored
    assert flags(PrefixCache(0, min_tokens=1), [1]) == (False, False)
    assert flags(cache, [5, 6]) == (False, True)  # evicts [1, 2] to store it
    assert flags(cache, [1, 2]) == (False, True)


# -- the budget: room check and LRU eviction -----------------------------------------------------


def test_an_entry_exactly_filling_the_budget_is_stored_and_one_byte_over_is_not():
    exact = PrefixCache(ENTRY, min_tokens=1)
    assert [use(exact, [1]), use(exact, [1])] == [False, True]
    assert exact.total_bytes == ENTRY
    over = PrefixCache(ENTRY - 1, min_tokens=1)
    assert [use(over, [1]), use(over, [1])] == [False, False]
    assert figures(over.stats(MODEL)) == counts(misses=2) and over.total_bytes == 0


def test_an_entry_filling_the_budget_after_evictions_is_stored():
    cache = PrefixCache(3 * ENTRY, min_tokens=1)
    for ids in ([1], [2], [3]):
        use(cache, ids)
    assert not use(cache, [9], tokens=12)  # 384 bytes: every entry goes
    assert stored(cache) == [(9,)] and cache.total_bytes == 3 * ENTRY
    assert figures(cache.stats(MODEL)) == counts(misses=4, evictions=3) | {
        "bytes": 384,
        "entries": 1,
    }


def test_an_entry_larger_than_the_room_is_not_stored_and_evicts_nothing():
    cache = PrefixCache(2 * ENTRY, min_tokens=1)
    use(cache, [1])
    use(cache, [2])
    assert not use(cache, [9], tokens=12)  # 384 bytes > 256
    assert not use(cache, [9], tokens=12)
    assert stored(cache) == [(1,), (2,)]
    assert figures(cache.stats(MODEL)) == counts(misses=4, entries=2)


def test_one_byte_over_the_room_evicts_nothing():
    cache = PrefixCache(3 * ENTRY - 1, min_tokens=1)  # two entries and 127 bytes free
    use(cache, [1])
    use(cache, [2])
    assert not use(cache, [3], tokens=12)  # needs 384 bytes: 1 more than the whole budget
    assert stored(cache) == [(1,), (2,)] and cache.stats(MODEL)["evictions"] == 0
    assert not use(cache, [4])  # 128 bytes: 1 more than the free room, so 1 is evicted
    assert stored(cache) == [(2,), (4,)] and cache.stats(MODEL)["evictions"] == 1


def test_least_recently_used_entries_are_evicted_first():
    cache = PrefixCache(3 * ENTRY, min_tokens=1)  # three 4-token entries of 128 bytes
    for ids in ([1], [2], [3]):
        assert not use(cache, ids)
    assert use(cache, [1])  # 1 is now the most recently used; 2 the least
    assert stored(cache) == [(2,), (3,), (1,)]
    assert not use(cache, [4])
    assert stored(cache) == [(3,), (1,), (4,)]
    assert [use(cache, ids) for ids in ([1], [3], [4])] == [True, True, True]
    assert stored(cache) == [(1,), (3,), (4,)]
    assert not use(cache, [2])
    assert stored(cache) == [(3,), (4,), (2,)]
    assert figures(cache.stats(MODEL)) == counts(hits=4, misses=5, evictions=2, entries=3)


def test_only_as_many_entries_as_needed_are_evicted():
    cache = PrefixCache(4 * ENTRY, min_tokens=1)
    for ids in ([1], [2], [3], [4]):
        use(cache, ids)
    use(cache, [1])
    assert not use(cache, [5], tokens=8)  # 256 bytes: the two least recently used go
    assert stored(cache) == [(4,), (1,), (5,)]
    assert figures(cache.stats(MODEL)) == counts(hits=1, misses=5, evictions=2) | {
        "bytes": 4 * ENTRY,
        "entries": 3,
    }


def test_evictions_are_charged_to_the_evicted_entrys_model():
    cache = PrefixCache(2 * ENTRY, min_tokens=1)
    use(cache, [1])
    use(cache, [2])
    use(cache, [1], model=OTHER_MODEL)  # evicts MODEL's [1]
    use(cache, [3], model=OTHER_MODEL)  # evicts MODEL's [2]
    use(cache, [4], model=OTHER_MODEL)  # evicts OTHER_MODEL's [1]
    assert figures(cache.stats(MODEL)) == counts(misses=2, evictions=2)
    assert figures(cache.stats(OTHER_MODEL)) == counts(misses=3, evictions=1, entries=2)
    assert cache.total_bytes == 2 * ENTRY


# -- pins ----------------------------------------------------------------------------------------


def test_an_entry_in_use_is_never_evicted():
    cache = PrefixCache(2 * ENTRY, min_tokens=1)
    with resume_once(cache, MODEL, [1], lambda: stored_prefix(4)):
        use(cache, [2])
        use(cache, [3])  # evicts 2, not 1
        assert not use(cache, [4], tokens=12)  # would need 1's room: not stored
        assert cache.stats(MODEL)["entries"] == 2
    assert [use(cache, [1]), use(cache, [3])] == [True, True]


def test_an_entry_held_by_two_calls_stays_pinned_until_both_end():
    cache = PrefixCache(ENTRY, min_tokens=1)
    with resume_once(cache, MODEL, [1], lambda: stored_prefix(4)):
        with resume_once(cache, MODEL, [1], lambda: stored_prefix(4)) as (_, hit, _):
            assert hit
        assert not use(cache, [2])  # 1 is still held: 2 is not stored
        assert stored(cache) == [(1,)]
    assert not use(cache, [2])  # 1 is free now: evicted for 2
    assert stored(cache) == [(2,)] and cache.stats(MODEL)["evictions"] == 1


def test_a_released_entry_can_be_evicted():
    cache = PrefixCache(ENTRY, min_tokens=1)
    use(cache, [1])  # stored on a miss
    assert not use(cache, [2])
    assert use(cache, [2])  # released after a hit
    assert not use(cache, [3])
    assert stored(cache) == [(3,)]
    assert figures(cache.stats(MODEL)) == counts(hits=1, misses=3, evictions=2, entries=1)


@pytest.mark.parametrize("stored_first", [False, True], ids=["miss", "hit"])
def test_an_exception_inside_the_block_releases_the_pin(stored_first):
    cache = PrefixCache(ENTRY, min_tokens=1)
    if stored_first:
        use(cache, [1])
    with pytest.raises(RuntimeError, match="scoring failed"):
        with resume_once(cache, MODEL, [1], lambda: stored_prefix(4)):
            raise RuntimeError("scoring failed")
    assert not use(cache, [2])  # 1 is free: evicted for 2
    assert stored(cache) == [(2,)]


def test_a_failing_copy_releases_the_pin(monkeypatch):
    def out_of_memory(stored_cache):
        raise MemoryError("no room for the working copy")

    cache = PrefixCache(ENTRY, min_tokens=1)
    monkeypatch.setattr(prefix_cache_module, "working_copy", out_of_memory)
    with pytest.raises(MemoryError):
        use(cache, [1])
    monkeypatch.undo()
    assert stored(cache) == [(1,)]
    assert not use(cache, [2])
    assert stored(cache) == [(2,)]


def test_a_failing_prefill_stores_nothing():
    def prefill():
        raise RuntimeError("prefill failed")

    cache = PrefixCache(ENTRY, min_tokens=1)
    with pytest.raises(RuntimeError, match="prefill failed"):
        with resume_once(cache, MODEL, [1], prefill):
            pass
    assert figures(cache.stats(MODEL)) == counts(misses=1) and cache.total_bytes == 0


# -- another call storing the same prefix, concurrent calls -------------------------------------


def test_a_prefix_stored_meanwhile_by_another_call_is_kept_and_counted_once():
    cache = PrefixCache(1 << 20, min_tokens=1)
    first = stored_prefix(4)

    def prefill_while_another_call_stores_it():
        with resume_once(cache, MODEL, [7], lambda: first):
            pass
        return stored_prefix(4)

    with resume_once(cache, MODEL, [7], prefill_while_another_call_stores_it) as (resumed, hit, _):
        assert not hit and resumed is not first
    assert cache._entries[(MODEL, None, (7,))].cache is first
    assert figures(cache.stats(MODEL)) == counts(misses=2, entries=1) and cache.total_bytes == ENTRY


def test_concurrent_misses_of_one_prefix_store_it_once():
    cache = PrefixCache(1 << 20, min_tokens=1)
    both_prefilling = threading.Barrier(2, timeout=WAIT_S)

    def prefill():
        both_prefilling.wait()
        return stored_prefix(4)

    def miss():
        with resume_once(cache, MODEL, [7], prefill):
            pass

    run_threads([miss, miss])
    assert figures(cache.stats(MODEL)) == counts(misses=2, entries=1) and cache.total_bytes == ENTRY


def test_concurrent_calls_never_evict_each_others_entries():
    cache = PrefixCache(2 * ENTRY, min_tokens=1)
    all_holding = threading.Barrier(3, timeout=WAIT_S)
    hits: list[bool] = []

    def hold(ids: list[int]) -> None:
        with resume_once(cache, MODEL, ids, lambda: stored_prefix(4)) as (_, hit, _):
            hits.append(hit)
            all_holding.wait()  # every call holds its prefix at once

    run_threads([functools.partial(hold, [n]) for n in range(3)])
    assert hits == [False] * 3
    assert figures(cache.stats(MODEL)) == counts(misses=3, entries=2)  # the third did not fit
    assert cache.total_bytes == 2 * ENTRY


def test_concurrent_stores_of_different_prefixes_all_count():
    cache = PrefixCache(1 << 20, min_tokens=1)
    start = threading.Barrier(4, timeout=WAIT_S)

    def work(index: int) -> None:
        start.wait()
        for ids in range(10):
            use(cache, [index * 100 + ids, 0], model=(MODEL, index % 2))  # no shared start

    run_threads([functools.partial(work, n) for n in range(4)])
    for parity in (0, 1):
        assert figures(cache.stats((MODEL, parity))) == counts(misses=20, entries=20)
    assert cache.total_bytes == 40 * ENTRY


def run_threads(targets) -> None:
    """Run every target in its own thread; re-raise the first failure."""
    failures: list[BaseException] = []

    def guarded(target):
        try:
            target()
        except BaseException as error:  # reported below, not lost in the thread
            failures.append(error)

    threads = [threading.Thread(target=guarded, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads)
    if failures:
        raise failures[0]


# -- drop and stats ------------------------------------------------------------------------------


def test_drop_returns_the_bytes_it_forgets():
    cache = PrefixCache(1 << 20, min_tokens=1)
    use(cache, [1])
    use(cache, [2], tokens=8)
    use(cache, [1], model=OTHER_MODEL)
    assert cache.drop(MODEL) == 3 * ENTRY
    assert cache.total_bytes == ENTRY and stored(cache) == [(1,)]
    assert cache.drop(MODEL) == 0
    use(cache, [2])
    assert cache.drop() == 2 * ENTRY  # every model
    assert cache.total_bytes == 0 and cache.drop() == 0
    assert figures(cache.stats(OTHER_MODEL)) == counts(misses=1)


def test_drop_forgets_a_held_entry_and_its_call_ends_normally():
    cache = PrefixCache(1 << 20, min_tokens=1)
    with resume_once(cache, MODEL, [1], lambda: stored_prefix(4)) as (resumed, _, _):
        assert cache.drop(MODEL) == ENTRY
        assert cache.total_bytes == 0
        assert cache_bytes(resumed) == ENTRY  # the call still has its tensors
    assert not use(cache, [1])
    assert figures(cache.stats(MODEL)) == counts(misses=2, entries=1)


def test_stats_of_a_model_never_seen_are_zero():
    cache = PrefixCache(1 << 20, min_tokens=1)
    assert figures(cache.stats(MODEL)) == counts()
    use(cache, [1])
    assert figures(cache.stats(OTHER_MODEL)) == counts()


def test_stats_count_every_hit_and_miss_since_the_start():
    cache = PrefixCache(1 << 20, min_tokens=1)
    for ids in ([1], [1], [2], [1], [2], [3]):
        use(cache, ids)
    assert figures(cache.stats(MODEL)) == counts(hits=3, misses=3, entries=3)
    cache.drop()
    assert figures(cache.stats(MODEL)) == counts(hits=3, misses=3)


# -- what an out-of-memory error and a closing model may forget (issue 22, findings 4 and 7) ----


def test_drop_oldest_forgets_unheld_entries_least_recently_used_first_until_enough():
    cache = PrefixCache(1 << 20, min_tokens=1)
    for ids in ([1], [2], [3], [4]):
        use(cache, ids)
    use(cache, [9], model=OTHER_MODEL)
    use(cache, [1])  # now the most recently used
    with resume_once(cache, MODEL, [2], lambda: stored_prefix(4)):  # held by a running call
        assert cache.drop_oldest(MODEL, 2 * ENTRY - 1) == 2 * ENTRY  # [3] and [4], not [2]
    assert stored(cache) == [(9,), (1,), (2,)]
    assert cache.drop_oldest(MODEL, ENTRY) == ENTRY and stored(cache) == [(9,), (2,)]
    assert cache.drop_oldest(MODEL, 0) == 0 and stored(cache) == [(9,), (2,)]
    assert cache.drop_oldest(MODEL, 10 * ENTRY) == ENTRY  # all it has
    assert stored(cache) == [(9,)] and cache.total_bytes == ENTRY  # the neighbour's stays


def test_a_views_drop_is_all_or_the_oldest():
    cache = PrefixCache(1 << 20, min_tokens=1)
    view = cache.for_model(MODEL)
    for ids in ([1], [2], [3]):
        use(cache, ids)
    assert view.drop(at_least=1) == ENTRY and stored(cache) == [(2,), (3,)]
    assert view.drop() == 2 * ENTRY and stored(cache) == []


def test_entries_shared_by_two_model_ids_go_with_the_last_of_them():
    cache = PrefixCache(1 << 20, min_tokens=1)
    first, second = cache.for_model(MODEL), cache.for_model(MODEL)  # one folder, two ids
    other = cache.for_model(OTHER_MODEL)
    use(cache, [1])
    use(cache, [1], model=OTHER_MODEL)
    assert first.close() == 0 and stored(cache) == [(1,), (1,)]  # the second id still serves
    assert use(cache, [1])
    assert second.close() == ENTRY and cache.stats(MODEL)["entries"] == 0
    assert other.close() == ENTRY and cache.total_bytes == 0
    again = cache.for_model(MODEL)  # loaded again later: counted afresh
    use(cache, [1])
    assert again.close() == ENTRY


# -- a prefix stored from a batch's forward (issue 44) -------------------------------------------


def test_finds_says_whether_a_call_would_resume_without_counting_or_pinning():
    cache = PrefixCache(1 << 20, min_tokens=2)
    assert not cache.finds(MODEL, [1, 2, 3])
    use(cache, [1, 2, 3])
    before = cache.stats(MODEL)
    assert cache.finds(MODEL, [1, 2, 3]) and cache.finds(MODEL, [1, 2, 3, 4])  # hit, grown
    assert cache.finds(MODEL, [1, 2, 9])  # an attention entry cut at the 2 shared tokens
    assert not cache.finds(MODEL, [1, 9, 9])  # 1 shared token: under min_tokens
    assert not cache.finds(OTHER_MODEL, [1, 2, 3]) and not cache.finds(MODEL, [1, 2, 3], "s")
    assert cache.stats(MODEL) == before
    assert all(entry.pins == 0 for entry in cache._entries.values())
    view = cache.for_model(MODEL)
    assert view.finds([1, 2, 3]) and not view.within("s").finds([1, 2, 3])


def test_keep_stores_a_batchs_prefill_as_a_miss_would_and_unpinned():
    cache = PrefixCache(1 << 20, min_tokens=2)
    view = cache.for_model(MODEL).within("s")
    prefill = stored_prefix(4)
    assert view.keep([1, 2, 3, 4], prefill)
    assert stored(cache) == [(1, 2, 3, 4)] and cache._entries[(MODEL, "s", (1, 2, 3, 4))].pins == 0
    stats = cache.stats(MODEL)
    assert figures(stats) == counts(misses=1, entries=1)
    assert stats["prefilled_tokens"] == 4
    assert not view.keep([1, 2, 3, 4], stored_prefix(4))  # stored already: kept once
    assert cache.stats(MODEL)["entries"] == 1
    with resume_once(view, None, [1, 2, 3, 4], lambda: stored_prefix(4)) as (_, hit, _):
        assert hit
    assert not use(cache, [1, 2, 3, 4])  # another session's entry: not this sessionless call's


def test_keep_stores_nothing_it_would_not_cache():
    cache = PrefixCache(ENTRY - 1, min_tokens=2)
    assert not cache.keep(MODEL, [1], stored_prefix(4))  # under min_tokens: not even counted
    assert cache.stats(MODEL)["misses"] == 0
    assert not cache.keep(MODEL, [1, 2, 3, 4], stored_prefix(4))  # over the budget
    assert cache.stats(MODEL)["misses"] == 1 and cache.total_bytes == 0
    sliding = DynamicCache()
    sliding.layers = [DynamicSlidingWindowLayer(sliding_window=8)]
    assert not PrefixCache(1 << 20, min_tokens=1).keep(MODEL, [1, 2], sliding)
