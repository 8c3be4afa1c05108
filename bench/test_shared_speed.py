"""Fresh (one direct call per decision) vs shared (one call per state), side by side in one run."""

import time

from benchlib import FULL, report
from workloads import make_workload

from semif_serve.scoring import score, score_shared

MAX_TOKENS = 8192
SHARED_TARGET = 12.0  # this CPU, SmolLM2, 21 criteria over a ~2,000-2,800-token state


def argmax(values):
    return max(range(len(values)), key=values.__getitem__)


def test_fresh_vs_shared(bench_model, benchmark):
    states, criteria, tokens = (3, 21, 2000) if FULL else (2, 4, 120)
    groups = make_workload(bench_model.tokenizer, states, criteria, tokens)
    fresh_seconds, shared_seconds, flips, worst, prompt_tokens = [], [], 0, 0.0, []
    for rows in groups:
        started = time.perf_counter()
        fresh = [score(bench_model, row, max_tokens=MAX_TOKENS) for row in rows]
        fresh_seconds.append(time.perf_counter() - started)
        started = time.perf_counter()
        shared, timing = score_shared(bench_model, rows, max_tokens=MAX_TOKENS)
        shared_seconds.append(time.perf_counter() - started)
        prompt_tokens.append(fresh[0]["input_tokens"])
        for one, many in zip(fresh, shared):
            flips += argmax(one["probabilities"]) != argmax(many["probabilities"])
            worst = max(
                worst, *(abs(a - b) for a, b in zip(one["probabilities"], many["probabilities"]))
            )
    benchmark.pedantic(
        lambda: score_shared(bench_model, groups[0], max_tokens=MAX_TOKENS), rounds=1, iterations=1
    )
    decisions = states * criteria
    ratio = sum(fresh_seconds) / sum(shared_seconds)
    report(
        "fresh_vs_shared",
        f"shared: one call per state ({states} x {criteria}, ~{min(prompt_tokens)} tokens)",
        "fresh: one direct call per decision",
        ratio,
        fresh_decisions_per_s=decisions / sum(fresh_seconds),
        shared_decisions_per_s=decisions / sum(shared_seconds),
        fresh_per_state_s={
            "p50": sorted(fresh_seconds)[len(fresh_seconds) // 2],
            "min": min(fresh_seconds),
            "max": max(fresh_seconds),
        },
        shared_per_state_s={
            "p50": sorted(shared_seconds)[len(shared_seconds) // 2],
            "min": min(shared_seconds),
            "max": max(shared_seconds),
        },
        argmax_flips=flips,
        max_probability_difference=worst,
    )
    assert flips == 0 and worst <= 1e-4  # exactness holds at every size
    if FULL:
        assert ratio >= SHARED_TARGET, f"shared/fresh {ratio:.2f} < {SHARED_TARGET}"
