"""Longest-prefix reuse in the state-prefix store, on a fake model whose caches say which ids
they hold (`prefix_fixtures.token_prefill`; fast enough for the mutation grid): a grown state
resumes at its parent's end and supersedes it, an attention-only entry is cut where a new state
diverges, a hybrid entry resumes at its latest checkpoint inside the common start, the counters,
and the checkpoints' positions, inheritance and bytes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prefix_fixtures import read_ids, token_prefill

from semif_serve.scoring.cache import cache_bytes, checkpoint_bytes
from semif_serve.scoring.checkpoints import (
    BOUNDARY,
    BOUNDARY_TOKENS,
    BREAKPOINT,
    CHECKPOINT,
    CROP,
    END,
    LINEAR_CHUNK_TOKENS,
    checkpoint_stops,
    chunk_start,
)
from semif_serve.scoring.prefill import linear_chunk, prefill_length
from semif_serve.scoring.prefix_cache import SUPERSEDED_TAIL, PrefixCache, Reuse
from semif_serve.scoring.shapes import DEFAULT

MODEL = ("source", "test")
STATE = list(range(1, 201))  # 200 ids, none 0


def run(cache, ids, linear=False, marks=None, model=MODEL, session=None):
    """One call over `ids` in `session`: (what it reused, the prefill's calls)."""
    calls = []
    prefill = token_prefill(ids, linear, calls)
    with cache.resume(model, ids, prefill, marks, session) as (resumed, reuse):
        assert read_ids(resumed) == list(ids)
    return reuse, calls


def entries(cache) -> list[list[int]]:
    return [list(entry.ids) for entry in cache._entries.values()]


def grown(ids, *extra) -> list[int]:
    return list(ids) + list(extra)


# -- attention-only models ------------------------------------------------------------------------


def test_a_grown_state_resumes_at_its_parents_end_and_replaces_it():
    cache = PrefixCache(1 << 20, min_tokens=8)
    assert run(cache, STATE) == (Reuse(stored=True), [(0, [198])])  # the boundary, asked
    longer = grown(STATE, *range(300, 340))
    assert run(cache, longer) == (Reuse(200, END, stored=True), [(200, [238])])
    assert entries(cache) == [longer]
    stats = cache.stats(MODEL)
    assert (stats["hits"], stats["partial_hits"], stats["misses"]) == (0, 1, 1)
    assert (stats["reused_tokens"], stats["prefilled_tokens"]) == (200, 240)
    assert stats["bytes"] == cache_bytes(cache._entries[(MODEL, None, tuple(longer))].cache)


def test_a_state_grown_a_hundred_times_holds_one_entry():
    cache = PrefixCache(1 << 20, min_tokens=8)
    ids = list(STATE)
    run(cache, ids)
    for version in range(100):
        ids = grown(ids, 1000 + version)
        assert run(cache, ids)[0] == Reuse(len(ids) - 1, END, stored=True)
    assert entries(cache) == [ids]
    assert cache.stats(MODEL)["reused_tokens"] == sum(range(200, 300))


def test_an_attention_entry_is_cut_where_a_new_state_diverges():
    cache = PrefixCache(1 << 20, min_tokens=8)
    run(cache, STATE)
    edited = STATE[:150] + [999] + STATE[151:]
    assert run(cache, edited) == (Reuse(150, CROP, stored=True), [(150, [198])])
    assert entries(cache) == [STATE, edited]  # the parent is not a start of it: both stay
    assert run(cache, STATE)[0] == Reuse(200, END, hit=True)  # the parent is unchanged


@pytest.mark.parametrize(
    "tail, superseded", [(SUPERSEDED_TAIL, True), (SUPERSEDED_TAIL + 1, False)]
)
def test_a_parent_differing_only_in_its_last_few_tokens_is_superseded(tail, superseded):
    """A grown JSON state: its parent ended in closing characters where it goes on."""
    cache = PrefixCache(1 << 20, min_tokens=8)
    run(cache, STATE)
    child = STATE[: 200 - tail] + [999] * 30
    run(cache, child)
    assert entries(cache) == ([child] if superseded else [STATE, child])


def test_a_start_of_a_stored_state_is_served_whole_and_stores_nothing():
    cache = PrefixCache(1 << 20, min_tokens=8)
    run(cache, STATE)
    assert run(cache, STATE[:120]) == (Reuse(120, CROP, hit=True), [])
    assert entries(cache) == [STATE]
    assert cache.stats(MODEL)["hits"] == 1


def test_the_longest_stored_start_wins():
    cache = PrefixCache(1 << 20, min_tokens=8)
    for cut in (50, 150, 100):
        run(cache, STATE[:cut] + [900 + cut])
    assert run(cache, STATE)[0].tokens == 150


def test_a_common_start_shorter_than_min_tokens_is_a_miss():
    cache = PrefixCache(1 << 20, min_tokens=8)
    run(cache, STATE)
    assert run(cache, STATE[:7] + [999] * 10) == (Reuse(stored=True), [(0, [15])])
    assert run(cache, STATE[:8] + [998] * 10)[0] == Reuse(8, CROP, stored=True)
    assert cache.stats(MODEL)["misses"] == 2


def test_another_models_entries_are_never_resumed():
    cache = PrefixCache(1 << 20, min_tokens=8)
    run(cache, STATE, model=("source", "other"))
    assert run(cache, grown(STATE, 5))[0] == Reuse(stored=True)


def test_a_superseded_parent_held_by_a_call_stays_until_it_ends():
    cache = PrefixCache(1 << 20, min_tokens=8)
    run(cache, STATE)
    with cache.resume(MODEL, STATE, token_prefill(STATE)) as (_, held):
        assert held.hit
        run(cache, grown(STATE, 7))
        assert entries(cache) == [STATE, grown(STATE, 7)]
    assert entries(cache) == [grown(STATE, 7)]


def test_an_entry_never_changes_however_often_it_is_resumed():
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=64)
    run(cache, STATE, linear=True)
    for cut in (64, 128, 199, 200):
        run(cache, STATE[:cut] + [5, 6, 7], linear=True)
    for entry in cache._entries.values():
        assert read_ids(entry.cache) == list(entry.ids)  # the linear states too


# -- hybrid models: checkpoints -------------------------------------------------------------------


def test_a_hybrid_entry_keeps_a_checkpoint_every_checkpoint_tokens():
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=64)
    assert run(cache, STATE, linear=True)[1] == [(0, [64, 128, 192, 198])]
    (entry,) = cache._entries.values()
    kinds = {at: kind for at, (kind, _) in entry.checkpoints.items()}
    assert kinds == {64: CHECKPOINT, 128: CHECKPOINT, 192: CHECKPOINT, 198: BOUNDARY}
    states = sum(checkpoint_bytes(states) for _, states in entry.checkpoints.values())
    assert entry.nbytes == cache_bytes(entry.cache) + states == cache.stats(MODEL)["bytes"]
    assert cache.stats(MODEL)["checkpoints"] == 4


def test_an_attention_only_entry_keeps_no_checkpoints():
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=64)
    run(cache, STATE)
    assert cache.stats(MODEL)["checkpoints"] == 0


@pytest.mark.parametrize(
    "diverges, resumed, kind",
    [(150, 128, CHECKPOINT), (128, 128, CHECKPOINT), (127, 64, CHECKPOINT), (63, 0, None)],
)
def test_a_hybrid_state_resumes_at_the_latest_checkpoint_inside_the_common_start(
    diverges, resumed, kind
):
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=64)
    run(cache, STATE, linear=True)
    edited = STATE[:diverges] + [999] * 20
    reuse, calls = run(cache, edited, linear=True)
    assert (reuse.tokens, reuse.point, reuse.hit) == (resumed, kind, False)
    assert calls[0][0] == resumed  # the prefill's base held exactly ids[:resumed], states too


@pytest.mark.parametrize("diverges", [199, 198])
def test_a_grown_json_state_resumes_at_the_boundary_before_its_parents_end(diverges):
    """The closing `]}` of the stored version merge differently once an event follows."""
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=64)
    run(cache, STATE, linear=True)
    reuse, calls = run(cache, STATE[:diverges] + [999] * 40, linear=True)
    assert reuse == Reuse(200 - BOUNDARY_TOKENS, BOUNDARY, stored=True)
    assert calls[0][0] == 198 and len(cache._entries) == 1  # the parent is superseded


def test_a_grown_hybrid_state_resumes_at_its_parents_end():
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=64)
    run(cache, STATE, linear=True)
    longer = grown(STATE, *range(300, 400))
    assert run(cache, longer, linear=True) == (Reuse(200, END, stored=True), [(200, [256, 298])])
    (entry,) = cache._entries.values()
    assert sorted(entry.checkpoints) == [64, 128, 192, 198, 256, 298]  # the parent's, its own


def test_a_hybrid_start_ending_on_a_checkpoint_is_served_without_a_prefill():
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=64)
    run(cache, STATE, linear=True)
    assert run(cache, STATE[:128], linear=True) == (Reuse(128, CHECKPOINT, hit=True), [])
    assert run(cache, STATE[:130], linear=True)[0] == Reuse(128, CHECKPOINT, stored=True)


def test_a_cut_entry_keeps_only_the_checkpoints_inside_what_it_resumed():
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=64)
    run(cache, STATE, linear=True)
    edited = STATE[:150] + [999] * 100
    run(cache, edited, linear=True)
    entry = cache._entries[(MODEL, None, tuple(edited))]
    assert sorted(entry.checkpoints) == [64, 128, 192, 248]  # 64, 128 inherited; 192, 248 own
    assert read_ids(entry.cache) == edited


def test_marked_positions_are_checkpoints_of_their_kind():
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=0)
    run(cache, STATE, linear=True, marks={150: "breakpoint", 250: "breakpoint"})
    (entry,) = cache._entries.values()
    kinds = [(at, kind) for at, (kind, _) in sorted(entry.checkpoints.items())]
    assert kinds == [(150, "breakpoint"), (198, BOUNDARY)]
    assert run(cache, STATE[:160] + [1], linear=True)[0] == Reuse(150, "breakpoint", stored=True)


def test_checkpoint_stops_lie_strictly_between_start_and_end():
    every = {64: CHECKPOINT, 128: CHECKPOINT, 192: CHECKPOINT}
    assert checkpoint_stops(0, 200, 64, {}) == every | {200 - BOUNDARY_TOKENS: BOUNDARY}
    assert checkpoint_stops(64, 192, 64, {}) == {128: CHECKPOINT, 190: BOUNDARY}
    assert checkpoint_stops(65, 193, 64, {}) == {128: CHECKPOINT, 191: BOUNDARY, 192: CHECKPOINT}
    assert checkpoint_stops(0, 200, 0, {}) == {198: BOUNDARY}
    assert checkpoint_stops(197, 200, 0, {}) == {198: BOUNDARY}
    assert checkpoint_stops(198, 200, 0, {}) == {}  # the boundary is not after the start
    marks = {10: "breakpoint", 64: "breakpoint", 200: "breakpoint", 0: "breakpoint"}
    assert checkpoint_stops(0, 200, 64, marks) == {
        10: "breakpoint",
        64: "breakpoint",
        128: CHECKPOINT,
        192: CHECKPOINT,
        198: BOUNDARY,
    }


def test_a_hybrid_models_stops_move_to_the_start_of_their_chunk():
    """`chunk` 64 (`prefill.linear_chunk` of a model with linear-attention layers): every stop
    moves back to the start of its 64-token delta-rule chunk; of two there, the later kind (a
    mark over a periodic one); one that moves to the start or before it is dropped."""
    marks = {100: BREAKPOINT, 130: BREAKPOINT}
    assert checkpoint_stops(0, 200, 64, marks, chunk=64) == {
        64: BREAKPOINT,
        128: BREAKPOINT,
        192: BOUNDARY,  # 198, the boundary, in the chunk that starts at 192
    }
    # Periodic stops 50, 100, 150 move to 0 (dropped: not after the start), 64 and 128.
    assert checkpoint_stops(0, 200, 50, {}, chunk=64) == {
        64: CHECKPOINT,
        128: CHECKPOINT,
        192: BOUNDARY,
    }
    assert checkpoint_stops(64, 130, 0, {}, chunk=64) == {128: BOUNDARY}  # a start already
    assert checkpoint_stops(0, 129, 0, {}, chunk=64) == {64: BOUNDARY}  # 127 moves to 64
    assert checkpoint_stops(65, 200, 0, {70: BREAKPOINT}, chunk=64) == {192: BOUNDARY}


def test_a_hybrid_models_shared_forward_prefills_up_to_a_chunk_start():
    hybrid = SimpleNamespace(layer_types=["linear_attention", "full_attention"])
    for attention_only in (SimpleNamespace(layer_types=["full_attention"]), SimpleNamespace()):
        assert linear_chunk(attention_only) == 1
        assert prefill_length(attention_only, 130) == 130
    assert linear_chunk(hybrid) == LINEAR_CHUNK_TOKENS == 64
    assert [prefill_length(hybrid, n) for n in (0, 63, 64, 127, 130)] == [0, 0, 64, 64, 128]
    assert [chunk_start(n, 5) for n in (4, 5, 11)] == [0, 5, 10]
    # Shape buckets (CUDA) cut the prefix to a bucket instead, for any model.
    assert prefill_length(hybrid, 130, DEFAULT) == DEFAULT.prefix(130) == 128
    assert prefill_length(hybrid, 9, DEFAULT) == DEFAULT.prefix(9) == 8


def test_a_hybrid_entrys_checkpoints_through_the_store_lie_at_chunk_starts():
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=50)
    calls = []
    prefill = token_prefill(STATE, True, calls)
    with cache.resume(MODEL, STATE, prefill, {100: BREAKPOINT}, None, 64) as (resumed, _):
        assert read_ids(resumed) == STATE
    assert calls == [(0, [64, 128, 192])]
    (entry,) = cache._entries.values()
    kinds = [(at, kind) for at, (kind, _) in sorted(entry.checkpoints.items())]
    assert kinds == [(64, BREAKPOINT), (128, CHECKPOINT), (192, BOUNDARY)]


# -- sessions ---------------------------------------------------------------------------------------


def test_a_session_reuses_only_its_own_entries_and_sessionless_calls_share_theirs():
    cache = PrefixCache(1 << 20, min_tokens=8)
    longer = grown(STATE, *range(300, 340))
    assert run(cache, STATE, session="alice")[0] == Reuse(stored=True)
    # another session, and calls without one, find nothing of alice's: a miss each, stored apart
    assert run(cache, STATE, session="bob")[0] == Reuse(stored=True)
    assert run(cache, longer)[0] == Reuse(stored=True)
    assert run(cache, longer, session="alice")[0] == Reuse(200, END, stored=True)
    assert run(cache, STATE)[0] == Reuse(200, CROP, hit=True)  # the sessionless entry, cut
    assert run(cache, STATE, session="bob")[0] == Reuse(200, END, hit=True)
    assert sorted((entry.partition or "", len(entry.ids)) for entry in cache._entries.values()) == [
        ("", 240),
        ("alice", 240),  # alice's grown entry superseded her first one
        ("bob", 200),
    ]
    stats = cache.stats(MODEL)  # one model's counters, every session's
    assert (stats["hits"], stats["partial_hits"], stats["misses"]) == (2, 1, 3)
    assert stats["entries"] == 3


def test_a_models_view_stores_and_finds_within_its_session():
    cache = PrefixCache(1 << 20, min_tokens=8)
    view = cache.for_model(MODEL)
    alice = view.within("alice")
    assert (alice.partition, view.partition, alice.within(None).partition) == ("alice", None, None)
    with alice.resume(STATE, token_prefill(STATE)) as (_, reuse):
        assert reuse == Reuse(stored=True)
    with view.resume(STATE, token_prefill(STATE)) as (_, reuse):
        assert reuse == Reuse(stored=True)  # not alice's
    with alice.resume(STATE, token_prefill(STATE)) as (_, reuse):
        assert reuse == Reuse(200, END, hit=True)
    held = cache.stats(MODEL)["bytes"]
    assert held > 0 and view.close() == held  # every session's entries go with the model
    assert cache._entries == {} and cache._trees == {}


def test_checkpoint_bytes_count_the_tensors_a_layer_has_and_skip_the_ones_it_lacks():
    torch = pytest.importorskip("torch")
    states = [{"conv": {"a": torch.zeros(4), "b": None}}, {"recurrent": {"c": torch.zeros(2, 2)}}]
    assert checkpoint_bytes(states) == 8 * 4


def test_checkpoint_stops_at_every_token_when_every_is_one():
    assert checkpoint_stops(0, 6, 1, {}) == {
        1: CHECKPOINT,
        2: CHECKPOINT,
        3: CHECKPOINT,
        4: BOUNDARY,
        5: CHECKPOINT,
    }


def test_a_hybrid_start_before_the_first_checkpoint_is_a_miss_even_at_one_token_minimum():
    """Nothing short of a checkpoint can resume a hybrid entry: not even its first token."""
    cache = PrefixCache(1 << 20, min_tokens=1, checkpoint_tokens=64)
    run(cache, STATE, linear=True)
    reuse, calls = run(cache, STATE[:63] + [999] * 20, linear=True)
    assert (reuse.tokens, reuse.point) == (0, None) and calls[0][0] == 0


def test_a_model_views_breakpoints_reach_the_store_as_checkpoints():
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=64)
    prefill = token_prefill(STATE, linear=True)
    view = cache.for_model(MODEL).within("alice", (151, 170))
    with view.resume(STATE, prefill) as (resumed, _):  # an odd mark: where it is (chunk 1)
        assert read_ids(resumed) == STATE
    (entry,) = cache._entries.values()
    assert entry.partition == "alice"
    assert {at: kind for at, (kind, _) in entry.checkpoints.items() if kind == BREAKPOINT} == {
        151: BREAKPOINT,
        170: BREAKPOINT,
    }
    # A hybrid model's view passes its chunk on: the marks move to their chunk starts.
    bob = cache.for_model(MODEL).within("bob", (151, 170))
    with bob.resume(STATE, token_prefill(STATE, linear=True), 64) as (resumed, _):
        assert read_ids(resumed) == STATE
    (bobs,) = [entry for entry in cache._entries.values() if entry.partition == "bob"]
    assert sorted(bobs.checkpoints) == [64, 128, 192]
    # A grown state that diverges at 175 resumes from the last breakpoint inside the common start.
    grown = STATE[:175] + [999] * 30
    with view.resume(grown, token_prefill(grown, linear=True)) as (resumed, reuse):
        assert read_ids(resumed) == grown
    assert (reuse.tokens, reuse.point) == (170, BREAKPOINT)


def test_a_view_without_breakpoints_marks_nothing():
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=0)
    with cache.for_model(MODEL).within("alice").resume(STATE, token_prefill(STATE, linear=True)):
        pass
    (entry,) = cache._entries.values()
    assert [kind for kind, _ in entry.checkpoints.values()] == [BOUNDARY]


def test_the_match_that_resumes_most_tokens_wins_over_a_stored_start_of_the_ids():
    """A hybrid B whose checkpoint at 128 lies inside the common start beats A, a start of the
    ids, whose end is at 100: the walk lists A first."""
    cache = PrefixCache(1 << 20, min_tokens=8, checkpoint_tokens=64)
    run(cache, STATE[:150] + [999] * 10, linear=True)  # B
    run(cache, STATE[:100], linear=True)  # A: resumed from B's checkpoint at 64, stored beside it
    assert len(cache._entries) == 2
    reuse, calls = run(cache, STATE, linear=True)
    assert (reuse.tokens, reuse.point) == (128, CHECKPOINT) and calls[0][0] == 128
