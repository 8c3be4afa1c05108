"""What the CPU's batch-invariant numerics cost, and bfloat16 vs float32 (issue 44), in one run.

Three calls: one direct decision at ~260 prompt tokens, one at ~1,800, and one shared call of 21
questions over the ~1,800-token state (issue 44's W1). Each in four variants on the same
weights: bfloat16 and float32, each invariant (`scoring/invariant.py`, the default) and on the
stock kernels (`invariant=False`). The variants take turns call by call, so a neighbour's load
falls on all of them. Reported per call: invariant / stock wall time per dtype (the cost of
invariance; < 1.15 is the issue's target), and float32 / bfloat16 with both invariant (what
the new CPU default gains). Full runs (`make bench`) load the built-in SmolLM2-135M; `make
test` runs each variant once on the tiny Llama and checks that invariant rows equal the stock
ones within bfloat16's rounding.
"""

import copy
import dataclasses

import torch
from benchlib import FULL, report, taking_turns
from workloads import make_workload

from semif_serve.scoring import ScoringModel, score, score_shared

MAX_TOKENS = 8192
ROUNDS = 5 if FULL else 1
VARIANTS = [(dtype, invariant) for dtype in ("bfloat16", "float32") for invariant in (True, False)]


def variant(bench_model: ScoringModel, dtype: str, invariant: bool) -> ScoringModel:
    """The bench model in `dtype` on the invariant or the stock kernels: in full runs loaded as
    the server loads it, else the tiny model's weights copied."""
    if FULL:
        from semif_serve.engine.loading import load_model

        return load_model(bench_model.info.source, dtype=dtype, invariant=invariant)
    model = copy.deepcopy(bench_model.model).to(getattr(torch, dtype)).eval()
    info = dataclasses.replace(bench_model.info, dtype=dtype)
    return ScoringModel(model, bench_model.tokenizer, info, invariant=invariant)


def test_invariance_cost_and_bfloat16_speed(bench_model):
    short = make_workload(bench_model.tokenizer, states=1, criteria=1, tokens=260)[0][0]
    (long_rows,) = make_workload(bench_model.tokenizer, states=1, criteria=21, tokens=1800)
    calls = {
        "direct ~260 tokens": lambda model: score(model, short, max_tokens=MAX_TOKENS),
        "direct ~1,800 tokens": lambda model: score(model, long_rows[0], max_tokens=MAX_TOKENS),
        "shared 21 over ~1,800": lambda model: score_shared(
            model, long_rows, max_tokens=MAX_TOKENS
        ),
    }
    models = {(dtype, inv): variant(bench_model, dtype, inv) for dtype, inv in VARIANTS}
    figures = {}
    for name, call in calls.items():
        times = taking_turns(
            {
                f"{dtype} {'invariant' if inv else 'stock'}": (lambda m=m, c=call: c(m))
                for (dtype, inv), m in models.items()
            },  # fmt: skip
            ROUNDS,
        )
        p50 = {label: time["wall_s"]["p50"] for label, time in times.items()}
        figures[name] = {
            "wall_p50_s": p50,
            "invariance_cost_bfloat16": p50["bfloat16 invariant"] / p50["bfloat16 stock"],
            "invariance_cost_float32": p50["float32 invariant"] / p50["float32 stock"],
            "float32_over_bfloat16_invariant": p50["float32 invariant"] / p50["bfloat16 invariant"],
        }
    first = figures["direct ~260 tokens"]
    report(
        "invariance_cost",
        "bfloat16 invariant",
        "bfloat16 stock",
        first["invariance_cost_bfloat16"],
        calls=figures,
        rounds=ROUNDS,
    )
    alike = [score(models[(dtype, inv)], short, max_tokens=MAX_TOKENS)["probabilities"]
             for dtype, inv in VARIANTS]  # fmt: skip
    for probabilities in alike[1:]:
        assert max(abs(a - b) for a, b in zip(alike[0], probabilities)) < 0.05
