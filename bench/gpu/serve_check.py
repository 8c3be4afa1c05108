"""The serving half of the GPU script: a real `semif-serve serve` on a model snapshot, measured
over HTTP the way callers see it (bench/gpu/run.py runs it; `--smoke` runs it on the CPU).

One kernel-cache folder, two starts: the first is cold (empty caches: Triton compiles and
autotunes during the warm-up), the second is a restart on the same host (caches kept). For each
start it reports start-to-ready (process start to the first `/health` 200) and the first
decision after ready against the warm p50 of the same ~2k-token decision: warm-up must leave
nothing to compile or autotune (target <= 1.5x). The first start also measures the 2k `/decide`
p50 server-side (`total_seconds`; target <= 35 ms on an H200), shape777-like shared throughput
(states x 21 criteria over ~1,900-token states, one `/decide/shared` per state; target >= 150
decisions/s, per-state max <= 1.5x the median) and argmax flips shared vs fresh (`/decide` per
decision) on a sample of states (target <= 1%). Then the dynamic batcher (issue 23): concurrent
callers with distinct ~200- and ~2k-token states on the restarted server (batching off, the
default) and on a third start with batching on (same caches), decisions/s on vs off (targets
>= 8x at ~200 tokens, >= 1.8x at ~2k on an H200) with p50/p99 per request, and one caller alone
(latency on vs off, target <= 1.05x). And growing states (issue 31): a ~1,800-token JSON log
grown by one event 20 times, each version resumed from the one before vs the same call cold
(a session of its own), target <= 0.2x server-side.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import concurrent_callers, p99, spread, timed
from workloads import distinct_states, events_for, log_state, make_workload
from workloads import row as log_row

from semif_serve.engine.kernel_cache import SUBFOLDERS, SWITCHES

CACHE_VARIABLES = {*SUBFOLDERS, *SWITCHES}
TOKEN = "gpu-bench-token-not-served-anywhere-00000"
READY_TIMEOUT_S = 600  # a cold start on a GPU autotunes every warmed shape
STOP_TIMEOUT_S = 60
TARGETS = {
    "first_decision_vs_warm_p50": 1.5,
    "decide_2k_server_p50_s": 0.035,
    "shared_decisions_per_s": 150,
    "per_state_max_over_median": 1.5,
    "argmax_flip_fraction": 0.01,
    "batching_short_on_vs_off": 8.0,
    "batching_long_on_vs_off": 1.8,
    "batching_alone_on_vs_off": 1.05,
    "growing_grown_vs_cold": 0.2,
}


def save_random_snapshot(folder: Path, smoke: bool) -> Path:
    """A random Qwen3.5 (the 4B config on CUDA in bf16; the tiny one on the CPU for --smoke)
    saved with the Qwen3.5 tokenizer, so the server loads it like any local snapshot."""
    from tiny_models import qwen35_tokenizer, tiny_qwen35

    if smoke:
        network = tiny_qwen35()
    else:
        from qwen35_4b import random_qwen35_4b

        network = random_qwen35_4b()
    network.save_pretrained(folder)
    qwen35_tokenizer().save_pretrained(folder)
    return folder


class Server:
    """`python -m semif_serve serve` on 127.0.0.1 with the given environment; bounded waits."""

    def __init__(self, env: dict[str, str], log_path: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        inherited = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
        self.env = {
            **inherited,  # the kernel caches follow SEMIF_KERNEL_CACHE_DIR, never the caller's
            **env,
            "SEMIF_API_TOKEN": TOKEN,
            "SEMIF_BIND": f"127.0.0.1:{self.port}",
        }
        self.log_path = log_path

    def start(self) -> float:
        """Seconds from process start to the first /health 200."""
        self.log = open(self.log_path, "ab")
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "semif_serve", "serve"],
            env=self.env,
            stdout=self.log,
            stderr=self.log,
        )
        deadline = started + READY_TIMEOUT_S
        while True:
            if self.process.poll() is not None or time.perf_counter() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the server did not become ready:\n{tail}")
            try:
                if self.request("GET", "/health", timeout=2)[0] == 200:
                    return time.perf_counter() - started
            except OSError:
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)
        self.log.close()

    def request(self, method: str, path: str, body=None, timeout: float = 300, session=None):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
            if session is not None:
                headers["X-Semif-Session"] = session
            payload = json.dumps(body).encode() if body is not None else None
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            connection.close()

    def decide(self, row: dict, session: str | None = None) -> dict:
        status, body = self.request("POST", "/decide", row, session=session)
        if status != 200:
            raise RuntimeError(f"/decide answered {status}: {body}")
        return body

    def decide_shared(self, rows: list[dict]) -> dict:
        decisions = [{key: row[key] for key in ("id", "question", "options")} for row in rows]
        status, body = self.request(
            "POST", "/decide/shared", {"state": rows[0]["state"], "decisions": decisions}
        )
        if status != 200:
            raise RuntimeError(f"/decide/shared answered {status}: {body}")
        return body


def first_vs_warm(server: Server, row: dict, rounds: int) -> dict:
    """The first decision after ready (client wall and server total), then the warm p50."""
    started = time.perf_counter()
    first = server.decide(row)
    first_wall = time.perf_counter() - started
    warm = [server.decide(row)["total_seconds"] for _ in range(rounds)]
    p50 = spread(warm)["p50"]
    return {
        "first_client_s": first_wall,
        "first_server_s": first["total_seconds"],
        "warm_server_s": spread(warm),
        "first_vs_warm_p50": first["total_seconds"] / p50,
        "input_tokens": first["input_tokens"],
    }


def shared_throughput(server: Server, groups: list[list[dict]], fresh_states: int) -> dict:
    """One /decide/shared per state; then /decide per decision on the first `fresh_states`
    states, for argmax flips between the two paths."""
    per_state, shared_results = [], []
    for rows in groups:
        started = time.perf_counter()
        shared_results.append(server.decide_shared(rows)["results"])
        per_state.append(time.perf_counter() - started)
    flips = compared = 0
    worst = 0.0
    for rows, results in zip(groups[:fresh_states], shared_results):
        for row, shared in zip(rows, results):
            fresh = server.decide(row)["probabilities"]
            many = shared["probabilities"]
            flips += fresh.index(max(fresh)) != many.index(max(many))
            worst = max(worst, *(abs(a - b) for a, b in zip(fresh, many)))
            compared += 1
    decisions = sum(len(rows) for rows in groups)
    median = spread(per_state)["p50"]
    return {
        "shape": f"{len(groups)} x {len(groups[0])}",
        "shared_decisions_per_s": decisions / sum(per_state),
        "per_state_s": spread(per_state),
        "per_state_max_over_median": max(per_state) / median,
        "argmax_flips": flips,
        "compared": compared,
        "argmax_flip_fraction": flips / compared if compared else None,
        "max_probability_difference": worst,
    }


def growing_state(server: Server, tokenizer, tokens: int, versions: int) -> dict:
    """An agent's JSON log of about `tokens` tokens, stored, then `versions` versions each grown
    by one event (issue 31): each grown call (its session's store holds the version before) in
    turns with the same call in a session of its own (nothing stored there: a cold prefill);
    server-side seconds. Target: grown p50 <= 0.2x cold p50."""
    base = events_for(tokenizer, "json", tokens)
    server.decide(log_row(log_state("json", 0, base)), session="growing")
    seconds: dict[str, list[float]] = {"grown": [], "cold": []}
    resumed, worst = [], 0.0
    for version in range(1, versions + 1):
        body = log_row(log_state("json", version, base))
        calls = [("grown", "growing"), ("cold", f"cold-{version}")]
        replies = {}
        for name, session in calls if version % 2 else calls[::-1]:
            replies[name] = server.decide(body, session=session)
            seconds[name].append(replies[name]["total_seconds"])
        resumed.append(replies["grown"]["cached_tokens"])
        pairs = zip(replies["grown"]["probabilities"], replies["cold"]["probabilities"])
        worst = max(worst, *(abs(a - b) for a, b in pairs))
    grown, cold = spread(seconds["grown"]), spread(seconds["cold"])
    return {
        "input_tokens": replies["grown"]["input_tokens"],
        "versions": versions,
        "grown_server_s": grown,
        "cold_server_s": cold,
        "cached_tokens": spread(resumed),
        "max_probability_difference": worst,
        "growing_grown_vs_cold": grown["p50"] / cold["p50"],
    }


def alone(server: Server, row: dict, rounds: int) -> dict:
    """One caller alone: its client seconds (benchlib.timed: after one warm-up call)."""
    return timed(functools.partial(server.decide, row), rounds)


def concurrency(server: Server, workloads: dict[str, list[dict]], callers: int) -> dict:
    """Per workload: a warm-up round on its first `callers` rows (batched shapes compile and
    autotune there; rows of their own, so no measured state is in the prefix cache yet), then
    decisions/s with `callers` concurrent callers over the rest, and each request's seconds."""
    figures = {}
    for name, rows in workloads.items():
        concurrent_callers(server.decide, rows[:callers], callers)
        rate, latencies = concurrent_callers(server.decide, rows[callers:], callers)
        figures[name] = {
            "decisions_per_s": rate,
            "p50_s": statistics.median(latencies),
            "p99_s": p99(latencies),
            "requests": len(latencies),
        }
    return figures


def batching_ratios(on: dict, off: dict) -> dict:
    ratios = {
        f"batching_{name}_on_vs_off": on[name]["decisions_per_s"] / off[name]["decisions_per_s"]
        for name in ("short", "long")
    }
    ratios["batching_alone_on_vs_off"] = on["alone_s"]["p50"] / off["alone_s"]["p50"]
    return ratios


def serving_suite(
    snapshot: Path, work: Path, *, smoke: bool, sizes: dict, env: dict[str, str]
) -> dict:
    """Cold start, the HTTP suites, then a restart on the same kernel caches."""
    from tiny_models import qwen35_tokenizer

    tokenizer = qwen35_tokenizer()
    [[decide_row]] = make_workload(tokenizer, 1, 1, sizes["decide_tokens"])
    groups = make_workload(tokenizer, sizes["states"], sizes["criteria"], sizes["state_tokens"])
    callers = sizes["batch_callers"]
    count = callers * (1 + sizes["batch_rounds"])  # the first `callers` warm up
    workloads = {
        name: distinct_states(tokenizer, count, tokens, seed)
        for seed, (name, tokens) in enumerate(sizes["batch_tokens"].items(), start=1)
    }
    server_env = {
        "SEMIF_MODEL": str(snapshot),
        "SEMIF_DEVICE": "cpu" if smoke else "cuda",
        "SEMIF_DTYPE": "float32" if smoke else "bfloat16",
        "SEMIF_KERNEL_CACHE_DIR": str(work / "kernel-cache"),
        **env,
    }
    report: dict = {"server_env": {k: v for k, v in server_env.items() if k != "SEMIF_MODEL"}}
    for start in ("cold", "restart"):
        server = Server(server_env, work / f"server-{start}.log")
        report[f"start_to_ready_s_{start}"] = server.start()
        try:
            report[f"first_decision_{start}"] = first_vs_warm(
                server, decide_row, sizes["decide_rounds"]
            )
            if start == "cold":
                report["shared"] = shared_throughput(server, groups, sizes["fresh_states"])
                report["growing"] = growing_state(
                    server, tokenizer, sizes["growing_tokens"], sizes["growing_versions"]
                )
            else:
                off = concurrency(server, workloads, callers)
                off["alone_s"] = alone(server, decide_row, sizes["decide_rounds"])
        finally:
            server.stop()
    batching_env = {**server_env, **sizes["batch_env"]}
    server = Server(batching_env, work / "server-batching.log")
    report["start_to_ready_s_batching"] = server.start()
    try:
        on = concurrency(server, workloads, callers)
        on["alone_s"] = alone(server, decide_row, sizes["decide_rounds"])
    finally:
        server.stop()
    report["batching"] = {
        "env": sizes["batch_env"],
        "callers": callers,
        "tokens": sizes["batch_tokens"],
        "on": on,
        "off": off,
        **batching_ratios(on, off),
    }
    report["targets"] = TARGETS
    return report
