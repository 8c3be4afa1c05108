"""Benchmark fixtures: the model (SmolLM2 in full runs, a tiny Llama otherwise) and the results
file each full run writes (bench/results/<host>-<date>.json)."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import date
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from benchlib import FULL, RESULTS, SIZE  # noqa: E402

import semif_serve  # noqa: E402,F401


@pytest.fixture(scope="session")
def bench_model(tmp_path_factory):
    if FULL:
        from semif_serve.engine.loading import load_model

        return load_model("builtin:smollm2-135m")
    from tiny_models import byte_tokenizer, tiny_llama

    from semif_serve.scoring import ModelInfo, ScoringModel

    info = ModelInfo(source="bench:tiny-llama", revision="seed-0", dtype="float32", device="cpu")
    return ScoringModel(model=tiny_llama(), tokenizer=byte_tokenizer(), info=info)


def pytest_sessionfinish(session, exitstatus):
    if not FULL or not RESULTS:
        return
    host = platform.node() or "host"
    out = Path(__file__).parent / "results" / f"{host}-{date.today().isoformat()}.json"
    document = {
        "host": host,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "size": SIZE,
        "suites": RESULTS,
    }
    if out.exists():  # a later run the same day (or of some suites) updates its suites
        earlier = json.loads(out.read_text())
        document["suites"] = {**earlier.get("suites", {}), **RESULTS}
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nbench results written to {out}")
