"""Issue 23, exactness: requests scored in one batch get exactly what they get alone (fp32 on the
CPU's invariant numerics: the same bits): the hybrid tiny Qwen3.5 (linear-attention layers,
right padding) and
SmolLM2; mixed prompt lengths and option counts, shared calls and rotations as units, the
state-prefix cache on with hits and misses in one batch, and rows over one state sharing one
prefill with the cache off."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rows_factory import STATE, make_rows

from semif_serve.decisions import expand
from semif_serve.errors import ClientGone
from semif_serve.scoring import PromptRejected, parse_row, score, score_shared
from semif_serve.scoring.coalesced import score_batch
from semif_serve.scoring.inputs import Batched, SharedInput, direct_input, shared_input
from semif_serve.scoring.prefix_cache import PrefixCache
from semif_serve.scoring.shared import is_pure_attention
from semif_serve.scoring.template import TemplatePrefix

TOLERANCE = 0
MAX_TOKENS = 4096


def state(number: int, words: int = 0) -> dict:
    return {**STATE, "ticket": f"Ticket {number}: " + STATE["ticket"] + " more" * words}


def close(one: dict, other: dict) -> bool:
    assert one["option_ids"] == other["option_ids"]
    assert one["prompt_sha256"] == other["prompt_sha256"]
    assert one["input_tokens"] == other["input_tokens"]
    return (
        max(abs(a - b) for a, b in zip(one["probabilities"], other["probabilities"])) <= TOLERANCE
    )


def plain_rows(count: int, seed: int = 0) -> list[dict]:
    """Rows with distinct states of varied lengths and 2..5 options."""
    rows = []
    for index in range(count):
        [row] = make_rows(1, 2 + (index + seed) % 4, state=state(index, (index * 7 + seed) % 23))
        rows.append({**row, "id": f"r{index}"})
    return rows


@pytest.mark.parametrize("model_name", ["tiny_qwen", "smollm2"])
def test_plain_rows_in_one_padded_forward_score_as_alone(request, model_name):
    scoring_model = request.getfixturevalue(model_name)
    rows = [parse_row(row) for row in plain_rows(5)]
    inputs = [
        direct_input(scoring_model.tokenizer, row, MAX_TOKENS, with_prefix=False) for row in rows
    ]
    batched = score_batch(scoring_model, inputs, max_tokens=MAX_TOKENS)
    lengths = [len(item.prompt.ids) for item in inputs]
    assert len(set(lengths)) > 1  # mixed lengths: real padding
    for row, outcome in zip(rows, batched):
        assert (outcome.rows, outcome.padded_length) == (5, max(lengths))
        assert close(outcome.outcome, score(scoring_model, row, max_tokens=MAX_TOKENS))


def test_each_outcome_names_the_forward_it_ran_in_as_it_ran(tiny_qwen):
    """The metrics' account (issue 30): plain rows share one Forward of the tensor's own shape
    (with buckets forced, padded rows and width included); rows over one state share the shared
    forward's (its prefill and padded suffixes); a shared call alone has its own."""
    from semif_serve.scoring.shapes import DEFAULT

    tokenizer = tiny_qwen.tokenizer
    rows = [parse_row(row) for row in plain_rows(3)]
    inputs = [direct_input(tokenizer, row, MAX_TOKENS, with_prefix=False) for row in rows]
    lengths = [len(item.prompt.ids) for item in inputs]
    plain = score_batch(tiny_qwen, inputs, max_tokens=MAX_TOKENS, buckets=None)
    assert len({id(outcome.forward) for outcome in plain}) == 1
    forward = plain[0].forward
    assert (forward.rows, forward.tokens, forward.real_tokens) == (
        3,
        3 * max(lengths),
        sum(lengths),
    )
    bucketed = score_batch(tiny_qwen, inputs, max_tokens=MAX_TOKENS, buckets=DEFAULT)[0].forward
    rows_run, width_run = DEFAULT.batch(3, max(lengths))
    assert (
        (bucketed.rows, bucketed.tokens) == (rows_run, rows_run * width_run) == (4, 4 * width_run)
    )
    assert bucketed.real_tokens == sum(lengths)

    over_state = [
        direct_input(tokenizer, parse_row(row), MAX_TOKENS, with_prefix=True)
        for row in make_rows(2, 3, state=state(99, 30))
    ]
    grouped = score_batch(tiny_qwen, over_state, max_tokens=MAX_TOKENS, buckets=None)
    assert grouped[0].forward is grouped[1].forward
    prefix = len(over_state[0].prefix_ids) // 64 * 64  # the hybrid prefill stops at a chunk start
    suffixes = sum(len(item.prompt.ids) - prefix for item in over_state)
    assert grouped[0].forward.rows == 2
    assert grouped[0].forward.real_tokens == prefix + suffixes
    assert grouped[0].forward.tokens >= grouped[0].forward.real_tokens

    unit = shared_input(
        tokenizer, [parse_row(row) for row in make_rows(2, 3, state=state(98))], MAX_TOKENS
    )
    [alone] = score_batch(tiny_qwen, [unit], max_tokens=MAX_TOKENS, buckets=None)
    prefix = len(unit.prefix_ids) // 64 * 64
    assert (alone.forward.rows, alone.forward.real_tokens) == (
        2,
        prefix + sum(len(prompt.ids) - prefix for prompt in unit.prompts),
    )


@given(data=st.data())
@settings(max_examples=8, deadline=None)
def test_any_mix_of_direct_and_shared_units_scores_as_alone(tiny_qwen, data):
    """A property over batch makeup: 1..6 units, each a plain row, a shared call of 1..3 rows,
    or a row's rotations (a shared unit), in any order."""
    kinds = data.draw(
        st.lists(st.sampled_from(["row", "shared", "rotations"]), min_size=1, max_size=6)
    )
    seed = data.draw(st.integers(0, 50))
    inputs, expected = [], []
    for index, kind in enumerate(kinds):
        [base] = make_rows(1, 2 + (index + seed) % 3, state=state(seed + index, index % 5))
        row = parse_row({**base, "id": f"u{index}"})
        if kind == "row":
            inputs.append(direct_input(tiny_qwen.tokenizer, row, MAX_TOKENS, with_prefix=False))
            expected.append(score(tiny_qwen, row, max_tokens=MAX_TOKENS))
            continue
        rows = (
            expand(row, "rotations")
            if kind == "rotations"
            else [
                parse_row(r)
                for r in make_rows(1 + index % 3, 3, state=row.state, prefix=f"s{index}")
            ]
        )
        inputs.append(shared_input(tiny_qwen.tokenizer, rows, MAX_TOKENS))
        expected.append(score_shared(tiny_qwen, rows, max_tokens=MAX_TOKENS)[0])
    batched = score_batch(tiny_qwen, inputs, max_tokens=MAX_TOKENS)
    for item, outcome, alone in zip(inputs, batched, expected):
        if isinstance(item, SharedInput):
            results, timing = outcome.outcome
            assert outcome.rows == len(item.prompts) == timing["batch_size"]
            assert all(close(got, want) for got, want in zip(results, alone, strict=True))
        else:
            assert close(outcome.outcome, alone)


@pytest.mark.parametrize("model_name", ["tiny_qwen", "smollm2"])
def test_with_the_prefix_cache_hits_and_misses_in_one_batch_score_as_alone(request, model_name):
    scoring_model = request.getfixturevalue(model_name)
    cache = PrefixCache(1 << 30, min_tokens=16).for_model(("batched", model_name))
    long_state = state(1, 40)
    stored = parse_row(make_rows(1, 3, state=long_state, prefix="stored")[0])
    score(scoring_model, stored, max_tokens=MAX_TOKENS, prefix_cache=cache)  # stores its prefix
    rows = [
        parse_row(make_rows(2, [2, 4], state=long_state, prefix="hit")[0]),  # a hit
        parse_row(make_rows(2, [2, 4], state=long_state, prefix="hit")[1]),  # the same prefix
        parse_row(make_rows(1, 3, state=state(2, 40), prefix="miss")[0]),  # a miss
        parse_row({**make_rows(1, 2, state="short")[0], "id": "plain"}),  # too short to cache
    ]
    inputs = [
        direct_input(scoring_model.tokenizer, row, MAX_TOKENS, with_prefix=True) for row in rows
    ]
    hits_before = cache.stats()["hits"]
    batched = score_batch(scoring_model, inputs, max_tokens=MAX_TOKENS, prefix_cache=cache)
    assert [outcome.outcome["cache_hit"] for outcome in batched] == [True, True, False, False]
    assert cache.stats()["hits"] == hits_before + 1  # the two rows over one state: one lookup
    assert [outcome.rows for outcome in batched] == [2, 2, 1, 1]
    for row, outcome in zip(rows, batched):
        assert close(outcome.outcome, score(scoring_model, row, max_tokens=MAX_TOKENS))


@pytest.mark.parametrize("model_name", ["tiny_qwen", "smollm2"])
def test_without_the_cache_rows_over_one_state_share_one_prefill_and_score_as_alone(
    request, model_name, monkeypatch
):
    """Issue 23's "same state, one prefill", with no cache: the two rows over one state run as
    one shared forward (one prefill); a row alone over its state runs in the padded forward."""
    from semif_serve.scoring import prefill

    scoring_model = request.getfixturevalue(model_name)
    one_state = state(3, 10)
    rows = [
        parse_row(make_rows(2, [2, 4], state=one_state, prefix="same")[0]),
        parse_row(make_rows(1, 3, state=state(4, 2), prefix="other")[0]),
        parse_row(make_rows(2, [2, 4], state=one_state, prefix="same")[1]),
        parse_row(make_rows(1, 2, state=state(5, 7), prefix="third")[0]),
    ]
    inputs = [
        direct_input(scoring_model.tokenizer, row, MAX_TOKENS, with_prefix=True) for row in rows
    ]
    assert inputs[0].prefix_ids == inputs[2].prefix_ids != inputs[1].prefix_ids
    prefills = []
    real_prefill = prefill.prefill
    monkeypatch.setattr(
        prefill, "prefill", lambda *args: prefills.append(args[2]) or real_prefill(*args)
    )
    batched = score_batch(scoring_model, inputs, max_tokens=MAX_TOKENS)
    # The hybrid model's prefill stops at the start of a 64-token delta-rule chunk.
    chunk = 1 if is_pure_attention(scoring_model.model) else 64
    assert prefills == [inputs[0].prefix_ids[: len(inputs[0].prefix_ids) // chunk * chunk]]
    assert [outcome.rows for outcome in batched] == [2, 2, 2, 2]
    assert [outcome.outcome["cache_hit"] for outcome in batched] == [False] * 4
    monkeypatch.undo()
    for row, outcome in zip(rows, batched):
        assert close(outcome.outcome, score(scoring_model, row, max_tokens=MAX_TOKENS))


def test_a_row_refused_on_its_own_fails_only_its_request(tiny_qwen):
    rows = [parse_row(row) for row in plain_rows(2)]
    short = direct_input(tiny_qwen.tokenizer, rows[0], MAX_TOKENS, with_prefix=False)
    long_row = parse_row({**plain_rows(1)[0], "id": "long", "question": "why? " * 300})
    encoded_for_more = direct_input(tiny_qwen.tokenizer, long_row, 1 << 20, with_prefix=False)
    batched = score_batch(tiny_qwen, [short, encoded_for_more], max_tokens=500)
    assert isinstance(batched[0], Batched) and batched[0].outcome["id"] == rows[0].id
    assert isinstance(batched[1].outcome, PromptRejected)
    assert "max_tokens" in str(batched[1].outcome)


# --- issue 39: distinct requests over the model's template prefix -----------------------------


@pytest.mark.parametrize("model_name", ["tiny_qwen", "smollm2"])
def test_distinct_requests_run_in_one_forward_over_the_template_and_score_as_alone(
    request, model_name
):
    """Direct rows and one-row shared calls (each ecosystem question) over distinct states: one
    forward over the kept template prefix, each result the shape its own scorer gives, with the
    numbers it gets alone; the template is prefilled by the first batch and resumed after."""
    scoring_model = request.getfixturevalue(model_name)
    template = TemplatePrefix.of(scoring_model.tokenizer, MAX_TOKENS)
    rows = [parse_row(row) for row in plain_rows(4, seed=3)]
    inputs = [
        shared_input(scoring_model.tokenizer, [row], MAX_TOKENS)
        if index % 2
        else direct_input(scoring_model.tokenizer, row, MAX_TOKENS, with_prefix=True)
        for index, row in enumerate(rows)
    ]
    prefilled = []
    for _ in range(2):
        batched = score_batch(scoring_model, inputs, max_tokens=MAX_TOKENS, template=template)
        forward = batched[0].forward
        assert all(outcome.forward is forward for outcome in batched)  # ONE forward
        suffixes = sum(len(item_ids(item)) - len(template.ids) for item in inputs)
        prefilled.append(forward.real_tokens - suffixes)
    if is_pure_attention(scoring_model.model):
        assert prefilled == [len(template.ids), 0]  # kept after the first, resumed by the second
    else:  # Qwen3.5's 40-token template ends inside its first delta-rule chunk: rows run whole
        assert prefilled == [len(template.ids) * len(inputs)] * 2
        assert template.held_bytes() == 0
    for index, (row, outcome) in enumerate(zip(rows, batched)):
        assert outcome.rows == 4
        if index % 2:
            [result], timing = outcome.outcome
            alone, _ = score_shared(scoring_model, [row], max_tokens=MAX_TOKENS)
            assert result["model"] == alone[0]["model"] and timing["batch_size"] == 1
            assert timing["prefix_tokens"] + timing["true_suffix_tokens"] == len(
                item_ids(inputs[index])
            )
            assert close(result, alone[0])
        else:
            result = outcome.outcome
            assert "serving_config" not in result["model"]  # the direct scorer's result
            assert close(result, score(scoring_model, row, max_tokens=MAX_TOKENS))
        assert result["cache_hit"] is False  # the template holds none of a caller's text


def item_ids(item) -> list[int]:
    return item.prompts[0].ids if isinstance(item, SharedInput) else item.prompt.ids


def test_what_does_not_join_the_template_forward_runs_as_before(tiny_qwen):
    """A shared call of several rows, and a one-row call whose state prefix the cache takes, run
    alone; a single template row is no batch (it runs alone, as unbatched); without a template
    direct rows share a padded forward and one-row shared calls run alone."""
    tokenizer = tiny_qwen.tokenizer
    template = TemplatePrefix.of(tokenizer, MAX_TOKENS)
    cache = PrefixCache(1 << 30, min_tokens=64).for_model(("coalesced", "template"))
    many = shared_input(tokenizer, make_rows(2, [2, 3], state=state(30)), MAX_TOKENS)
    [long_row] = make_rows(1, 2, state=state(31, 40))
    cached = shared_input(tokenizer, [long_row], MAX_TOKENS)
    assert cache.caches(len(cached.prefix_ids))
    [short_row] = make_rows(1, 2, state={"n": 1})
    short = shared_input(tokenizer, [{**short_row, "id": "short"}], MAX_TOKENS)
    assert not cache.caches(len(short.prefix_ids))
    outcomes = score_batch(
        tiny_qwen,
        [many, cached, short],
        max_tokens=MAX_TOKENS,
        prefix_cache=cache,
        template=template,
    )
    assert [outcome.rows for outcome in outcomes] == [2, 1, 1]
    assert cache.stats()["entries"] >= 1  # the long state's prefill was stored, as before
    directs = [
        direct_input(tokenizer, parse_row(row), MAX_TOKENS, with_prefix=False)
        for row in plain_rows(2, seed=5)
    ]
    alone = score_batch(tiny_qwen, [directs[0], short], max_tokens=MAX_TOKENS)
    assert [outcome.rows for outcome in alone] == [1, 1]
    padded = score_batch(tiny_qwen, [*directs, short], max_tokens=MAX_TOKENS)
    assert [outcome.rows for outcome in padded] == [2, 2, 1]


def test_a_prompt_that_does_not_begin_with_the_template_runs_without_it(tiny_qwen):
    tokenizer = tiny_qwen.tokenizer
    rows = [parse_row(row) for row in plain_rows(3, seed=7)]
    inputs = [direct_input(tokenizer, row, MAX_TOKENS, with_prefix=False) for row in rows]
    foreign = TemplatePrefix([tokenizer.encode("no prompt starts like this")[0]] * 9)
    outcomes = score_batch(tiny_qwen, inputs, max_tokens=MAX_TOKENS, template=foreign)
    assert [outcome.rows for outcome in outcomes] == [3, 3, 3]  # the padded forward
    assert foreign.held_bytes() == 0
    for row, outcome in zip(rows, outcomes):
        assert close(outcome.outcome, score(tiny_qwen, row, max_tokens=MAX_TOKENS))


def test_the_template_is_where_the_callers_text_starts(tiny_qwen, smollm2):
    for scoring_model in (tiny_qwen, smollm2):
        tokenizer = scoring_model.tokenizer
        template = TemplatePrefix.of(tokenizer, MAX_TOKENS)
        text = tokenizer.decode(template.ids)
        assert text.endswith('{"evidence":') or text.endswith('{"evidence"')
        assert "Apply the supplied criterion" in text
        assert len(template.ids) >= 8


def test_an_input_whose_caller_left_is_not_run_and_is_looked_at_just_before_its_forward(
    tiny_qwen, monkeypatch
):
    """`left` is asked before each forward: a shared call runs first (alone), and the direct
    rows, asked after it ran, leave the one whose caller has gone out of their forward."""
    tokenizer = tiny_qwen.tokenizer
    many = shared_input(tokenizer, make_rows(2, [2, 3], state=state(40)), MAX_TOKENS)
    rows = [parse_row(row) for row in plain_rows(3, seed=9)]
    directs = [direct_input(tokenizer, row, MAX_TOKENS, with_prefix=False) for row in rows]
    decoder = tiny_qwen.model.get_decoder()
    forwards = []
    original = decoder.forward
    monkeypatch.setattr(decoder, "forward", lambda *a, **k: forwards.append(1) or original(*a, **k))
    asked = {}

    def left(item) -> bool:
        asked[id(item)] = len(forwards)  # how many forwards had run when it was asked
        return item is directs[1]

    outcomes = score_batch(tiny_qwen, [many, *directs], max_tokens=MAX_TOKENS, left=left)
    assert asked[id(many)] == 0 and asked[id(directs[1])] >= 1  # asked after the shared call
    assert isinstance(outcomes[2], ClientGone)
    assert [outcomes[1].rows, outcomes[3].rows] == [2, 2]  # its forward held the others only
    for row, outcome in zip([rows[0], rows[2]], [outcomes[1], outcomes[3]]):
        assert close(outcome.outcome, score(tiny_qwen, row, max_tokens=MAX_TOKENS))


def test_requests_with_the_same_prompt_are_one_row_of_the_forward_each_with_its_own_ids(smollm2):
    tokenizer = smollm2.tokenizer
    template = TemplatePrefix.of(tokenizer, MAX_TOKENS)
    [base] = plain_rows(1, seed=11)
    twin = {
        **base,
        "id": "twin",
        "options": [{**o, "id": f"t{k}"} for k, o in enumerate(base["options"])],
    }
    other = plain_rows(2, seed=12)[1]
    rows = [parse_row(base), parse_row(twin), parse_row(other)]
    inputs = [
        direct_input(tokenizer, rows[0], MAX_TOKENS, with_prefix=False),
        shared_input(tokenizer, [rows[1]], MAX_TOKENS),
        direct_input(tokenizer, rows[2], MAX_TOKENS, with_prefix=False),
    ]
    outcomes = score_batch(smollm2, inputs, max_tokens=MAX_TOKENS, template=template)
    assert [outcome.rows for outcome in outcomes] == [2, 2, 2]  # the twin prompt once
    assert outcomes[0].forward.rows == 2
    first, [second], _ = outcomes[0].outcome, *outcomes[1].outcome
    assert (first["id"], second["id"]) == (rows[0].id, "twin")
    assert second["option_ids"] == [f"t{k}" for k in range(len(rows[1].options))]
    assert first["probabilities"] == second["probabilities"]
    assert close(first, score(smollm2, rows[0], max_tokens=MAX_TOKENS))
    assert close(outcomes[2].outcome, score(smollm2, rows[2], max_tokens=MAX_TOKENS))


def test_a_tokenizer_that_cannot_render_the_probe_rows_has_no_template():
    assert TemplatePrefix.of(None, MAX_TOKENS) is None


# --- issue 44: lone cold rows over their states batched, their prefixes stored -----------------


def test_lone_cold_rows_run_in_one_forward_and_store_the_prefill_each_would_have_stored(smollm2):
    """Distinct requests whose state prefixes the cache takes but holds nothing of: one forward
    over the template (attention-only, invariant numerics), each result the bits it gets alone,
    each prefix stored from that forward as its own prefill (a later call over it resumes the
    same keys and values a lone prefill makes, and scores the same bits); a row whose prefix is
    stored runs alone over it, as before."""
    from semif_serve.scoring.prefill import prefill

    tokenizer = smollm2.tokenizer
    template = TemplatePrefix.of(tokenizer, MAX_TOKENS)
    cache = PrefixCache(1 << 30, min_tokens=16).for_model(("batched-store", "smollm2"))
    rows = [
        parse_row(make_rows(1, 2 + k, state=state(40 + k, 9 * k), prefix=f"c{k}")[0])
        for k in range(3)
    ]
    inputs = [direct_input(tokenizer, row, MAX_TOKENS, with_prefix=True) for row in rows]
    assert all(cache.caches(len(item.prefix_ids)) for item in inputs)
    batched = score_batch(
        smollm2, inputs, max_tokens=MAX_TOKENS, prefix_cache=cache, template=template
    )
    assert [outcome.rows for outcome in batched] == [3, 3, 3]
    assert len({id(outcome.forward) for outcome in batched}) == 1
    stats = cache.stats()
    assert (stats["entries"], stats["misses"], stats["hits"]) == (3, 3, 0)
    assert stats["prefilled_tokens"] == sum(len(item.prefix_ids) for item in inputs)
    for row, outcome in zip(rows, batched):
        alone = score(smollm2, row, max_tokens=MAX_TOKENS)
        assert outcome.outcome["option_logits"] == alone["option_logits"]
        assert outcome.outcome["cache_hit"] is False
    decoder, config = smollm2.model.get_decoder(), smollm2.model.config
    for item in inputs:
        ids = list(item.prefix_ids)
        with torch.inference_mode():
            fresh, _ = prefill(decoder, config, ids, decoder.device)
        with cache.resume(ids, lambda *args: pytest.fail("stored: nothing to prefill")) as (
            kept,
            reuse,
        ):
            assert reuse.hit
            for mine, lone in zip(kept.layers, fresh.layers):
                assert torch.equal(mine.keys, lone.keys) and torch.equal(mine.values, lone.values)
    again = [
        parse_row(
            {
                **make_rows(1, 2 + k, state=state(40 + k, 9 * k), prefix=f"d{k}")[0],
                "question": "Is it urgent?",
            }
        )
        for k in range(2)
    ]
    inputs = [direct_input(tokenizer, row, MAX_TOKENS, with_prefix=True) for row in again]
    batched = score_batch(
        smollm2, inputs, max_tokens=MAX_TOKENS, prefix_cache=cache, template=template
    )
    assert [outcome.rows for outcome in batched] == [1, 1]  # each alone over its stored prefix
    for row, outcome in zip(again, batched):
        assert outcome.outcome["cache_hit"] is True
        assert (
            outcome.outcome["option_logits"]
            == score(smollm2, row, max_tokens=MAX_TOKENS)["option_logits"]
        )


def test_lone_cold_rows_of_a_hybrid_model_still_prefill_alone(tiny_qwen):
    """A linear-attention layer's state after a batch forward is its row's end's, not its
    prefix's: each lone row over a cacheable state runs alone, as before, and stores its own."""
    tokenizer = tiny_qwen.tokenizer
    template = TemplatePrefix.of(tokenizer, MAX_TOKENS)
    cache = PrefixCache(1 << 30, min_tokens=16).for_model(("batched-store", "tiny_qwen"))
    rows = [
        parse_row(make_rows(1, 2, state=state(50 + k, 30), prefix=f"q{k}")[0]) for k in range(2)
    ]
    inputs = [direct_input(tokenizer, row, MAX_TOKENS, with_prefix=True) for row in rows]
    batched = score_batch(
        tiny_qwen, inputs, max_tokens=MAX_TOKENS, prefix_cache=cache, template=template
    )
    assert [outcome.rows for outcome in batched] == [1, 1]
    assert cache.stats()["entries"] == 2


def test_a_one_question_call_over_a_cold_cacheable_state_joins_the_batch_and_stores_it(smollm2):
    """Each ecosystem request of one question over its own long state (a one-row shared call):
    with another request, one forward over the template, the shared scorer's result with the
    bits it gets alone, `prefix_stored` in its timing; sent again, a cache hit alone."""
    tokenizer = smollm2.tokenizer
    template = TemplatePrefix.of(tokenizer, MAX_TOKENS)
    cache = PrefixCache(1 << 30, min_tokens=16).for_model(("batched-store", "one-question"))
    [one] = make_rows(1, 2, state=state(60, 20), prefix="one")
    [other] = make_rows(1, 3, state=state(61, 5), prefix="other")
    inputs = [
        shared_input(tokenizer, [one], MAX_TOKENS),
        direct_input(tokenizer, parse_row(other), MAX_TOKENS, with_prefix=True),
    ]
    batched = score_batch(
        smollm2, inputs, max_tokens=MAX_TOKENS, prefix_cache=cache, template=template
    )
    assert [outcome.rows for outcome in batched] == [2, 2]
    [result], timing = batched[0].outcome
    [alone], _ = score_shared(smollm2, [one], max_tokens=MAX_TOKENS)
    assert result["option_logits"] == alone["option_logits"]
    assert timing["prefix_stored"] is True and result["cache_hit"] is False
    assert cache.stats()["entries"] == 2
    again = score_batch(
        smollm2, inputs[:1], max_tokens=MAX_TOKENS, prefix_cache=cache, template=template
    )
    [result], timing = again[0].outcome
    assert result["cache_hit"] is True and result["option_logits"] == alone["option_logits"]
