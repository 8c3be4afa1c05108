"""Shared by the benchmark suites: the size switch, a timer, and the results they report.

SEMIF_BENCH_SIZE=full (make bench) uses the built-in SmolLM2 and the issue's shapes; the default
`tiny` runs every suite once on a tiny model (make test), so none of them rots.
"""

from __future__ import annotations

import json
import os
import statistics
import time

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


def report(suite: str, measured: str, against: str, ratio: float, **figures) -> None:
    """Print one line a person can read and keep the figures for the results file."""
    print(f"\n[{suite}] {measured} vs {against}: ratio {ratio:.2f} {json.dumps(figures)}")
    RESULTS[suite] = {"measured": measured, "against": against, "ratio": ratio, **figures}
