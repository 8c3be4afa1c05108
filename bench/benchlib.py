"""Shared by the benchmark suites: the size switch, a timer, concurrent callers, the model a bench
server serves, a peak sampler, and the results they report.

SEMIF_BENCH_SIZE=full (make bench) uses the built-in SmolLM2 and the issue's shapes; the default
`tiny` runs every suite once on a tiny model (make test), so none of them rots.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

SIZE = os.environ.get("SEMIF_BENCH_SIZE", "tiny")
FULL = SIZE == "full"
RESULTS: dict = {}


def spread(samples: list[float]) -> dict:
    """p50, min, max and count of timings in seconds."""
    return {
        "p50": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def timed(call, rounds: int) -> dict:
    """The spread of `rounds` calls, after one warm-up call."""
    call()
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return spread(samples)


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def concurrent_callers(
    send: Callable[[dict], object], rows: list[dict], callers: int, timeout_s: float = 600
) -> tuple[float, list[float]]:
    """(decisions/s, each call's seconds): `callers` threads released together by a barrier, each
    sending its share of `rows` one after another with `send(row)` (which raises on a failure)."""
    latencies: list[float] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(callers + 1)

    def caller(mine: list[dict]) -> None:
        start.wait(timeout=timeout_s)
        for row in mine:
            started = time.perf_counter()
            try:
                send(row)
            except BaseException as error:
                with lock:
                    failures.append(error)
                return
            with lock:
                latencies.append(time.perf_counter() - started)

    threads = [threading.Thread(target=caller, args=(rows[k::callers],)) for k in range(callers)]
    for thread in threads:
        thread.start()
    start.wait(timeout=timeout_s)
    started = time.perf_counter()
    for thread in threads:
        thread.join(timeout_s)
    elapsed = time.perf_counter() - started
    if failures:
        raise failures[0]
    assert not any(thread.is_alive() for thread in threads), "a caller did not finish in time"
    return len(rows) / elapsed, latencies


def taking_turns(calls: dict, rounds: int) -> dict:
    """Wall and CPU seconds of each call over `rounds`, after one warm-up each; the calls run in
    turn, the first of each round alternating, so drift and load fall on all of them."""
    names = list(calls)
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for call in calls.values():
        call()
    for index in range(rounds):
        for name in names if index % 2 == 0 else reversed(names):
            started, cpu_started = time.perf_counter(), time.process_time()
            calls[name]()
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
    return {name: {"wall_s": spread(wall[name]), "cpu_s": spread(cpu[name])} for name in names}


def report(suite: str, measured: str, against: str, ratio: float, **figures) -> None:
    """Print one line a person can read and keep the figures for the results file."""
    print(f"\n[{suite}] {measured} vs {against}: ratio {ratio:.2f} {json.dumps(figures)}")
    RESULTS[suite] = {"measured": measured, "against": against, "ratio": ratio, **figures}


def model_source(folder: Path, bench_model) -> str:
    """What a bench server's SEMIF_MODEL is: the built-in SmolLM2 in full runs, else the tiny
    bench model saved under `folder`."""
    if FULL:
        return "builtin:smollm2-135m"
    bench_model.model.save_pretrained(folder / "model")
    bench_model.tokenizer.save_pretrained(folder / "model")
    return str(folder / "model")


@contextmanager
def sampled_peak(read: Callable[[], int], every_s: float) -> Iterator[dict]:
    """{"start", "peak"}: `read()` (resident bytes) when the block starts and the most seen while
    it runs, sampled every `every_s` by a background thread that stops with the block."""
    figures = {"start": read()}
    figures["peak"] = figures["start"]
    stop = threading.Event()

    def sample():
        while not stop.wait(every_s):
            figures["peak"] = max(figures["peak"], read())

    sampler = threading.Thread(target=sample, name="peak-sampler", daemon=True)
    sampler.start()
    try:
        yield figures
    finally:
        stop.set()
        sampler.join(timeout=5)
    assert not sampler.is_alive(), "the peak sampler did not stop"
    figures["peak"] = max(figures["peak"], read())
