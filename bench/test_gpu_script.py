"""bench/gpu/run.py, the GPU suites, runs end to end in its --smoke mode (tiny Qwen3.5, CPU), so
the script a GPU host runs cannot rot unnoticed on machines without a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchlib import FULL

SCRIPT = Path(__file__).parent / "gpu" / "run.py"


@pytest.mark.skipif(FULL, reason="make bench measures the CPU; GPU figures come from run.sh")
def test_the_gpu_suites_run_and_report_every_figure():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    document = json.loads(done.stdout)
    assert document["note"].startswith("smoke") and set(document["kernels_available"]) == {
        "fla",
        "causal_conv1d",
    }
    serving = document["serving"]
    for start in ("cold", "restart"):
        assert serving[f"start_to_ready_s_{start}"] > 0
        first = serving[f"first_decision_{start}"]
        assert first["first_vs_warm_p50"] > 0 and first["warm_server_s"]["n"] == 2
    shared = serving["shared"]
    assert shared["shape"] == "2 x 3" and shared["shared_decisions_per_s"] > 0
    assert shared["compared"] == 3 and shared["argmax_flips"] == 0
    assert shared["max_probability_difference"] <= 1e-5
    assert serving["server_env"]["SEMIF_DEVICE"] == "cpu"
    growing = serving["growing"]  # a hybrid model's grown versions resume, exactly
    assert growing["versions"] == 2 and growing["cached_tokens"]["min"] > 0
    assert growing["max_probability_difference"] <= 1e-5 and growing["growing_grown_vs_cold"] > 0
    batching = serving["batching"]
    assert batching["env"]["SEMIF_MAX_BATCH_ROWS"] == "4"
    assert serving["start_to_ready_s_batching"] > 0
    for side in ("on", "off"):
        assert all(batching[side][name]["requests"] == 4 for name in ("short", "long"))
        assert batching[side]["alone_s"]["n"] == 2
    assert all(batching[f"batching_{name}_on_vs_off"] > 0 for name in ("short", "long", "alone"))
    [run] = document["runs"].values()
    assert run["kernels"] == "reference"
    fresh_vs_shared = run["fresh_vs_shared"]
    assert fresh_vs_shared["argmax_flips"] == 0
    assert fresh_vs_shared["max_probability_difference"] <= 1e-5
    assert fresh_vs_shared["shared_decisions_per_s"] > 0 and fresh_vs_shared["speedup"] > 0
    assert run["decide_2k"]["scorer_s"]["n"] == 2
    assert run["shared_criteria_and_rotations"]["rotations_cost"] > 0
    assert "skipped" in run["capacity"]  # peak memory is measured on CUDA only
