"""The GPU script: one run answers issue 14's questions on a GPU host in under 8 minutes of
device time; `--smoke` runs every part at a tiny size on the CPU, so `make test` keeps it working.
Run through bench/gpu/run.sh; prints ONE JSON document and (not in --smoke) writes it to
bench/results/<host>-<date>-gpu.json.

1. The model: SEMIF_MODEL (+ SEMIF_REVISION) when given; else random weights with Qwen3.5-4B's
   config (bf16, bench/gpu/qwen35_4b.py) saved once as a local snapshot (a child builds it).
2. Serving (bench/gpu/serve_check.py): a real `semif-serve serve` on that snapshot, started cold
   (empty kernel caches) and again on the same caches (restart): start-to-ready both times, the
   first decision after ready vs the warm p50, the 2k `/decide` p50 server-side, shape777-like
   shared throughput with its per-state spread, and argmax flips shared vs fresh.
3. Kernels, in-process, one child per kernel set (`fast` when flash-linear-attention imports,
   with or without causal-conv1d, which the output says; `reference` with both hidden, since
   transformers picks the kernels when it first imports Qwen3.5): the ~2k-token scorer p50 (their
   ratio is the fast-vs-reference figure), 21 criteria and 3 rotations in one shared call, and
   memory per extra shared row (CUDA only).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(HERE.parent), str(ROOT / "tests")]

FAST_KERNEL_MODULES = ("fla", "causal_conv1d")
SERVING_FULL = {
    "decide_tokens": 2000,
    "decide_rounds": 20,
    "states": 37,
    "criteria": 21,
    "state_tokens": 1900,
    "fresh_states": 5,
    "batch_callers": 16,
    "batch_rounds": 4,
    "batch_tokens": {"short": 200, "long": 2000},
    "batch_env": {"SEMIF_MAX_BATCH_ROWS": "16", "SEMIF_MAX_BATCH_TOKENS": "32768"},
    "growing_tokens": 1800,
    "growing_versions": 20,
}
SERVING_SMOKE = {
    "decide_tokens": 120,
    "decide_rounds": 2,
    "states": 2,
    "criteria": 3,
    "state_tokens": 120,
    "fresh_states": 1,
    "batch_callers": 4,
    "batch_rounds": 1,
    "batch_tokens": {"short": 60, "long": 120},
    "batch_env": {"SEMIF_MAX_BATCH_ROWS": "4", "SEMIF_MAX_BATCH_TOKENS": "4096"},
    "growing_tokens": 150,
    "growing_versions": 2,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (what make test does)")
    children = ["fast", "reference", "snapshot"]
    parser.add_argument("--child", choices=children, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "snapshot":
        from serve_check import save_random_snapshot

        save_random_snapshot(Path(args.folder), args.smoke)
        return 0
    if args.child:
        from semif_serve.engine.kernel_cache import configure

        configure()  # before torch loads: the serving run's caches (SEMIF_KERNEL_CACHE_DIR)
        if args.child == "reference":
            for name in FAST_KERNEL_MODULES:  # find_spec() now says "not installed"
                sys.modules[name] = None
        print(json.dumps(measure(args.child, args.smoke)))
        return 0
    return orchestrate(args.smoke)


def kernel_availability() -> dict[str, bool]:
    return {name: importlib.util.find_spec(name) is not None for name in FAST_KERNEL_MODULES}


def orchestrate(smoke: bool) -> int:
    started = time.perf_counter()
    available = kernel_availability()
    fast = available["fla"] and not smoke
    document = {
        "host": platform.node() or "host",
        "date": date.today().isoformat(),
        "kernels_available": available,
        "note": kernel_note(available, smoke),
    }
    with tempfile.TemporaryDirectory(prefix="semif-gpu-bench-") as folder:
        work = Path(folder)
        document["serving"] = serve(work, smoke, fast, available)
        document["runs"] = {}
        for kernel_set in ["fast", "reference"] if fast else ["reference"]:
            command = [sys.executable, __file__, "--child", kernel_set]
            done = run_child(command + (["--smoke"] if smoke else []), work)
            if done.returncode != 0:
                document["runs"][kernel_set] = {"error": done.stderr.strip().splitlines()[-20:]}
                continue
            document["runs"][kernel_set] = json.loads(done.stdout.strip().splitlines()[-1])
    runs = document["runs"]
    if all("decide_2k" in runs.get(name, {}) for name in ("fast", "reference")):
        document["reference_over_fast_2k_p50"] = (
            runs["reference"]["decide_2k"]["scorer_s"]["p50"]
            / runs["fast"]["decide_2k"]["scorer_s"]["p50"]
        )
    document["script_seconds"] = time.perf_counter() - started
    print(json.dumps(document, indent=2))
    if not smoke:
        out = ROOT / "bench" / "results" / f"{document['host']}-{document['date']}-gpu.json"
        out.write_text(json.dumps(document, indent=2) + "\n")
        print(f"written to {out}", file=sys.stderr)
    failed = "error" in document["serving"] or any("error" in run for run in runs.values())
    return 1 if failed else 0


def kernel_note(available: dict[str, bool], smoke: bool) -> str:
    if smoke:
        return "smoke: tiny random Qwen3.5 on the CPU, reference kernels"
    if not available["fla"]:
        return "flash-linear-attention missing: reference kernels only"
    if not available["causal_conv1d"]:
        return (
            "flash-linear-attention present, causal-conv1d MISSING: the fast run uses torch's "
            "depthwise conv fallback (the server runs with SEMIF_REQUIRE_FAST_KERNELS=0)"
        )
    return "flash-linear-attention and causal-conv1d present"


def run_child(command: list[str], work: Path) -> subprocess.CompletedProcess:
    """A child sharing the serving run's kernel caches (so it need not autotune again)."""
    env = {**os.environ, "SEMIF_KERNEL_CACHE_DIR": str(work / "kernel-cache")}
    return subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)


def serve(work: Path, smoke: bool, fast: bool, available: dict[str, bool]) -> dict:
    """The serving suites on SEMIF_MODEL, or on a random snapshot built by a child."""
    from serve_check import serving_suite

    env = {}
    if not fast or not available["causal_conv1d"]:
        env["SEMIF_REQUIRE_FAST_KERNELS"] = "0"
    source = os.environ.get("SEMIF_MODEL")
    if source is None or smoke:
        snapshot = work / "snapshot"
        command = [sys.executable, __file__, "--child", "snapshot", "--folder", str(snapshot)]
        done = run_child(command + (["--smoke"] if smoke else []), work)
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-20:]}
    else:
        snapshot = source  # with SEMIF_REVISION from the environment
    sizes = SERVING_SMOKE if smoke else SERVING_FULL
    try:
        return serving_suite(snapshot, work, smoke=smoke, sizes=sizes, env=env)
    except Exception as error:  # a failed suite is reported in the document, never hidden
        return {"error": [f"{type(error).__name__}: {error}"]}


def measure(kernel_set: str, smoke: bool) -> dict:
    import torch

    import semif_serve  # noqa: F401  (offline first)

    model, model_note = load(smoke)
    sizes = SMOKE if smoke else (FULL if kernel_set == "fast" else REFERENCE)
    report = {"kernels": kernel_set, "model": model_note, "device": str(model.device)}
    if model.device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(model.device)
    if smoke:  # the HTTP suite measures it at full size; here it keeps exactness checked
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
    from tiny_models import qwen35_tokenizer, tiny_qwen35

    from semif_serve.scoring import ModelInfo, ScoringModel

    if smoke:
        info = ModelInfo("bench:tiny-qwen3.5", "seed-0", "float32", "cpu")
        return ScoringModel(tiny_qwen35(), qwen35_tokenizer(), info), "tiny random Qwen3.5 (smoke)"
    from semif_serve.engine.loading import ModelLoadError, load_model

    source = os.environ.get("SEMIF_MODEL", "Qwen/Qwen3.5-4B")
    try:
        model = load_model(
            source, revision=os.environ.get("SEMIF_REVISION"), device="cuda", dtype="bfloat16"
        )
        return model, f"{source} (real weights)"
    except ModelLoadError as error:
        print(f"no snapshot ({error}); random weights with Qwen3.5-4B's config", file=sys.stderr)
    from qwen35_4b import random_qwen35_4b

    network = random_qwen35_4b()
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
        "target_decisions_per_s": 150,
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
    return {"input_tokens": tokens, "scorer_s": spread(samples), "target_p50_s": 0.035}


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
