"""Issue 23: the dynamic batcher through the real HTTP server, batching on vs SEMIF_MAX_BATCH_ROWS=1
(one server after the other, the same requests, in one run):

(a) 16 concurrent callers with distinct short states (prompts of ~100 tokens): decisions/s,
    target >= 1.3x;
(b) the same with ~600-token states: no loss, target >= 0.95x;
(c) one caller alone: latency unchanged, target <= 1.05x.
p50/p99 per request are reported. `make test` runs each once on a tiny model (no targets).
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
from benchlib import FULL, model_source, report, spread
from fakes import AUTH
from live_server import LiveServer, semif_serve_command
from workloads import make_workload

CALLERS = 16
REQUESTS_PER_CALLER = 6 if FULL else 1
TARGETS = {"short": 1.3, "long": 0.95}
ALONE_TARGET = 1.05
ON = {"SEMIF_MAX_BATCH_ROWS": "16", "SEMIF_MAX_BATCH_TOKENS": "16384"}
OFF = {"SEMIF_MAX_BATCH_ROWS": "1"}


def rows_of(tokenizer, count: int, tokens: int, seed: int) -> list[dict]:
    """`count` rows, each over its own state of about `tokens` prompt tokens."""
    return [group[0] for group in make_workload(tokenizer, count, 1, tokens, seed)]


def serving(tmp_path, bench_model, extra: dict[str, str]):
    model = model_source(tmp_path, bench_model)
    env = {"SEMIF_DEVICE": "cpu", "SEMIF_MAX_TOKENS": "8192", "SEMIF_MODEL": model, **extra}
    return LiveServer(semif_serve_command(), env, tmp_path / "server.log")


def post(server, row) -> tuple[float, dict]:
    started = time.perf_counter()
    status, reply, _ = server.request("POST", "/decide", row, AUTH, timeout=600)
    assert status == 200, reply
    return time.perf_counter() - started, reply


def concurrent(server, rows: list[dict], callers: int) -> tuple[float, list[float]]:
    """(decisions/s, each request's latency): `callers` threads send their share of `rows`."""
    latencies: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(callers + 1)

    def caller(mine: list[dict]) -> None:
        start.wait(timeout=600)
        for row in mine:
            seconds, _ = post(server, row)
            with lock:
                latencies.append(seconds)

    threads = [threading.Thread(target=caller, args=(rows[k::callers],)) for k in range(callers)]
    for thread in threads:
        thread.start()
    start.wait(timeout=600)
    started = time.perf_counter()
    for thread in threads:
        thread.join(600)
    return len(rows) / (time.perf_counter() - started), latencies


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@pytest.fixture(scope="module")
def measured(tmp_path_factory, bench_model):
    """Every scenario on the batching server, then on the unbatched one (same requests)."""
    count = CALLERS * REQUESTS_PER_CALLER
    workloads = {
        "short": rows_of(bench_model.tokenizer, count, 100 if FULL else 40, seed=1),
        "long": rows_of(bench_model.tokenizer, count, 600 if FULL else 80, seed=2),
    }
    alone = rows_of(bench_model.tokenizer, 8 if FULL else 2, 100 if FULL else 40, seed=3)
    figures: dict[str, dict] = {}
    for name, extra in (("on", ON), ("off", OFF)):
        with serving(tmp_path_factory.mktemp(f"batching-{name}"), bench_model, extra) as server:
            post(server, workloads["short"][0])  # warm
            figures[name] = {
                scenario: concurrent(server, rows, CALLERS) for scenario, rows in workloads.items()
            }
            figures[name]["alone"] = [post(server, row)[0] for row in alone]
    return figures


@pytest.mark.parametrize("scenario", ["short", "long"])
def test_concurrent_callers_batched_vs_one_at_a_time(measured, scenario):
    (on_rate, on_latency), (off_rate, off_latency) = (
        measured["on"][scenario],
        measured["off"][scenario],
    )
    ratio = on_rate / off_rate
    report(
        f"batching_{scenario}",
        f"{CALLERS} concurrent callers, distinct {scenario} states, batching on (decisions/s)",
        "SEMIF_MAX_BATCH_ROWS=1",
        ratio,
        on_decisions_per_s=on_rate,
        off_decisions_per_s=off_rate,
        on_p50_s=statistics.median(on_latency),
        on_p99_s=p99(on_latency),
        off_p50_s=statistics.median(off_latency),
        off_p99_s=p99(off_latency),
    )
    if FULL:
        assert ratio >= TARGETS[scenario], f"{scenario}: {ratio:.2f}x < {TARGETS[scenario]}x"


def test_one_caller_alone_is_not_slowed(measured):
    on, off = measured["on"]["alone"], measured["off"]["alone"]
    ratio = statistics.median(on) / statistics.median(off)
    report(
        "batching_alone",
        "one caller alone, batching on (latency)",
        "SEMIF_MAX_BATCH_ROWS=1",
        ratio,
        on_s=spread(on),
        off_s=spread(off),
    )
    if FULL:
        assert ratio <= ALONE_TARGET, f"alone: {ratio:.2f}x > {ALONE_TARGET}x"
