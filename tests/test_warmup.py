"""Warm-up runs every forward shape traffic can reach: after it, a randomized mix of direct and
shared requests up to max_tokens and max_rows brings no new (kind, rows, length) shape."""

import random

import pytest
import torch
from rows_factory import make_rows
from tiny_models import byte_tokenizer, tiny_llama, tiny_qwen35

from semif_serve.engine.warmup import plan, warm_up_shapes
from semif_serve.scoring import ModelInfo, PromptRejected, ScoringModel, score, score_shared
from semif_serve.scoring.shapes import DEFAULT, Buckets

INFO = ModelInfo(source="test:tiny", revision="seed-0", dtype="float32", device="cpu")
# Small enough for the CPU: lengths 32, 64, 96, 128, 192, 256, 384, 512; rows 1, 2, 4, 8, 16.
TABLE = Buckets(
    fine_step=32,
    fine_until=128,
    steps_per_doubling=4,
    prefix_steps_per_doubling=4,
    row_step=8,
    token_budget=512,
)
MAX_TOKENS = {"hybrid": 400, "attention-only": 1400}  # Qwen tokens; bytes
MAX_ROWS = 12


class ShapeRecorder:
    """Records the (kind, rows, length) of every decoder forward: `direct` (no cache),
    `prefill` (into an empty cache) or `suffix` (continuing a cached prefix)."""

    def __init__(self, model):
        self.seen: set[tuple[str, int, int]] = set()
        self._handle = model.get_decoder().register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        rows, length = kwargs["input_ids"].shape
        if not kwargs.get("use_cache"):
            kind = "direct"
        else:
            kind = "suffix" if kwargs.get("position_ids") is not None else "prefill"
        self.seen.add((kind, rows, length))

    def take(self) -> set[tuple[str, int, int]]:
        seen, self.seen = self.seen, set()
        return seen

    def close(self) -> None:
        self._handle.remove()


def traffic(scoring_model, max_tokens: int, seed: int, requests: int = 10) -> int:
    """A random mix of direct rows and shared calls of 1..MAX_ROWS rows, of many lengths up to
    max_tokens (a prompt over it is refused before any forward). Returns the rows scored."""
    rng = random.Random(seed)
    scored = 0
    for index in range(requests):
        state = {"notes": " ".join(["word"] * rng.randint(0, 60))}
        count = 1 if index % 3 == 0 else rng.randint(1, MAX_ROWS)
        rows = make_rows(count, [rng.randint(2, 6)], state=state, prefix=f"r{index}-")
        for row in rows:
            row["question"] += " really" * rng.choice([0, 0, 5, 20, 80])
        try:
            if count == 1 and index % 2 == 0:
                score(scoring_model, rows[0], max_tokens=max_tokens, buckets=TABLE)
            else:
                score_shared(scoring_model, rows, max_tokens=max_tokens, buckets=TABLE)
            scored += count
        except PromptRejected:
            continue
    return scored


@pytest.mark.parametrize("kind", ["hybrid", "attention-only"])
def test_after_warm_up_traffic_brings_no_new_shape(kind, qwen_tokenizer):
    if kind == "hybrid":
        scoring_model = ScoringModel(tiny_qwen35(seed=5), qwen_tokenizer, INFO)
    else:
        scoring_model = ScoringModel(tiny_llama(seed=5), byte_tokenizer(), INFO)
    max_tokens = MAX_TOKENS[kind]
    recorder = ShapeRecorder(scoring_model.model)
    try:
        report = warm_up_shapes(
            scoring_model, max_tokens=max_tokens, max_rows=MAX_ROWS, buckets=TABLE
        )
        warmed = recorder.take()
        shapes = plan(TABLE, max_tokens=max_tokens, max_rows=MAX_ROWS, packed=kind != "hybrid")
        assert report["shapes"] == len(shapes.direct) + len(shapes.shared_calls())
        assert warmed == (
            {("direct", 1, length) for length in shapes.direct}
            | {("prefill", 1, prefix) for prefix in shapes.prefixes}
            | {("suffix", rows, length) for rows, length in shapes.suffixes}
        )
        assert report["out_of_memory"] == [] and report["seconds"] > 0
        assert report["largest_direct_tokens"] == TABLE.length(max_tokens)
        assert (
            traffic(scoring_model, max_tokens, seed=1) > 20
        )  # the mix scored rows, not only refusals
        after = recorder.take()
    finally:
        recorder.close()
    kinds = {shape[0] for shape in after}
    assert kinds == {"direct", "prefill", "suffix"}
    assert after <= warmed, f"new shapes after warm-up: {sorted(after - warmed)}"
    if kind == "hybrid":  # rows-per-call padding and splitting were exercised
        assert {rows for (what, rows, _) in after if what == "suffix"} - {1}


def test_the_plan_covers_each_bucket_once_and_stays_small():
    shapes = plan(DEFAULT, max_tokens=4096, max_rows=64, packed=False)
    assert shapes.direct == DEFAULT.lengths(4096) and len(shapes.direct) == 32
    assert len(shapes.prefixes) == 69 and max(shapes.prefixes) == 4032
    assert (64, 64) in shapes.suffixes and (64, 128) in shapes.suffixes
    assert (64, 192) not in shapes.suffixes and (2, 4096) in shapes.suffixes
    assert len(shapes.suffixes) == len(set(shapes.suffixes)) == 118
    assert all(
        rows * length <= DEFAULT.token_budget or rows == 1 for rows, length in shapes.suffixes
    )
    calls = shapes.shared_calls()
    assert len(calls) == 118
    assert {prefix for prefix, _ in calls} == set(shapes.prefixes)
    assert {suffix for _, suffix in calls} == set(shapes.suffixes)
    packed = plan(DEFAULT, max_tokens=4096, max_rows=64, packed=True)
    assert packed.suffixes == [(1, length) for length in DEFAULT.lengths(4095)]


def test_without_buckets_warm_up_runs_nothing(tiny_qwen):
    calls = []
    handle = tiny_qwen.model.register_forward_pre_hook(lambda *a: calls.append(a))
    try:
        assert warm_up_shapes(tiny_qwen, max_tokens=4096, max_rows=64) is None  # CPU default
        assert warm_up_shapes(tiny_qwen, max_tokens=4096, max_rows=64, buckets=None) is None
    finally:
        handle.remove()
    assert calls == []


def test_a_shape_that_runs_out_of_memory_is_reported_and_skipped(monkeypatch, tiny_qwen):
    import semif_serve.engine.warmup as warmup

    def direct(model, length, buckets):
        if length > 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(warmup, "_direct", direct)
    monkeypatch.setattr(warmup, "_shared", lambda *args: None)
    report = warm_up_shapes(tiny_qwen, max_tokens=200, max_rows=2, buckets=TABLE)
    assert report["out_of_memory"] == [f"direct (1, {n})" for n in (96, 128, 192, 256)]
    assert report["largest_direct_tokens"] == 64
    monkeypatch.setattr(warmup, "_shared", lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        warm_up_shapes(tiny_qwen, max_tokens=200, max_rows=2, buckets=TABLE)


def test_a_batched_shape_that_runs_out_of_memory_is_reported_and_not_counted(
    monkeypatch, tiny_qwen
):
    import semif_serve.engine.warmup as warmup

    def batched(model, rows, width):
        if rows * width > 256:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(warmup, "_direct", lambda *args: None)
    monkeypatch.setattr(warmup, "_shared", lambda *args: None)
    monkeypatch.setattr(warmup, "_batched", batched)
    limits = {"max_batch_rows": 4, "max_batch_tokens": 512}
    report = warm_up_shapes(tiny_qwen, max_tokens=200, max_rows=2, buckets=TABLE, **limits)
    reachable = TABLE.batch_shapes(max_rows=4, max_tokens=512, longest=200)
    assert reachable == [(2, 32), (2, 64), (2, 96), (2, 128), (2, 192), (2, 256), (4, 32),
                         (4, 64), (4, 96), (4, 128)]  # fmt: skip
    assert report["out_of_memory"] == ["batched (2, 192)", "batched (2, 256)", "batched (4, 96)",
                                       "batched (4, 128)"]  # fmt: skip
    assert report["batched_shapes"] == 6 and report["largest_batched_tokens"] == 256
    off = warm_up_shapes(tiny_qwen, max_tokens=200, max_rows=2, buckets=TABLE)  # the default
    assert off["batched_shapes"] == 0 and off["largest_batched_tokens"] == 0


def test_build_engine_warms_every_shape_when_buckets_are_on(monkeypatch, qwen_tokenizer):
    # Buckets are on for CUDA models; here the CPU model takes them (and the small table) so
    # build_engine's warm-up runs the whole plan, under the process-wide lock.
    import threading

    from fake_torch import GIB, FakeTorch
    from fakes import settings

    import semif_serve.scoring.shapes as shapes_module
    from semif_serve.engine.boot import build_engine

    monkeypatch.setattr(shapes_module, "ON_CPU_DEFAULT", True)
    monkeypatch.setattr(shapes_module, "DEFAULT", TABLE)
    scoring_model = ScoringModel(tiny_qwen35(seed=5), qwen_tokenizer, INFO)
    recorder = ShapeRecorder(scoring_model.model)
    fake = FakeTorch(capability=(9, 0), arch_list=["sm_90"])
    fake.cuda.reserved = 3 * GIB
    config = settings(device="cuda", require_fast_kernels=False, max_tokens=300, max_decisions=3)
    try:
        engine = build_engine(
            config, torch_module=fake, load=lambda *a, **k: scoring_model, lock=threading.Lock()
        )
    finally:
        recorder.close()
    shapes = plan(TABLE, max_tokens=300, max_rows=3, packed=False)
    assert {("direct", 1, length) for length in shapes.direct} <= recorder.seen
    assert {("suffix", rows, length) for rows, length in shapes.suffixes} <= recorder.seen
    assert {rows for _, rows, _ in recorder.seen} == {1, 2, 4}  # 3 rows pad to 4
    assert engine.baseline_reserved == 3 * GIB and engine.max_parallel_slots >= 1


@pytest.mark.parametrize(
    ("max_tokens", "max_rows", "longest"),
    [
        (200, 1, 199),  # one row: its own suffix only
        (200, 2, 512),  # several rows: a packed row of up to PACKED_CHUNK_TOKENS
        (200, 3, 512),
        (514, 2, 513),  # a suffix longer than a packed chunk: one row of it
        (33, 1, 32),  # one row of 32 tokens at most: the 32 bucket, not the 64 one
        (34, 1, 33),  # ... and of 33 tokens: the 64 bucket too
    ],
)
def test_a_packed_plans_suffixes_reach_the_longest_packed_row(max_tokens, max_rows, longest):
    shapes = plan(TABLE, max_tokens=max_tokens, max_rows=max_rows, packed=True)
    assert shapes.suffixes == [(1, length) for length in TABLE.lengths(longest)]


@pytest.mark.parametrize(
    ("max_tokens", "prefixes"),
    [
        (2, [1]),  # a prompt keeps a token after its prefix: 1 token of prefix at most
        (3, [1, 2]),
        (33, [1, 2, 4, 8, 16, 32]),
    ],
)
def test_a_plans_prefixes_reach_the_longest_prefix_a_prompt_can_have(max_tokens, prefixes):
    for packed in (False, True):
        assert plan(TABLE, max_tokens=max_tokens, max_rows=2, packed=packed).prefixes == prefixes


@pytest.mark.parametrize(("max_tokens", "lengths"), [(33, [32]), (34, [32, 64])])
def test_an_unpacked_plans_suffixes_reach_the_longest_suffix_a_prompt_can_have(max_tokens, lengths):
    """A shared prompt keeps at least one prefix token: its suffix has max_tokens - 1 at most."""
    shapes = plan(TABLE, max_tokens=max_tokens, max_rows=1, packed=False)
    assert shapes.suffixes == [(1, length) for length in lengths]


@pytest.mark.parametrize("packed", [False, True])
def test_a_batch_of_two_rows_over_one_state_plans_the_suffixes_of_a_two_row_call(packed):
    """With SEMIF_MAX_BATCH_ROWS=2, two one-row requests over one state run as one shared call
    of two rows: the plan covers it as it covers a request of two rows."""
    batched = plan(TABLE, max_tokens=100, max_rows=1, packed=packed, max_batch_rows=2)
    assert batched.suffixes == plan(TABLE, max_tokens=100, max_rows=2, packed=packed).suffixes
    assert batched.suffixes != plan(TABLE, max_tokens=100, max_rows=1, packed=packed).suffixes
