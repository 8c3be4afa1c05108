"""Every limit before the lock (issue 22, finding 2): requests are encoded, and refused, before
they take a slot or the engine lock (the cheap bound: tests/test_length_bound.py).

The production runtime over a fake scorer whose encoding stage blocks on an event; the engine's
encoding stage; TorchScorer's stages over the tiny Qwen3.5.
"""

from __future__ import annotations

import threading

import pytest
from fakes import AUTH, WAIT_S, FakeScorer, decision, fake_app, fake_runtime, row, settings
from falcon import testing
from test_control_tokens import EXAMPLES, smollm2_tokenizer  # noqa: F401  (a fixture)

from semif_serve.engine import Engine
from semif_serve.errors import OutOfMemory, ScoringFailed
from semif_serve.http import create_app
from semif_serve.runtime.service import DecisionService
from semif_serve.scoring import PromptRejected, parse_row, score, score_shared
from semif_serve.scoring.inputs import DirectInput, SharedInput
from semif_serve.torch_scorer import TorchScorer

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
        return ("encoded", row)

    def prepare_shared(self, rows):
        self.prepared.extend(row.id for row in rows)
        return ("encoded", list(rows))

    def score(self, row):
        assert row[0] == "encoded", "score got rows that were never prepared"
        return super().score(row[1])

    def score_shared(self, rows):
        assert rows[0] == "encoded", "score_shared got rows that were never prepared"
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


def test_prepared_inputs_score_as_plain_rows(tiny_qwen):
    """TorchScorer's stages: a prepared input gives the result plain rows give."""
    scorer = TorchScorer(tiny_qwen, max_tokens=4096)
    one = parse_row(row(options=("Yes", "No", "Maybe")))
    prepared = scorer.prepare(one)
    assert isinstance(prepared, DirectInput)
    assert scorer.score(prepared)["option_logits"] == scorer.score(one)["option_logits"]
    rows = [parse_row(row(id=f"r{k}", question=f"Is it {k}?")) for k in range(3)]
    shared = scorer.prepare_shared(rows)
    assert isinstance(shared, SharedInput)
    from_input, timing = scorer.score_shared(shared)
    from_rows, _ = scorer.score_shared(rows)
    assert [r["option_logits"] for r in from_input] == [r["option_logits"] for r in from_rows]
    assert timing["encode_seconds"] == shared.encode_seconds


def test_an_input_checked_against_another_limit_is_encoded_again(tiny_qwen):
    long_row = parse_row(row(question="word " * 200))
    prepared = TorchScorer(tiny_qwen, max_tokens=4096).prepare(long_row)
    with pytest.raises(PromptRejected, match="max_tokens"):
        score(tiny_qwen, prepared, max_tokens=100)
    shared = TorchScorer(tiny_qwen, max_tokens=4096).prepare_shared([long_row])
    with pytest.raises(PromptRejected, match="max_tokens"):
        score_shared(tiny_qwen, shared, max_tokens=100)
