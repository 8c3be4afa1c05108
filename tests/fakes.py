"""A fake scorer for the HTTP and engine contracts: no torch, no model, fully controllable.

Each option's logit is `base.get(description, 0.0) + bias[position]`, so tests can plant a
position bias and check that order averaging cancels it.
"""

from __future__ import annotations

import math
import os
import threading

from prometheus_client.parser import text_string_to_metric_families

from semif_serve.config import Settings
from semif_serve.engine.engine import Engine
from semif_serve.http import create_app
from semif_serve.runtime.service import DecisionService
from semif_serve.scoring.result import PROBABILITY_STATUS, READOUTS
from semif_serve.server import build_runtime

TOKEN = "t" * 40
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Every wait in a test is bounded by this. mutation/run lowers it (SEMIF_TEST_WAIT_S=3): a mutant
# that breaks a hand-off is killed when the wait runs out, and each such mutant's run lasted the
# whole bound, the longest part of a mutation run; a hand-off that works takes milliseconds.
WAIT_S = float(os.environ.get("SEMIF_TEST_WAIT_S", "10"))


def softmax(values):
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


class FakeScorer:
    def __init__(self, base=None, bias=None, error=None, block=False):
        self.base = base or {}
        self.bias = bias or [0.0] * 16
        self.error = error
        self.calls: list[tuple[str, object]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not block:
            self.release.set()
        self.active = 0
        self.max_active = 0
        self.cache = None
        self._count_lock = threading.Lock()

    def model_info(self):
        return {"source": "fake", "revision": "0" * 40, "dtype": "float32", "device": "cpu"}

    def result(self, row):
        logits = [
            self.base.get(option.description, 0.0) + self.bias[position]
            for position, option in enumerate(row.options)
        ]
        return {
            "id": row.id,
            "option_ids": row.option_ids,
            "probabilities": softmax(logits),
            "option_logits": logits,
            "input_tokens": 10,
            "forward_seconds": 0.001,
            "total_seconds": 0.002,
            "prompt_sha256": "f" * 64,
            "prompt_version": "direct-options-v1",
            "model": {
                **self.model_info(),
                "attention": "sdpa",
                "torch_version": "fake",
                "transformers_version": "fake",
            },
            "readout": READOUTS["direct"],
            "summary": "fake",
            "probability_status": PROBABILITY_STATUS,
            "cache_hit": False,
            "prefix_sha256": "e" * 64,
        }

    def cache_stats(self):
        """What a real scorer's state-prefix cache reports (None: the cache is off)."""
        return self.cache

    def _enter(self):
        with self._count_lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        self.entered.set()
        try:
            assert self.release.wait(WAIT_S), "test never released the scorer"
            if self.error is not None:
                raise self.error
        finally:
            with self._count_lock:
                self.active -= 1

    def score(self, row):
        self.calls.append(("score", row))
        self._enter()
        return self.result(row)

    def score_shared(self, rows):
        self.calls.append(("score_shared", list(rows)))
        self._enter()
        return [self.result(row) for row in rows], self.timing(rows)

    def timing(self, rows):
        """A shared call's timing: the state's 6 tokens once, 4 of each row's own."""
        return {
            "batch_size": len(rows),
            "total_seconds": 0.01,
            "prefix_tokens": 6,
            "true_suffix_tokens": 4 * len(rows),
            "prefix_stored": False,
            "cached_tokens": 0,
            "reuse_point": None,
        }


def settings(**overrides) -> Settings:
    values = {"api_token": TOKEN, "device": "cpu", "dtype": "float32"}
    values.update(overrides)
    return Settings(**values)


def fake_runtime(scorer, config):
    """The production runtime over one `default` model whose engine drives `scorer`."""
    runtime = build_runtime(config, lambda spec: Engine(scorer))
    runtime.start(idle_interval_s=None)
    return runtime


def fake_app(scorer=None, in_flight=None, **overrides):
    scorer = scorer or FakeScorer()
    config = settings(**overrides)
    service = DecisionService(fake_runtime(scorer, config), config)
    return create_app(service, config, in_flight), scorer


def row(id="r1", options=("Yes", "No"), **extra):
    body = {
        "id": id,
        "state": {"door": "open"},
        "question": "Is the door open?",
        "options": [{"id": f"o{index}", "description": text} for index, text in enumerate(options)],
    }
    body.update(extra)
    return body


def decision(id, options=("Yes", "No"), **extra):
    body = row(id, options, **extra)
    del body["state"]
    return body


def scrape(api):
    """GET /metrics (no token needed) as {(sample name, sorted labels): value}."""
    response = api.simulate_get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples
