"""Shared fixtures: real models built or converted locally, once per test session, and a
socketpair per test."""

from __future__ import annotations

import socket

import pytest
from tiny_models import qwen35_tokenizer, tiny_qwen35

import semif_serve  # noqa: F401  (offline before torch/transformers load)
from semif_serve.loading import load_model
from semif_serve.scoring import ModelInfo, ScoringModel


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
