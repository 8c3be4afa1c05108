"""Encoded inputs on a real model (the tiny Qwen3.5): TorchScorer's encoding stage gives what
plain rows give (and locates the state prefix, cache or not), an input checked against another limit is encoded again (issue 22, finding 2),
and a retuned engine keeps its stored prefixes and checks its new limit (finding 7)."""

from __future__ import annotations

import pytest
from fakes import row

from semif_serve.engine.engine import Engine
from semif_serve.engine.torch_scorer import TorchScorer
from semif_serve.scoring import PromptRejected, parse_row, score, score_shared
from semif_serve.scoring.inputs import DirectInput, SharedInput
from semif_serve.scoring.prefix_cache import PrefixCache


def test_prepared_inputs_score_as_plain_rows(tiny_qwen):
    """TorchScorer's stages: a prepared input gives the result plain rows give."""
    scorer = TorchScorer(tiny_qwen, max_tokens=4096)
    one = parse_row(row(options=("Yes", "No", "Maybe")))
    prepared = scorer.prepare(one)
    assert isinstance(prepared, DirectInput)
    assert prepared.prefix_ids  # located with the cache off too: a batch shares its prefill
    assert scorer.score(prepared)["option_logits"] == scorer.score(one)["option_logits"]
    rows = [parse_row(row(id=f"r{k}", question=f"Is it {k}?")) for k in range(3)]
    shared = scorer.prepare_shared(rows)
    assert isinstance(shared, SharedInput)
    from_input, timing = scorer.score_shared(shared)
    from_rows, _ = scorer.score_shared(rows)
    assert [r["option_logits"] for r in from_input] == [r["option_logits"] for r in from_rows]
    assert timing["encode_seconds"] == shared.encode_seconds


def test_an_input_checked_against_another_limit_is_encoded_again(tiny_qwen):
    long_row = parse_row(row(question="word " * 200))
    prepared = TorchScorer(tiny_qwen, max_tokens=4096).prepare(long_row)
    with pytest.raises(PromptRejected, match="max_tokens"):
        score(tiny_qwen, prepared, max_tokens=100)
    shared = TorchScorer(tiny_qwen, max_tokens=4096).prepare_shared([long_row])
    with pytest.raises(PromptRejected, match="max_tokens"):
        score_shared(tiny_qwen, shared, max_tokens=100)


def test_a_retuned_torch_scorer_keeps_its_prefixes_and_checks_the_new_limit(tiny_qwen):
    cache = PrefixCache(budget_bytes=1 << 30, min_tokens=16)
    engine = Engine(TorchScorer(tiny_qwen, max_tokens=4096, prefix_cache=cache))
    engine.capacity_for = lambda max_tokens: 4
    state = {"log": [f"line {k} of the evidence" for k in range(40)]}
    long_row = parse_row({**row(), "state": state})
    assert not engine.score(long_row)["cache_hit"]
    stored = engine.cache_stats()["entries"]
    assert stored >= 1
    length = engine.score(long_row)["input_tokens"]
    engine.retune(length, 2)
    assert engine.cache_stats()["entries"] == stored
    assert engine.score(engine.prepare(long_row))["cache_hit"]
    engine.retune(length - 1, 2)
    with pytest.raises(PromptRejected, match="max_tokens"):
        engine.prepare(long_row)
