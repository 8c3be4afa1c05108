"""The benchmark suites on a GPU: bf16, Qwen3.5-4B (or a random model with its config), with and
without the fast linear-attention kernels. Run through bench/gpu/run.sh; prints ONE JSON document
and writes it to bench/results/<host>-<date>-gpu.json.

The parent process runs one child per kernel set (`fast` when flash-linear-attention and
causal-conv1d import, and `reference` with both hidden), because transformers picks the kernels
when it first imports Qwen3.5. Each child measures, side by side:
- fresh (one direct call per decision) vs shared (one call per state) on the shape777 shape
  (37 states x 21 binary criteria, ~1,900 tokens): decisions/s, per-state spread, argmax flips
  and the max probability difference;
- a ~2,000-token decision: the scorer's p50 (server-side time; target <= 40 ms on an H200);
- 21 criteria over one state in one shared call (p50, N >= 3) and 3 rotations vs a plain call;
- memory per extra row (peak allocated) at prefixes of ~140/520/1,960/3,900 tokens, with the
  prefix shared (the default) and replicated (the fallback layout).

`--smoke` runs every suite once at a tiny size on a tiny random Qwen3.5 on the CPU, so `make test`
keeps this script working on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(HERE.parent), str(ROOT / "tests")]

# Qwen3.5-4B's text model (the hub config's text part); linear-attention sizes are the
# Qwen3_5TextConfig defaults, as in the released checkpoints.
QWEN35_4B = dict(
    vocab_size=248320,
    hidden_size=2560,
    intermediate_size=9216,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    rope_theta=10_000_000,
    partial_rotary_factor=0.25,
    tie_word_embeddings=True,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
)
FAST_KERNEL_MODULES = ("fla", "causal_conv1d")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (what make test does)")
    parser.add_argument("--child", choices=["fast", "reference"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child == "reference":
            for name in FAST_KERNEL_MODULES:  # find_spec() now says "not installed"
                sys.modules[name] = None
        print(json.dumps(measure(args.child, args.smoke)))
        return 0
    return orchestrate(args.smoke)


def orchestrate(smoke: bool) -> int:
    kernels = ["reference"] if smoke or not fast_kernels_importable() else ["fast", "reference"]
    document = {
        "host": platform.node() or "host",
        "date": date.today().isoformat(),
        "runs": {},
    }
    for kernel_set in kernels:
        command = [sys.executable, __file__, "--child", kernel_set] + (["--smoke"] if smoke else [])
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            document["runs"][kernel_set] = {"error": done.stderr.strip().splitlines()[-20:]}
            continue
        document["runs"][kernel_set] = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(document, indent=2))
    if not smoke:
        out = ROOT / "bench" / "results" / f"{document['host']}-{document['date']}-gpu.json"
        out.write_text(json.dumps(document, indent=2) + "\n")
        print(f"written to {out}", file=sys.stderr)
    return 0 if all("error" not in run for run in document["runs"].values()) else 1


def fast_kernels_importable() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in FAST_KERNEL_MODULES)


def measure(kernel_set: str, smoke: bool) -> dict:
    import torch

    import semif_serve  # noqa: F401  (offline first)

    model, model_note = load(smoke)
    sizes = SMOKE if smoke else (FULL if kernel_set == "fast" else REFERENCE)
    report = {"kernels": kernel_set, "model": model_note, "device": str(model.device)}
    if model.device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(model.device)
    report["fresh_vs_shared"] = fresh_vs_shared(model, **sizes["shape"])
    report["decide_2k"] = decide_latency(model, **sizes["decide"])
    report["shared_criteria_and_rotations"] = shared_and_rotations(model, **sizes["shared"])
    report["capacity"] = capacity(model, **sizes["capacity"])
    return report


FULL = {
    "shape": {"states": 37, "criteria": 21, "tokens": 1900},
    "decide": {"tokens": 2000, "rounds": 20},
    "shared": {"tokens": 2000, "criteria": 21, "rounds": 5},
    "capacity": {"prefixes": (140, 520, 1960, 3900), "rows": 16},
}
REFERENCE = {  # the reference kernels are slow: a smaller sample of the same shapes
    "shape": {"states": 4, "criteria": 21, "tokens": 1900},
    "decide": {"tokens": 2000, "rounds": 5},
    "shared": {"tokens": 2000, "criteria": 21, "rounds": 3},
    "capacity": {"prefixes": (1960,), "rows": 16},
}
SMOKE = {
    "shape": {"states": 2, "criteria": 3, "tokens": 120},
    "decide": {"tokens": 120, "rounds": 2},
    "shared": {"tokens": 120, "criteria": 3, "rounds": 3},
    "capacity": {"prefixes": (60,), "rows": 3},
}


def load(smoke: bool):
    """The snapshot named by SEMIF_MODEL/SEMIF_REVISION when it is cached, else a random model."""
    import torch
    from tiny_models import qwen35_tokenizer, tiny_qwen35

    from semif_serve.scoring import ModelInfo, ScoringModel

    if smoke:
        info = ModelInfo("bench:tiny-qwen3.5", "seed-0", "float32", "cpu")
        return ScoringModel(tiny_qwen35(), qwen35_tokenizer(), info), "tiny random Qwen3.5 (smoke)"
    from semif_serve.loading import ModelLoadError, load_model

    source = os.environ.get("SEMIF_MODEL", "Qwen/Qwen3.5-4B")
    try:
        model = load_model(
            source, revision=os.environ.get("SEMIF_REVISION"), device="cuda", dtype="bfloat16"
        )
        return model, f"{source} (real weights)"
    except ModelLoadError as error:
        print(f"no snapshot ({error}); random weights with Qwen3.5-4B's config", file=sys.stderr)
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**{**QWEN35_4B, "layer_types": QWEN35_4B["layer_types"] * 8})
    torch.manual_seed(0)
    with torch.device("cuda"):
        network = Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()
    info = ModelInfo("random:qwen3.5-4b-config", "seed-0", "bfloat16", "cuda")
    return ScoringModel(network, qwen35_tokenizer(), info), "random weights, Qwen3.5-4B config"


def synchronized_seconds(model, call) -> tuple[float, object]:
    import torch

    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    started = time.perf_counter()
    value = call()
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter() - started, value


def fresh_vs_shared(model, states: int, criteria: int, tokens: int) -> dict:
    from benchlib import spread
    from workloads import make_workload

    from semif_serve.scoring import score, score_shared

    groups = make_workload(model.tokenizer, states, criteria, tokens)
    score_shared(model, groups[0][:2], max_tokens=16384)  # warm-up
    fresh_s, shared_s, flips, worst = [], [], 0, 0.0
    for rows in groups:
        seconds, fresh = synchronized_seconds(
            model, lambda rows=rows: [score(model, row, max_tokens=16384) for row in rows]
        )
        fresh_s.append(seconds)
        seconds, (shared, _) = synchronized_seconds(
            model, lambda rows=rows: score_shared(model, rows, max_tokens=16384)
        )
        shared_s.append(seconds)
        for one, many in zip(fresh, shared):
            a, b = one["probabilities"], many["probabilities"]
            flips += a.index(max(a)) != b.index(max(b))
            worst = max(worst, *(abs(x - y) for x, y in zip(a, b)))
    decisions = states * criteria
    return {
        "shape": f"{states} x {criteria} at ~{tokens} tokens",
        "fresh_decisions_per_s": decisions / sum(fresh_s),
        "shared_decisions_per_s": decisions / sum(shared_s),
        "speedup": sum(fresh_s) / sum(shared_s),
        "fresh_per_state_s": spread(fresh_s),
        "shared_per_state_s": spread(shared_s),
        "argmax_flips": flips,
        "decisions": decisions,
        "max_probability_difference": worst,
        "target_decisions_per_s": 60,
    }


def decide_latency(model, tokens: int, rounds: int) -> dict:
    from benchlib import spread
    from workloads import make_workload

    from semif_serve.scoring import score

    row = make_workload(model.tokenizer, 1, 1, tokens)[0][0]
    score(model, row, max_tokens=16384)
    samples = [
        synchronized_seconds(model, lambda: score(model, row, max_tokens=16384))[0]
        for _ in range(rounds)
    ]
    return {"input_tokens": tokens, "scorer_s": spread(samples), "target_p50_s": 0.040}


def shared_and_rotations(model, tokens: int, criteria: int, rounds: int) -> dict:
    from benchlib import spread
    from workloads import make_workload

    from semif_serve.decisions import expand
    from semif_serve.scoring import parse_row, score_shared

    rows = make_workload(model.tokenizer, 1, criteria, tokens)[0]
    three_options = rows[0]["options"] + [{"id": "unsure", "description": "Cannot tell"}]
    plain = [parse_row({**rows[0], "options": three_options})]
    rotated = expand(plain[0], "rotations")  # 3 orderings of the same decision

    def timed(batch):
        score_shared(model, batch, max_tokens=16384)
        return spread(
            [
                synchronized_seconds(model, lambda: score_shared(model, batch, max_tokens=16384))[0]
                for _ in range(rounds)
            ]
        )

    plain_s, rotated_s = timed(plain), timed(rotated)
    return {
        "criteria": criteria,
        "shared_criteria_s": timed(rows),
        "plain_call_s": plain_s,
        "rotations_3_s": rotated_s,
        "rotations_cost": rotated_s["p50"] / plain_s["p50"],
    }


def capacity(model, prefixes: tuple[int, ...], rows: int) -> dict:
    """Peak allocated memory per extra row (CUDA), shared prefix vs replicated."""
    import torch
    from workloads import make_workload

    import semif_serve.scoring.shared as shared_module
    from semif_serve.scoring import score_shared

    if model.device.type != "cuda":
        return {"skipped": "peak allocated memory is measured on CUDA only"}
    points = {}
    for layout in ("shared-prefix", "replicated"):
        original = shared_module.enable_prefix_attention
        if layout == "replicated":
            model.model.set_attn_implementation("sdpa")
            shared_module.enable_prefix_attention = lambda network: False
        try:
            for prefix in prefixes:
                [group] = make_workload(model.tokenizer, 1, rows, prefix)
                peaks = []
                for batch in (group[:1], group):
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(model.device)
                    before = torch.cuda.memory_allocated(model.device)
                    score_shared(model, batch, max_tokens=16384)
                    peaks.append(torch.cuda.max_memory_allocated(model.device) - before)
                points[f"{layout}@{prefix}"] = {
                    "mib_per_extra_row": (peaks[1] - peaks[0]) / (rows - 1) / (1 << 20),
                    "one_row_peak_mib": peaks[0] / (1 << 20),
                }
        finally:
            shared_module.enable_prefix_attention = original
    return points


if __name__ == "__main__":
    sys.exit(main())
