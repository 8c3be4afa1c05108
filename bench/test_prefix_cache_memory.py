"""Is the worker's memory bounded by the state-prefix cache's budget? (issue 22)

One real server per phase (gunicorn, one worker, its gthread threads), SmolLM2 fp32 on the CPU in
full runs: 60 distinct ~1,600-token states, one call each, alternating `/decide` (one row) and
`/decide/shared` (3 rows), with `SEMIF_PREFIX_CACHE_GIB=0.25` and again with the cache off. The
worker's RSS (`VmRSS` of /proc/<pid>/status) is read once the server is ready (baseline), after
every call (the level it settles at between calls) and every 50 ms meanwhile (the peak, with a
call's transient activations). The plateau is the highest settled level over the second half of
the states, when the cache has long been full and evicting.

Target (asserted in full runs): plateau with the cache on <= baseline + budget + MARGIN_BYTES.
The stored bytes (`GET /v1/models`) are reported beside it, with the cache-off phase's plateau:
what the calls themselves leave resident.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from benchlib import FULL, model_source, report, sampled_peak
from fakes import AUTH
from live_server import LiveServer, semif_serve_command
from workloads import make_workload

MIB = 1 << 20
GIB = 1 << 30
BUDGET_GIB = 0.25
MARGIN_BYTES = 256 * MIB  # documented in docs/performance.md ("Memory bounded by the budget")
SHARED_ROWS = 3
SAMPLE_EVERY_S = 0.05


def worker_pid(master: int) -> int:
    """The one gunicorn worker forked by the `semif-serve serve` process `master`."""
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    assert len(children) == 1, f"expected one worker, found {children}"
    return int(children[0])


def vm_rss(pid: int) -> int:
    """The resident bytes of process `pid` (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def bodies(groups: list[list[dict]]) -> list[tuple[str, dict]]:
    """One call per state: `/decide` with its first row, `/decide/shared` with SHARED_ROWS rows,
    in turn."""
    calls = []
    for index, rows in enumerate(groups):
        if index % 2 == 0:
            calls.append(("/decide", rows[0]))
        else:
            decisions = [{k: r[k] for k in ("id", "question", "options")} for r in rows]
            calls.append(("/decide/shared", {"state": rows[0]["state"], "decisions": decisions}))
    return calls


def cache_stats(server: LiveServer) -> dict | None:
    status, reply, _ = server.request("GET", "/v1/models", headers=AUTH)
    assert status == 200, reply
    [model] = reply["models"]
    return model["prefix_cache"]


def run_phase(folder: Path, source: str, calls: list, cache_gib: float, env=None) -> dict:
    """Serve `calls` in order from a fresh server; the worker's RSS figures in bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    server_env = {
        "SEMIF_MODEL": source,
        "SEMIF_DEVICE": "cpu",
        "SEMIF_DTYPE": "float32",  # the figures; bfloat16 entries are half the bytes
        "SEMIF_MAX_TOKENS": "8192",
        "SEMIF_MAX_BODY_BYTES": str(8 << 20),
        "SEMIF_PREFIX_CACHE_GIB": str(cache_gib),
        **(env or {}),
    }
    with LiveServer(semif_serve_command(), server_env, folder / "server.log") as server:
        pid = worker_pid(server.process.pid)
        baseline, before = vm_rss(pid), cache_stats(server)
        settled, stored = [], []
        started = time.perf_counter()
        with sampled_peak(lambda: vm_rss(pid), SAMPLE_EVERY_S) as peak:
            for path, body in calls:
                status, reply, _ = server.request("POST", path, body, AUTH, timeout=600)
                assert status == 200, reply
                settled.append(vm_rss(pid))
                stats = cache_stats(server)
                stored.append(stats["bytes"] if stats else 0)
        seconds = time.perf_counter() - started
        final_stats = cache_stats(server)
    half = settled[len(settled) // 2 :]
    return {
        "baseline_bytes": baseline,
        "plateau_bytes": max(half),
        "plateau_over_baseline_bytes": max(half) - baseline,
        "last_bytes": settled[-1],
        "peak_bytes": peak["peak"],
        "max_stored_bytes": max(stored),
        "prefix_cache": final_stats,
        # A distinct state finds nothing of its own: a miss, or a partial hit on the start it
        # shares with the states before it (the template, the workload's opening).
        "first_calls": (
            final_stats["misses"]
            + final_stats["partial_hits"]
            - before["misses"]
            - before["partial_hits"]
            if final_stats
            else 0
        ),
        "settled_mib": [round((rss - baseline) / MIB) for rss in settled],
        "seconds": seconds,
    }


@pytest.fixture(scope="module")
def phases(tmp_path_factory, bench_model) -> dict:
    states, tokens = (60, 1600) if FULL else (4, 8)
    groups = make_workload(bench_model.tokenizer, states, SHARED_ROWS, tokens)
    calls = bodies(groups)
    folder = tmp_path_factory.mktemp("prefix-cache-memory")
    source = model_source(folder, bench_model)
    budget = BUDGET_GIB if FULL else 0.0005  # tiny: ~0.5 MiB, 3 tiny states: evictions too
    return {
        "states": states,
        "budget_bytes": int(budget * GIB),
        "on": run_phase(folder / "on", source, calls, budget),
        "off": run_phase(folder / "off", source, calls, 0),
    }


def test_worker_rss_within_the_cache_budget(phases):
    on, off, budget = phases["on"], phases["off"], phases["budget_bytes"]
    bound = budget + MARGIN_BYTES
    over = on["plateau_over_baseline_bytes"]
    report(
        "prefix_cache_memory",
        f"worker RSS plateau over its baseline, cache on ({phases['states']} distinct states, "
        f"budget {budget / MIB:.0f} MiB)",
        f"the budget + {MARGIN_BYTES // MIB} MiB margin",
        over / bound,
        budget_bytes=budget,
        margin_bytes=MARGIN_BYTES,
        on=on,
        off=off,
    )
    assert on["max_stored_bytes"] <= budget
    assert off["prefix_cache"] is None and off["max_stored_bytes"] == 0
    assert on["first_calls"] == phases["states"]  # every state distinct (warm-up's apart)
    if FULL:
        assert on["prefix_cache"]["evictions"] > 0  # the budget was exercised
        assert over <= bound, f"plateau {over / MIB:.0f} MiB over baseline > {bound / MIB:.0f}"
