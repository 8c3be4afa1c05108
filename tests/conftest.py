"""Shared fixtures: real models built or converted locally, once per test session, and a
socketpair per test."""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import socket
from pathlib import Path

import pytest
from tiny_models import qwen35_tokenizer, tiny_qwen35

import semif_serve  # noqa: F401  (offline before torch/transformers load)
from semif_serve.engine.loading import load_model
from semif_serve.scoring import ModelInfo, ScoringModel

# Under a mutant, a test that runs this long has hung (the slowest grid test takes ~7 s on a quiet
# machine, most under 1 s, and mutation/run shares each core between two runs; mutmut's own
# limit is at least 42 s plus the tests' measured time x 6).
MUTANT_HANG_S = 20


def under_mutant() -> bool:
    return "__mutmut_" in os.environ.get("MUTANT_UNDER_TEST", "")


def pytest_configure(config):
    """Under a mutant, freeze the heap the run starts with. mutmut's fork server forks each
    mutant's run from a process that has imported torch and the whole selection; pytest's
    gc.collect calls (3 a run) then rescan all of it: about 0.8 s of a 1.0 s run of a mutant
    that the first test kills, 0.2 s with the heap frozen.

    In a pytest-xdist worker (`make test` runs two, one per core), torch and every server the
    worker starts use one intra-op thread: two workers of torch's default two threads each
    oversubscribe two cores (the suite took 10 min 48 s of CPU this way instead of 16 min 56 s,
    with the fake-scorer servers torch-free too; docs/testing.md)."""
    if under_mutant():
        gc.freeze()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


def pytest_collection_modifyitems(config, items):
    """Under a mutant, run the fastest tests first (their times are in mutmut's stats), as
    mutmut's fork runner does and its fork server does not: with -x, a mutant's run ends at the
    first test that fails, so a slow test ahead of a fast failing one costs its whole time."""
    if not under_mutant():
        return
    stats = config.rootpath / "mutmut-stats.json"
    if not stats.exists():
        return
    seconds = json.loads(stats.read_text())["duration_by_test"]
    items.sort(key=lambda item: seconds.get(item.nodeid, 0.0))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under a mutmut mutant, a test still running after MUTANT_HANG_S ends the run with exit
    status 1 (faulthandler prints every thread's stack first): a mutant that hangs an unbounded
    wait is killed by the test that hangs. Without this, the order of a mutant's tests (their
    measured times, which differ between machines) decided it: the same hanging mutant was killed
    when a bounded-wait test ran first and timed out when a hanging one did: killed locally, an
    unrecorded timeout in CI."""
    if not under_mutant():
        yield
        return
    faulthandler.dump_traceback_later(MUTANT_HANG_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_runtest_logreport(report):
    """In mutmut's runs of the unmutated code (its stats and clean runs, in mutants/), a test
    that fails is written to mutants/clean-run-failures.txt: mutmut keeps their output to
    itself ("Failed to run clean test"), and mutation/run prints the file."""
    if report.failed and Path.cwd().name == "mutants" and not under_mutant():
        with open("clean-run-failures.txt", "a") as failures:
            failures.write(f"{report.nodeid}\n{report.longreprtext}\n\n")


# The real Qwen3.5 tokenizer, built once in mutmut's fork server (below): every mutant's run is
# forked from it and inherits it instead of building it again.
PREBUILT: dict[str, object] = {}


def pytest_collection_finish(session):
    """In mutmut's fork server (its warm-up is a --collect-only run in mutants/), build the real
    Qwen3.5 tokenizer once (3-7 s: its 150k-token vocabulary converted from tiktoken's format;
    pure Python and Rust, no torch thread is started in the process the runs fork from). Models
    are still built in each run: torch's threads are not fork-safe."""
    if session.config.option.collectonly and Path.cwd().name == "mutants":
        PREBUILT["qwen_tokenizer"] = qwen35_tokenizer()


@pytest.fixture(scope="session")
def qwen_tokenizer():
    return PREBUILT.get("qwen_tokenizer") or qwen35_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen(qwen_tokenizer) -> ScoringModel:
    info = ModelInfo(source="test:tiny-qwen3.5", revision="seed-0", dtype="float32", device="cpu")
    return ScoringModel(model=tiny_qwen35(), tokenizer=qwen_tokenizer, info=info)


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory):
    """A semif-serve cache folder that starts empty; the first SmolLM2 load converts into it."""
    return tmp_path_factory.mktemp("semif-cache")


@pytest.fixture(scope="session")
def smollm2(builtin_cache) -> ScoringModel:
    return load_model("builtin:smollm2-135m", cache_dir=builtin_cache)


@pytest.fixture
def pair():
    """A connected socketpair (the server's end first), closed after the test."""
    left, right = socket.socketpair()
    yield left, right
    left.close()
    right.close()
