"""Shared fixtures: real models built or converted locally, once per test session, and a
socketpair per test."""

from __future__ import annotations

import faulthandler
import os
import socket

import pytest
from tiny_models import qwen35_tokenizer, tiny_qwen35

import semif_serve  # noqa: F401  (offline before torch/transformers load)
from semif_serve.loading import load_model
from semif_serve.scoring import ModelInfo, ScoringModel

# Under a mutant, a test that runs this long has hung (the slowest grid test takes ~7 s on a quiet
# machine, most under 1 s; mutmut's own limit is at least 15 s plus the tests' measured time x 3).
MUTANT_HANG_S = 15


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under a mutmut mutant, a test still running after MUTANT_HANG_S ends the run with exit
    status 1 (faulthandler prints every thread's stack first): a mutant that hangs an unbounded
    wait is killed by the test that hangs. Without this, mutmut runs a mutant's tests in an
    arbitrary order (a set), so the same hanging mutant was killed when a bounded-wait test ran
    first and timed out when a hanging one did: killed locally, an unrecorded timeout in CI."""
    if "__mutmut_" not in os.environ.get("MUTANT_UNDER_TEST", ""):
        yield
        return
    faulthandler.dump_traceback_later(MUTANT_HANG_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def qwen_tokenizer():
    return qwen35_tokenizer()


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
