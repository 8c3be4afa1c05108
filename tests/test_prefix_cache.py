"""The state-prefix cache on real models: a hit scores what a fresh direct call scores (hybrid
Qwen3.5 with the real vocabulary, SmolLM2), entries never change, an entry's bytes, unload and
out-of-memory on insert; `prefix_sha256` as SemIf's serial scorer reports it. The store itself
(budget, LRU eviction, pins, models) is tested on hand-built caches in test_prefix_store.py."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
import torch
from exactness import worst_difference
from rows_factory import STATE, make_rows

from semif_serve.engine.engine import Engine
from semif_serve.engine.torch_scorer import TorchScorer
from semif_serve.errors import OutOfMemory
from semif_serve.scoring import prefix_cache as prefix_cache_module
from semif_serve.scoring import score, score_shared
from semif_serve.scoring.checkpoints import BOUNDARY
from semif_serve.scoring.prefix_cache import MIN_PREFIX_TOKENS, PrefixCache
from semif_serve.scoring.prompt import render
from semif_serve.scoring.rows import as_row

TOLERANCE = 0
MAX_TOKENS = 4096
MODEL = ("source", "test")
WAIT_S = 60


def state(number: int) -> dict:
    return {**STATE, "ticket": f"Ticket {number}: " + STATE["ticket"]}


def fresh(scoring_model, rows):
    return [score(scoring_model, row, max_tokens=MAX_TOKENS) for row in rows]


# -- exactness on real models ------------------------------------------------------------------


@pytest.mark.parametrize("model_name", ["tiny_qwen", "smollm2"])
def test_a_hit_scores_what_a_fresh_direct_call_scores(request, model_name):
    scoring_model = request.getfixturevalue(model_name)
    rows = make_rows(5, [2, 3, 7])
    expected = fresh(scoring_model, rows)
    view = PrefixCache(1 << 30, min_tokens=1).for_model(MODEL)

    direct = [score(scoring_model, row, max_tokens=MAX_TOKENS, prefix_cache=view) for row in rows]
    shared, timing = score_shared(scoring_model, rows, max_tokens=MAX_TOKENS, prefix_cache=view)
    again = [score(scoring_model, row, max_tokens=MAX_TOKENS, prefix_cache=view) for row in rows]

    assert [result["cache_hit"] for result in direct] == [False] + [True] * 4
    assert all(result["cache_hit"] for result in shared + again)
    assert "cache_hit" not in timing
    for results in (direct, shared, again):
        assert worst_difference(expected, results) <= TOLERANCE
    stats = view.stats()
    assert stats | {"bytes": 0, "prefilled_tokens": 0, "reused_tokens": 0} == {
        "hits": 10,
        "partial_hits": 0,
        "misses": 1,
        "evictions": 0,
        "reused_tokens": 0,
        "prefilled_tokens": 0,
        "bytes": 0,
        "entries": 1,
        "checkpoints": 0,  # hybrid: its stored prefix is one delta-rule chunk, none inside
    }
    assert stats["reused_tokens"] == 10 * stats["prefilled_tokens"] > 0  # the prefix, 10 times


def test_an_entry_never_changes_however_often_it_is_used(tiny_qwen):
    cache = PrefixCache(1 << 30, min_tokens=1)
    view = cache.for_model(MODEL)
    rows = make_rows(3, [2, 4])
    others = [make_rows(1, 3, state=state(n), prefix=f"s{n}-")[0] for n in range(3)]
    expected = fresh(tiny_qwen, rows)
    score(tiny_qwen, rows[0], max_tokens=MAX_TOKENS, prefix_cache=view)
    (entry,) = cache._entries.values()
    before = [tensor.clone() for tensor in entry_tensors(entry.cache)]

    worst = 0.0
    for use in range(50):
        row = rows[use % len(rows)]
        result = score(tiny_qwen, row, max_tokens=MAX_TOKENS, prefix_cache=view)
        worst = max(worst, worst_difference([expected[use % len(rows)]], [result]))
        assert result["cache_hit"]
        score(tiny_qwen, others[use % 3], max_tokens=MAX_TOKENS, prefix_cache=view)
    shared, _ = score_shared(tiny_qwen, rows, max_tokens=MAX_TOKENS, prefix_cache=view)

    assert worst <= TOLERANCE
    assert worst_difference(expected, shared) <= TOLERANCE
    after = entry_tensors(entry.cache)
    assert all(torch.equal(old, new) for old, new in zip(before, after, strict=True))


def entry_tensors(stored) -> list[torch.Tensor]:
    tensors = []
    for layer in stored.layers:
        if hasattr(layer, "recurrent_states"):
            tensors += [*layer.conv_states.values(), *layer.recurrent_states.values()]
        else:
            tensors += [layer.keys, layer.values]
    return tensors


def test_rows_with_orderings_hit_and_stay_exact(tiny_qwen):
    base = make_rows(1, 4)[0]
    orderings = [
        {**base, "id": f"order{n}", "options": base["options"][n:] + base["options"][:n]}
        for n in range(4)
    ]
    expected = fresh(tiny_qwen, orderings)
    view = PrefixCache(1 << 30, min_tokens=1).for_model(MODEL)
    score_shared(tiny_qwen, orderings[:1], max_tokens=MAX_TOKENS, prefix_cache=view)
    shared, _ = score_shared(tiny_qwen, orderings, max_tokens=MAX_TOKENS, prefix_cache=view)
    direct = [score(tiny_qwen, row, max_tokens=MAX_TOKENS, prefix_cache=view) for row in orderings]
    assert all(result["cache_hit"] for result in shared + direct)
    assert worst_difference(expected, shared) <= TOLERANCE
    assert worst_difference(expected, direct) <= TOLERANCE


def test_parallel_calls_share_entries_and_stay_exact(tiny_qwen):
    view = PrefixCache(1 << 30, min_tokens=1).for_model(MODEL)
    groups = [make_rows(3, [2, 5], state=state(n), prefix=f"s{n}-") for n in range(2)]
    expected = {row["id"]: one for rows in groups for row, one in zip(rows, fresh(tiny_qwen, rows))}
    threads, calls = 4, 6
    start = threading.Barrier(threads, timeout=WAIT_S)
    results: list[dict] = []
    failures: list[BaseException] = []

    def work(index: int) -> None:
        try:
            start.wait()
            for call in range(calls):
                rows = groups[(index + call) % 2]
                if call % 2:
                    results.extend(
                        score_shared(tiny_qwen, rows, max_tokens=MAX_TOKENS, prefix_cache=view)[0]
                    )
                else:
                    row = rows[call % 3]
                    results.append(score(tiny_qwen, row, max_tokens=MAX_TOKENS, prefix_cache=view))
        except BaseException as error:  # reported below, not lost in the thread
            failures.append(error)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(WAIT_S)
    assert not failures and not any(worker.is_alive() for worker in workers)
    assert worst_difference([expected[one["id"]] for one in results], results) <= TOLERANCE
    stats = view.stats()
    assert stats["hits"] + stats["misses"] == threads * calls
    assert stats["entries"] == 2 and 2 <= stats["misses"] <= threads * calls


def test_a_long_state_is_cached_at_the_default_minimum(tiny_qwen):
    long_state = {**STATE, "notes": ["the printer jammed again"] * 40}
    rows = make_rows(2, 2, state=long_state)
    view = PrefixCache(1 << 30).for_model(MODEL)
    results = [score(tiny_qwen, row, max_tokens=MAX_TOKENS, prefix_cache=view) for row in rows]
    assert [result["cache_hit"] for result in results] == [False, True]
    assert worst_difference(fresh(tiny_qwen, rows), results) <= TOLERANCE


def test_a_short_state_is_not_looked_up(tiny_qwen):
    row = make_rows(1, 2, state="short")[0]
    view = PrefixCache(1 << 30).for_model(MODEL)
    results = [score(tiny_qwen, row, max_tokens=MAX_TOKENS, prefix_cache=view) for _ in range(2)]
    assert [result["cache_hit"] for result in results] == [False, False]
    assert set(view.stats().values()) == {0}
    assert MIN_PREFIX_TOKENS == 128  # docs/operations.md states it


def test_prefix_sha256_is_the_rendered_prompt_through_the_state(qwen_tokenizer, tiny_qwen):
    rows = make_rows(3, 2)
    results = fresh(tiny_qwen, rows) + score_shared(tiny_qwen, rows, max_tokens=MAX_TOKENS)[0]
    text = render(qwen_tokenizer, as_row(rows[0]))
    head = '{"evidence": ' + json.dumps(STATE, ensure_ascii=False)
    through_state = text[: text.index(head) + len(head)]
    expected = hashlib.sha256(through_state.encode("utf-8")).hexdigest()
    assert {result["prefix_sha256"] for result in results} == {expected}
    other = fresh(tiny_qwen, make_rows(1, 2, state=state(1)))[0]
    assert other["prefix_sha256"] != expected


def test_bytes_are_the_tensors_real_bytes(tiny_qwen):
    cache = PrefixCache(1 << 30, min_tokens=1)
    long_state = {**STATE, "notes": "the fuser was replaced and the tray realigned " * 8}
    (row,) = make_rows(1, 2, state=long_state)  # a prefix of over two delta-rule chunks
    score(tiny_qwen, row, max_tokens=MAX_TOKENS, prefix_cache=cache.for_model(MODEL))
    (entry,) = cache._entries.values()
    linear = [layer for layer in entry.cache.layers if hasattr(layer, "recurrent_states")]
    assert linear, "the tiny Qwen3.5 has linear-attention layers"
    expected = sum(tensor.nbytes for tensor in entry_tensors(entry.cache))
    (boundary,) = [states for kind, states in entry.checkpoints.values() if kind == BOUNDARY]
    expected += sum(
        tensor.nbytes
        for layer in boundary
        for tensors in layer.values()
        for tensor in tensors.values()
        if tensor is not None
    )
    assert cache.stats(MODEL)["bytes"] == expected == cache.total_bytes


# -- the model's scorer: unload and out-of-memory -----------------------------------------------


def test_closing_the_engine_frees_its_models_entries(tiny_qwen):
    cache = PrefixCache(1 << 30, min_tokens=1)
    scorer = TorchScorer(tiny_qwen, MAX_TOKENS, cache, torch)
    engine = Engine(scorer, torch_module=torch)
    engine.score(make_rows(1, 2)[0])
    assert engine.cache_stats()["entries"] == 1 and cache.total_bytes > 0
    engine.close()
    assert cache.total_bytes == 0 and cache.stats(scorer.prefix_cache.model)["entries"] == 0


def through_the_engine(scorer: TorchScorer) -> Engine:
    """The scorer as the server calls it: the engine applies the out-of-memory policy."""
    return Engine(scorer, torch_module=torch)


def out_of_memory_once_while_copying(monkeypatch) -> list:
    """The next working copy of a stored prefix runs out of memory, later ones work; the list
    returned holds one entry once it has."""
    real_copy = prefix_cache_module.working_copy
    failures = []

    def out_of_memory_once(stored):
        if not failures:
            failures.append(True)
            raise torch.OutOfMemoryError("CUDA out of memory")  # no size: drop all, once
        return real_copy(stored)

    monkeypatch.setattr(prefix_cache_module, "working_copy", out_of_memory_once)
    return failures


def test_out_of_memory_while_inserting_drops_entries_and_scores_cold(tiny_qwen, monkeypatch):
    cache = PrefixCache(1 << 30, min_tokens=1)
    scorer = TorchScorer(tiny_qwen, MAX_TOKENS, cache, torch)
    other, row = make_rows(1, 2, state=state(5))[0], make_rows(1, 2)[0]
    scorer.score(other)
    failures = out_of_memory_once_while_copying(monkeypatch)
    result = through_the_engine(scorer).score(row)

    assert failures and result["cache_hit"] is False
    assert worst_difference(fresh(tiny_qwen, [row]), [result]) <= TOLERANCE
    assert cache.total_bytes == 0  # every unpinned entry dropped, the new one too
    assert scorer.score(row)["cache_hit"] is False  # stored again after the cold call
    assert scorer.score(row)["cache_hit"] is True


def test_out_of_memory_drops_only_the_failing_models_entries(tiny_qwen, monkeypatch):
    cache = PrefixCache(1 << 30, min_tokens=1)
    neighbour = TorchScorer(tiny_qwen, MAX_TOKENS, cache, torch)
    scorer = TorchScorer(tiny_qwen, MAX_TOKENS, cache, torch)
    scorer.prefix_cache = cache.for_model(("another", "model"))  # same weights, another id
    neighbour.score(make_rows(1, 2, state=state(5))[0])
    scorer.score(make_rows(1, 2, state=state(6))[0])
    neighbours_bytes = neighbour.cache_stats()["bytes"]
    assert neighbours_bytes > 0 and scorer.cache_stats()["bytes"] > 0
    failures = out_of_memory_once_while_copying(monkeypatch)
    result = through_the_engine(scorer).score(make_rows(1, 2, state=state(6))[0])  # fails, cold
    assert failures and result["cache_hit"] is False
    assert neighbour.cache_stats()["bytes"] == neighbours_bytes  # untouched
    assert scorer.cache_stats()["entries"] == 0  # its own were dropped; the cold call stores none


def test_out_of_memory_with_only_a_neighbours_entries_is_503_at_once(tiny_qwen, monkeypatch):
    cache = PrefixCache(1 << 30, min_tokens=1)
    neighbour = TorchScorer(tiny_qwen, MAX_TOKENS, cache, torch)
    scorer = TorchScorer(tiny_qwen, MAX_TOKENS, cache, torch)
    scorer.prefix_cache = cache.for_model(("another", "model"))
    neighbour.score(make_rows(1, 2, state=state(5))[0])
    stored = cache.total_bytes
    calls = []

    def out_of_memory(*args, **kwargs):
        calls.append(True)
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr("semif_serve.scoring.prefill.prefill", out_of_memory)
    with pytest.raises(OutOfMemory, match="CUDA out of memory"):
        through_the_engine(scorer).score(make_rows(1, 2)[0])
    assert len(calls) == 1  # not run again
    assert cache.total_bytes == stored  # the neighbour's entries stay


def test_out_of_memory_with_nothing_stored_is_the_engines_to_report(tiny_qwen, monkeypatch):
    scorer = TorchScorer(tiny_qwen, MAX_TOKENS, PrefixCache(1 << 30, min_tokens=1), torch)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr("semif_serve.scoring.prefill.prefill", out_of_memory)
    with pytest.raises(OutOfMemory, match="CUDA out of memory"):
        through_the_engine(scorer).score(make_rows(1, 2)[0])
