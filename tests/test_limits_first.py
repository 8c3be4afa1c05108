"""Every limit before the lock (issue 22, finding 2): requests are encoded, and refused, before
they take a slot or the engine lock (the cheap bound: tests/test_length_bound.py).

The production runtime over fake scorers whose encoding stage blocks on an event, and the
engine's encoding stage (TorchScorer's, on a real model: tests/test_inputs.py).
"""

from __future__ import annotations

import threading

import pytest
from fakes import AUTH, WAIT_S, FakeScorer, decision, fake_app, fake_runtime, row, settings
from falcon import testing
from runtime_fixtures import spec, wait_until

from semif_serve.engine.engine import Engine
from semif_serve.errors import OutOfMemory, ScoringFailed
from semif_serve.http import create_app
from semif_serve.runtime.registry import Runtime
from semif_serve.runtime.service import DecisionService
from semif_serve.scoring import PromptRejected, parse_row

BIG = "BIG"


class EncodingScorer(FakeScorer):
    """A fake scorer with an encoding stage: a row whose question is BIG blocks there until
    `go` is set, then is refused as too long; the others encode at once."""

    def __init__(self):
        super().__init__()
        self.encoding = threading.Event()
        self.go = threading.Event()
        self.prepared: list[str] = []

    def prepare(self, row):
        if row.question == BIG:
            self.encoding.set()
            assert self.go.wait(WAIT_S), "the test never let the encoding finish"
            raise PromptRejected("max_tokens: the prompt has at least 9999999 tokens")
        self.prepared.append(row.id)
        return ("encoded", row, self)

    def prepare_shared(self, rows):
        self.prepared.extend(row.id for row in rows)
        return ("encoded", list(rows), self)

    def score(self, row):
        assert row[0] == "encoded" and row[2] is self, "not prepared by this scorer"
        return super().score(row[1])

    def score_shared(self, rows):
        assert rows[0] == "encoded" and rows[2] is self, "not prepared by this scorer"
        return super().score_shared(rows[1])


def test_a_long_refusal_holds_no_slot_and_delays_no_one():
    """[22.2] With one slot, a request whose encoding takes long (and ends in a 422) does so
    before it queues: a small request meanwhile is scored, and the refusal held no slot."""
    scorer = EncodingScorer()
    config = settings()
    runtime = fake_runtime(scorer, config)
    api = testing.TestClient(create_app(DecisionService(runtime, config), config))
    outcome = {}

    def big():
        body = row(id="big", question=BIG)
        outcome["big"] = api.simulate_post("/decide", json=body, headers=AUTH)

    thread = threading.Thread(target=big)
    thread.start()
    try:
        assert scorer.encoding.wait(WAIT_S)
        assert runtime.entry(None).status()["active_slots"] == 0
        small = api.simulate_post("/decide", json=row(id="small"), headers=AUTH)
        assert small.status_code == 200, small.text
        assert small.json["id"] == "small"
        assert [name for name, _ in scorer.calls] == ["score"]  # only the small one was scored
    finally:
        scorer.go.set()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    assert outcome["big"].status_code == 422
    assert "at least 9999999 tokens" in outcome["big"].json["error"]["message"]
    assert len(scorer.calls) == 1


def test_shared_calls_are_encoded_before_they_are_scored():
    scorer = EncodingScorer()
    app, _ = fake_app(scorer)
    body = {"state": "s", "decisions": [decision("a"), decision("b")]}
    response = testing.TestClient(app).simulate_post("/decide/shared", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    assert scorer.prepared == ["a", "b"]
    assert [result["id"] for result in response.json["results"]] == ["a", "b"]


def test_a_refusal_in_the_encoding_stage_names_the_decision():
    class Refusing(EncodingScorer):
        def prepare_shared(self, rows):
            raise PromptRejected("rows[1]: max_tokens: too long", row_index=1)

    app, _ = fake_app(Refusing())
    body = {"state": "s", "decisions": [decision("a"), decision("b")]}
    response = testing.TestClient(app).simulate_post("/decide/shared", json=body, headers=AUTH)
    assert response.status_code == 422
    assert response.json["error"]["message"] == "decisions[1] (row 'b'): max_tokens: too long"


# -- the engine's encoding stage ---------------------------------------------------------------


def test_engine_prepare_without_a_stage_passes_rows_through_and_none_once_closed():
    engine = Engine(FakeScorer())
    parsed = parse_row(row())
    assert engine.prepare(parsed) is parsed
    assert engine.prepare_shared([parsed]) == [parsed]
    engine.close()
    assert engine.prepare(parsed) is None


@pytest.mark.parametrize(
    ("error", "expected"),
    [(ValueError("a tokenizer bug"), ScoringFailed), (MemoryError(), OutOfMemory)],
)
def test_engine_prepare_failures_are_the_servers_not_the_callers(error, expected):
    class Failing(FakeScorer):
        def prepare(self, row):
            raise error

    with pytest.raises(expected):
        Engine(Failing()).prepare(parse_row(row()))


def test_engine_prepare_passes_a_row_refusal_through():
    class Refusing(FakeScorer):
        def prepare(self, row):
            raise PromptRejected("max_tokens: too long")

    with pytest.raises(PromptRejected, match="too long"):
        Engine(Refusing()).prepare(parse_row(row()))


# -- which engine encodes (issue 22.2; the passthrough grid's service mutants) -----------------


class Engines:
    """A factory: each model id's engines drive a scorer of the kind given for it; `built`
    holds every scorer made, in order."""

    def __init__(self, kinds):
        self.kinds, self.built = kinds, []

    def __call__(self, model_spec):
        scorer = self.kinds[model_spec.id]()
        self.built.append(scorer)
        return Engine(scorer)


def models_app(factory, *specs, **overrides):
    config = settings(**overrides)
    runtime = Runtime(config, factory, list(specs), specs[0].id)
    runtime.start(idle_interval_s=None)
    return testing.TestClient(create_app(DecisionService(runtime, config), config)), runtime


def test_a_request_for_another_model_is_encoded_by_that_models_engine_before_it_queues():
    factory = Engines({"a": FakeScorer, "b": EncodingScorer})
    api, runtime = models_app(
        factory, spec("a", load_on_startup=True), spec("b", load_on_startup=True)
    )
    [_, encoder] = factory.built
    outcome = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault(
            "big", api.simulate_post("/decide", json=row(model="b", question=BIG), headers=AUTH)
        )
    )
    thread.start()
    try:
        assert encoder.encoding.wait(WAIT_S)  # b's own encoding stage, before b's queue
        assert runtime.entry("b").status()["active_slots"] == 0
    finally:
        encoder.go.set()
        thread.join(WAIT_S)
    assert outcome["big"].status_code == 422


def test_a_model_replaced_while_its_request_waited_encodes_it_again():
    factory = Engines({"a": EncodingScorer})
    api, runtime = models_app(factory, spec("a", load_on_startup=True))
    [old] = factory.built
    old.release.clear()  # the first request holds the model inside the scorer
    first = threading.Thread(
        target=api.simulate_post,
        args=("/decide",),
        kwargs={"json": row(id="first"), "headers": AUTH},
    )
    first.start()
    assert old.entered.wait(WAIT_S)
    manager = threading.Thread(
        target=runtime.register,
        args=("a", {"source": "test:a", "device": "cpu", "keep_alive_s": 60}),
    )
    manager.start()
    wait_until(lambda: len(runtime.entry("a")._queue) == 1)  # the reconfigure waits for `first`
    outcome = {}
    second = threading.Thread(
        target=lambda: outcome.setdefault(
            "second", api.simulate_post("/decide", json=row(id="second"), headers=AUTH)
        )
    )
    second.start()  # encoded by `old`, then queued behind the reconfigure
    wait_until(lambda: runtime.entry("a").status()["queued_requests"] == 1)
    assert old.prepared == ["first", "second"]
    old.release.set()
    for thread in (first, manager, second):
        thread.join(WAIT_S)
    [_, new] = factory.built
    assert outcome["second"].status_code == 200, outcome["second"].text
    assert new.prepared == ["second"]  # encoded again by the new engine's tokenizer


def test_a_request_that_loads_its_model_is_encoded_after_and_its_refusal_names_the_decision():
    class Refusing(EncodingScorer):
        def prepare_shared(self, rows):
            raise PromptRejected("rows[1]: max_tokens: too long", row_index=1)

    api, runtime = models_app(Engines({"a": Refusing}), spec("a"))  # not loaded yet
    body = {"state": "s", "decisions": [decision("a"), decision("b")]}
    response = api.simulate_post("/decide/shared", json=body, headers=AUTH)
    assert response.status_code == 422
    assert response.json["error"]["message"] == "decisions[1] (row 'b'): max_tokens: too long"
