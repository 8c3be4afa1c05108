"""Encoding off the hot path (issue 14): the shortcuts vs the algorithm before them, one run.

(a) a shared call's encoding, 21 criteria over a ~2,000-token state: `encode_shared` vs
    `reference_encode_shared` (every row, and every row + letter, encoded whole); target: the
    shortcut takes at most 15% of the reference's time.
(b) one ~2,000-token `/decide`'s encoding: `encode_prompt` vs one bare `tokenizer.encode` of its
    prompt; target at most 1.5x (the reference `encode_prompt` is reported beside it).
Before and after alternate call by call on the same rows, so a neighbour's load falls on both.
SmolLM2's tokenizer (what `make bench` scores with) is asserted in full runs; Qwen3.5's is
reported there too. Every size checks that the shortcuts give the reference's ids.
"""

import statistics
import time

import pytest
from benchlib import FULL, report
from test_prompt_fastpath import reference_encode_prompts, reference_encode_shared
from workloads import make_workload

from semif_serve.scoring import parse_row
from semif_serve.scoring.prompt import encode_prompt
from semif_serve.scoring.shared_prompts import encode_shared

MAX_TOKENS = 8192
SHARED_TARGET = 0.15  # shortcut time / reference time, 21 criteria over a ~2k state
DIRECT_TARGET = 1.5  # encode_prompt time / one bare encode of the same prompt


def alternating(calls: dict, rounds: int) -> dict:
    """Median wall and CPU seconds of each call, the calls taking turns, after one warm-up."""
    wall = {name: [] for name in calls}
    cpu = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(rounds):
        for name, call in calls.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            call()
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
    milliseconds = lambda samples: 1e3 * statistics.median(samples)  # noqa: E731
    return {
        name: {"wall_ms": milliseconds(wall[name]), "cpu_ms": milliseconds(cpu[name])}
        for name in calls
    }


NAMES = ["smollm2", "qwen35"] if FULL else ["tiny"]
_QWEN35 = []  # built once, on first use (about 10 s)


def tokenizer_named(name, bench_model):
    """SmolLM2's (full) or the tiny byte tokenizer: bench_model's; Qwen3.5's in full runs."""
    if name != "qwen35":
        return bench_model.tokenizer
    if not _QWEN35:
        from tiny_models import qwen35_tokenizer

        _QWEN35.append(qwen35_tokenizer())
    return _QWEN35[0]


@pytest.mark.parametrize("name", NAMES)
def test_a_shared_call_encodes_the_state_once(name, bench_model, benchmark):
    tokenizer = tokenizer_named(name, bench_model)
    criteria, tokens, rounds = (21, 2000, 7) if FULL else (4, 120, 1)
    [rows] = make_workload(tokenizer, 1, criteria, tokens)
    _, prompts, prefix = encode_shared(tokenizer, rows, MAX_TOKENS)
    _, reference, reference_prefix = reference_encode_shared(tokenizer, rows, MAX_TOKENS)
    assert prompts == reference and prefix == reference_prefix  # exact at every size
    times = alternating(
        {
            "before": lambda: reference_encode_shared(tokenizer, rows, MAX_TOKENS),
            "after": lambda: encode_shared(tokenizer, rows, MAX_TOKENS),
        },
        rounds,
    )
    ratio = times["after"]["cpu_ms"] / times["before"]["cpu_ms"]
    report(
        f"encode_shared_{name}",
        f"encode_shared: {criteria} criteria over one ~{len(prompts[0].ids)}-token state",
        "the reference (every row and row + letter encoded whole)",
        ratio,
        wall_ratio=times["after"]["wall_ms"] / times["before"]["wall_ms"],
        prefix_tokens=len(prefix),
        **times,
    )
    benchmark.pedantic(lambda: encode_shared(tokenizer, rows, MAX_TOKENS), rounds=1, iterations=1)
    if FULL and name == "smollm2":
        assert ratio <= SHARED_TARGET, f"CPU-time ratio {ratio:.3f} ({times})"


@pytest.mark.parametrize("name", NAMES)
def test_a_direct_call_costs_about_one_encode(name, bench_model):
    tokenizer = tokenizer_named(name, bench_model)
    tokens, rounds = (2000, 15) if FULL else (120, 1)
    [rows] = make_workload(tokenizer, 1, 1, tokens)
    row = parse_row(rows[0])
    prompt = encode_prompt(tokenizer, row, MAX_TOKENS)
    assert [prompt] == reference_encode_prompts(tokenizer, [row], MAX_TOKENS)
    times = alternating(
        {
            "bare_encode": lambda: tokenizer.encode(prompt.text, add_special_tokens=False),
            "before": lambda: reference_encode_prompts(tokenizer, [row], MAX_TOKENS),
            "after": lambda: encode_prompt(tokenizer, row, MAX_TOKENS),
        },
        rounds,
    )
    ratio = times["after"]["cpu_ms"] / times["bare_encode"]["cpu_ms"]
    report(
        f"encode_direct_{name}",
        f"encode_prompt of one ~{len(prompt.ids)}-token prompt",
        "one bare tokenizer.encode of its text",
        ratio,
        wall_ratio=times["after"]["wall_ms"] / times["bare_encode"]["wall_ms"],
        before_ratio=times["before"]["cpu_ms"] / times["bare_encode"]["cpu_ms"],
        **times,
    )
    if FULL and name == "smollm2":
        assert ratio <= DIRECT_TARGET, f"CPU-time ratio {ratio:.2f} ({times})"
