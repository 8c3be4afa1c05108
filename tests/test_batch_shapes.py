"""Issue 30, item 4: batch forwards run warmed shapes within their token budget. With buckets
(forced here on the CPU with small tables), a batch of plain direct rows is padded in rows as in
width (`Buckets.batch`), the batch selector's cost is the tokens after bucketing
(`bucketed_tokens`), warm-up runs every shape such a batch can reach (`Buckets.batch_shapes`),
and a row-padded batch scores as the unpadded one."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rows_factory import make_rows
from test_warmup import INFO, TABLE, ShapeRecorder
from tiny_models import tiny_qwen35

from semif_serve.engine.warmup import plan, warm_up_shapes
from semif_serve.runtime.selection import Cost, cost_of
from semif_serve.runtime.selection import select as select_batch
from semif_serve.scoring import ScoringModel, parse_row
from semif_serve.scoring.coalesced import score_batch
from semif_serve.scoring.inputs import direct_input
from semif_serve.scoring.padded import padded_ids
from semif_serve.scoring.shapes import DEFAULT, Buckets, bucketed_tokens

# TABLE: lengths 32, 64, 96, 128, 192, 256, 384, 512, ...; rows 1, 2, 4, 8, then multiples of 8
MAX_TOKENS = 400  # a prompt's limit (Qwen tokens)
MAX_BATCH_ROWS = 6  # not a row bucket: 5 or 6 rows pad to 8
MAX_BATCH_TOKENS = 1800  # not a product of buckets
TOLERANCE = 1e-6


def select(costs: list[Cost], max_rows: int, max_tokens: int, buckets: Buckets | None) -> int:
    """The scheduler's selection (`runtime.selection.select`) with the cost a model with these
    buckets gives it (`TorchScorer.batch_tokens`): the batch's tokens after bucketing."""
    return select_batch(
        costs, max_rows, max_tokens, lambda rows, length: bucketed_tokens(rows, length, buckets)
    )


# The arithmetic: pure, every case


@pytest.mark.parametrize(
    "buckets, max_rows, max_tokens, longest",
    [
        (TABLE, MAX_BATCH_ROWS, MAX_BATCH_TOKENS, MAX_TOKENS),
        (TABLE, 16, 2048, 512),
        (TABLE, 2, 100, 40),
        (DEFAULT, 16, 16384, 4096),
        (DEFAULT, 12, 10000, 2000),
    ],
)
def test_the_batch_shapes_are_exactly_those_a_selectable_batch_runs_as(
    buckets, max_rows, max_tokens, longest
):
    reached = {
        buckets.batch(rows, length)
        for rows in range(2, max_rows + 1)
        for length in range(1, longest + 1)
        if bucketed_tokens(rows, length, buckets) <= max_tokens
    }
    shapes = buckets.batch_shapes(max_rows=max_rows, max_tokens=max_tokens, longest=longest)
    assert len(shapes) == len(set(shapes)) and shapes == sorted(shapes)
    assert set(shapes) == reached
    assert all(rows * width <= max_tokens for rows, width in shapes)


def test_the_default_batch_shapes_at_16_rows_and_16384_tokens():
    shapes = DEFAULT.batch_shapes(max_rows=16, max_tokens=16384, longest=4096)
    assert len(shapes) == 104  # rows 2 and 4: all 32 widths; 8: up to 2,048; 16: up to 1,024
    assert {rows for rows, _ in shapes} == {2, 4, 8, 16}
    assert (16, 1024) in shapes and (16, 1152) not in shapes and (4, 4096) in shapes
    assert DEFAULT.batch_shapes(max_rows=1, max_tokens=16384, longest=4096) == []  # off


def test_a_batch_within_rows_times_longest_can_pass_the_budget_once_bucketed():
    # The defect: 14 rows of 1,170 tokens count 16,380 <= 16,384 but run as 16 x 1,280.
    assert 14 * 1170 <= 16384 < bucketed_tokens(14, 1170, DEFAULT) == 16 * 1280
    assert bucketed_tokens(14, 1170, None) == 14 * 1170  # without buckets: rows x longest
    assert bucketed_tokens(1, 1170, DEFAULT) == DEFAULT.length(1170)  # one row: direct shape


@given(
    rows=st.integers(1, 300),
    length=st.integers(1, 20000),
    fewer=st.integers(0, 299),
    shorter=st.integers(0, 19999),
    buckets=st.sampled_from([DEFAULT, TABLE, None]),
)
def test_bucketed_tokens_never_fall_as_a_batch_grows(rows, length, fewer, shorter, buckets):
    """A part of a selected batch (the plain rows `_padded` runs, a half after an out-of-memory
    split) never costs more than the batch: the selector's check holds for it too."""
    part_rows, part_length = max(1, rows - fewer), max(1, length - shorter)
    assert bucketed_tokens(part_rows, part_length, buckets) <= bucketed_tokens(
        rows, length, buckets
    )
    assert bucketed_tokens(rows, length, buckets) >= rows * length


@given(data=st.data())
@settings(max_examples=300)
def test_every_padded_forward_a_selected_batch_runs_is_planned_and_within_budget(data):
    """Random queues (direct rows and shared units of several rows, lengths up to max_tokens);
    the selector takes a batch; `_padded` runs any two or more of its direct rows: the shape it
    builds is in the warm-up plan and holds at most max_batch_tokens tokens."""
    buckets = data.draw(st.sampled_from([TABLE, DEFAULT]))
    max_tokens = data.draw(st.integers(40, 4096 if buckets is DEFAULT else 512))
    max_rows = data.draw(st.integers(2, 20))
    budget = data.draw(st.integers(2 * buckets.length(1), 40000))
    costs = data.draw(
        st.lists(
            st.builds(Cost, st.sampled_from([1, 1, 1, 2, 3]), st.integers(1, max_tokens)),
            min_size=1,
            max_size=30,
        )
    )
    shapes = plan(
        buckets,
        max_tokens=max_tokens,
        max_rows=4,
        packed=False,
        max_batch_rows=max_rows,
        max_batch_tokens=budget,
    ).batched
    taken = costs[: select(costs, max_rows, budget, buckets)]
    direct = [cost.length for cost in taken if cost.rows == 1]
    chosen = data.draw(st.sets(st.sampled_from(range(len(direct))))) if direct else set()
    if len(taken) < 2 or len(chosen) < 2:  # alone: the direct or shared scorer's own shapes
        return
    rows, width = padded_ids([[7] * direct[index] for index in chosen], buckets).shape
    assert (rows, width) in shapes
    assert rows * width <= budget


def test_padded_ids_pad_rows_with_padding_after_the_real_rows():
    ids = padded_ids([[5, 6, 7], [8]] + [[9, 9]], TABLE)
    assert ids.shape == (4, 32)
    assert ids[0, :4].tolist() == [5, 6, 7, 0] and ids[1, :2].tolist() == [8, 0]
    assert ids[3].eq(0).all() and ids[:, 3:].eq(0).all()
    assert padded_ids([[5, 6, 7], [8]] + [[9, 9]], None).shape == (3, 3)  # buckets off


# On the tiny hybrid model


@pytest.fixture(scope="module")
def hybrid(qwen_tokenizer) -> ScoringModel:
    return ScoringModel(tiny_qwen35(seed=5), qwen_tokenizer, INFO)


def plain_inputs(scoring_model, count: int, seed: int) -> list:
    """Direct inputs of distinct states and varied lengths (up to MAX_TOKENS)."""
    rng = random.Random(seed)
    inputs = []
    for index in range(count):
        state = {"notes": f"state {seed}-{index}" + " word" * rng.choice([0, 5, 30, 150])}
        [row] = make_rows(1, rng.randint(2, 5), state=state, prefix=f"s{seed}-{index}-")
        row["question"] += " really" * rng.choice([0, 3, 20])
        inputs.append(
            direct_input(scoring_model.tokenizer, parse_row(row), MAX_TOKENS, with_prefix=False)
        )
    return inputs


def test_a_row_padded_batch_scores_as_the_unpadded_batch(hybrid):
    inputs = plain_inputs(hybrid, 3, seed=2)
    recorder = ShapeRecorder(hybrid.model)
    try:
        padded = score_batch(hybrid, inputs, max_tokens=MAX_TOKENS, buckets=TABLE)
        padded_shapes = recorder.take()
        plain = score_batch(hybrid, inputs, max_tokens=MAX_TOKENS, buckets=None)
        plain_shapes = recorder.take()
    finally:
        recorder.close()
    longest = max(len(item.prompt.ids) for item in inputs)
    assert plain_shapes == {("direct", 3, longest)}
    assert padded_shapes == {("direct", 4, TABLE.length(longest))}  # a row of padding added
    for one, other in zip(plain, padded):
        assert (one.rows, other.rows) == (3, 3)  # the real rows, as the reply shows them
        for key in ("option_logits", "probabilities"):
            worst = max(abs(a - b) for a, b in zip(one.outcome[key], other.outcome[key]))
            assert worst <= TOLERANCE, key
        assert one.outcome["input_tokens"] == other.outcome["input_tokens"]


def test_after_warm_up_selected_batches_bring_no_new_shape(hybrid):
    recorder = ShapeRecorder(hybrid.model)
    try:
        report = warm_up_shapes(
            hybrid,
            max_tokens=MAX_TOKENS,
            max_rows=2,
            buckets=TABLE,
            max_batch_rows=MAX_BATCH_ROWS,
            max_batch_tokens=MAX_BATCH_TOKENS,
        )
        warmed = recorder.take()
        shapes = plan(
            TABLE,
            max_tokens=MAX_TOKENS,
            max_rows=2,
            packed=False,
            max_batch_rows=MAX_BATCH_ROWS,
            max_batch_tokens=MAX_BATCH_TOKENS,
        )
        reachable = TABLE.batch_shapes(
            max_rows=MAX_BATCH_ROWS, max_tokens=MAX_BATCH_TOKENS, longest=MAX_TOKENS
        )
        assert shapes.batched == reachable and len(reachable) == 20  # 8 + 7 + 5
        assert report["batched_shapes"] == len(reachable)
        assert report["shapes"] == len(shapes.direct) + len(shapes.shared_calls()) + len(reachable)
        assert report["largest_batched_tokens"] == max(r * w for r, w in reachable)
        assert {("direct", rows, width) for rows, width in reachable} <= warmed
        assert {rows for kind, rows, _ in warmed if kind == "suffix"} >= {8}  # 6 rows over a state
        ran = []
        for seed in range(4):
            queue = plain_inputs(hybrid, 10, seed=10 + seed)
            if seed % 2:  # rows over one state: one shared forward of up to 6 rows
                over_one = make_rows(6, [2, 3], state={"notes": "word " * (30 * seed)})
                queue[:6] = [
                    direct_input(hybrid.tokenizer, parse_row(row), MAX_TOKENS, with_prefix=True)
                    for row in over_one
                ]
            while queue:
                costs = [cost_of(item) for item in queue]
                count = select(costs, MAX_BATCH_ROWS, MAX_BATCH_TOKENS, TABLE)
                batch, queue = queue[:count], queue[count:]
                score_batch(hybrid, batch, max_tokens=MAX_TOKENS, buckets=TABLE)
                ran.append(count)
        after = recorder.take()
    finally:
        recorder.close()
    assert max(ran) > 2 and {rows for _, rows, _ in after} >= {4}  # batches did run
    assert after <= warmed, f"new shapes after warm-up: {sorted(after - warmed)}"
    assert all(rows * width <= MAX_BATCH_TOKENS for kind, rows, width in after if rows > 1)


def test_batching_off_plans_no_batch_forward():
    shapes = plan(TABLE, max_tokens=MAX_TOKENS, max_rows=2, packed=False)
    assert shapes.batched == []
    assert (
        plan(TABLE, max_tokens=MAX_TOKENS, max_rows=2, packed=False, max_batch_tokens=4096)
        == shapes
    )  # max_batch_rows 1: off, whatever the budget
