"""Fresh (one direct call per decision) vs shared (one call per state), side by side in one run."""

import time

from benchlib import FULL, report, spread
from workloads import make_workload

from semif_serve.scoring import score, score_shared

MAX_TOKENS = 8192
SHARED_TARGET = 12.0  # this CPU, SmolLM2, 21 criteria over a ~2,000-2,800-token state


def argmax(values):
    return max(range(len(values)), key=values.__getitem__)


def measured(call):
    """(wall seconds, CPU seconds of this process, value) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    value = call()
    return time.perf_counter() - wall, time.process_time() - cpu, value


def test_fresh_vs_shared(bench_model, benchmark):
    states, criteria, tokens = (3, 21, 2000) if FULL else (2, 4, 120)
    groups = make_workload(bench_model.tokenizer, states, criteria, tokens)
    fresh_wall, fresh_cpu, shared_wall, shared_cpu = [], [], [], []
    flips, worst, prompt_tokens = 0, 0.0, []
    for rows in groups:
        # Shared before and after the (long) fresh run, so a noisy neighbour during one phase
        # does not decide the ratio alone; each state's shared figure is the mean of the two.
        before = measured(lambda rows=rows: score_shared(bench_model, rows, max_tokens=MAX_TOKENS))
        wall, cpu, fresh = measured(
            lambda rows=rows: [score(bench_model, row, max_tokens=MAX_TOKENS) for row in rows]
        )
        fresh_wall.append(wall)
        fresh_cpu.append(cpu)
        after = measured(lambda rows=rows: score_shared(bench_model, rows, max_tokens=MAX_TOKENS))
        shared_wall.append((before[0] + after[0]) / 2)
        shared_cpu.append((before[1] + after[1]) / 2)
        shared, _ = after[2]
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
    ratio = sum(fresh_wall) / sum(shared_wall)
    cpu_ratio = sum(fresh_cpu) / sum(shared_cpu)
    report(
        "fresh_vs_shared",
        f"shared: one call per state ({states} x {criteria}, ~{min(prompt_tokens)} tokens)",
        "fresh: one direct call per decision",
        ratio,
        cpu_time_ratio=cpu_ratio,
        fresh_decisions_per_s=decisions / sum(fresh_wall),
        shared_decisions_per_s=decisions / sum(shared_wall),
        fresh_per_state_s=spread(fresh_wall),
        shared_per_state_s=spread(shared_wall),
        fresh_cpu_per_state_s=spread(fresh_cpu),
        shared_cpu_per_state_s=spread(shared_cpu),
        argmax_flips=flips,
        max_probability_difference=worst,
    )
    assert flips == 0 and worst <= 1e-4  # exactness holds at every size
    if FULL:
        # The work ratio is asserted: CPU time of this process, which a neighbour's load on these
        # shared 2-core machines barely moves, while it inflates wall time unevenly. On a quiet
        # machine the two agree (both phases keep both cores busy); both are reported.
        assert cpu_ratio >= SHARED_TARGET, f"CPU-time ratio {cpu_ratio:.2f} (wall {ratio:.2f})"
