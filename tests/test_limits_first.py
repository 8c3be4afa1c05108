"""Every limit before the lock (issue 22, finding 2): requests are encoded, and refused, before
they take a slot or the engine lock, and an absurdly long prompt is refused from its bytes alone.

The service half drives the production runtime over a fake scorer whose encoding stage blocks
on an event; the tokenizer half uses the project's real tokenizers (tiny Qwen3.5's, SmolLM2's).
"""

from __future__ import annotations

import threading

import pytest
from fakes import AUTH, WAIT_S, FakeScorer, decision, fake_app, fake_runtime, row, settings
from falcon import testing
from hypothesis import given
from hypothesis import strategies as st
from test_control_tokens import EXAMPLES, smollm2_tokenizer  # noqa: F401  (a fixture)
from tiny_models import byte_tokenizer
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from semif_serve.engine import Engine
from semif_serve.errors import OutOfMemory, ScoringFailed
from semif_serve.http import create_app
from semif_serve.runtime.service import DecisionService
from semif_serve.scoring import PromptRejected, parse_row, score, score_shared, shared_prompts
from semif_serve.scoring import prompt as prompt_module
from semif_serve.scoring.inputs import DirectInput, SharedInput
from semif_serve.scoring.length_bound import bytes_per_token, fewest_tokens
from semif_serve.scoring.prompt import encode_prompt
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


# -- the cheap bound -----------------------------------------------------------------------------


def huge_row(megabytes: int = 16) -> dict:
    text = "evidence " * (megabytes * (1 << 20) // 9)
    options = [{"id": f"o{k}", "description": text[: len(text) // 16]} for k in range(16)]
    return {"id": "huge", "state": "s", "question": "Which?", "options": options}


@pytest.fixture
def no_encoding(monkeypatch):
    """Fails the test if any prompt reaches the tokenizer's encoding (the layout stage)."""

    def refuse(*args, **kwargs):
        raise AssertionError("the prompt was encoded")

    monkeypatch.setattr(prompt_module, "layout", refuse)
    monkeypatch.setattr(shared_prompts, "layout", refuse)


def test_an_absurd_prompt_is_refused_from_its_bytes_without_encoding(qwen_tokenizer, no_encoding):
    """[22.2] 16 options of 1 MB: refused before the tokenizer runs (it took 45 s before)."""
    huge = parse_row(huge_row())
    with pytest.raises(PromptRejected, match=r"^max_tokens: the prompt has at least \d+ tokens"):
        encode_prompt(qwen_tokenizer, huge, 4096)
    with pytest.raises(PromptRejected, match=r"^rows\[0\]: max_tokens: the prompt has at least"):
        shared_prompts.encode_shared(qwen_tokenizer, [huge], 4096)
    with pytest.raises(PromptRejected, match="at least") as refused:
        shared_prompts.encode_with_prefix(qwen_tokenizer, huge, 4096)
    assert refused.value.row_index is None  # a direct refusal names no row


def test_the_bound_names_the_first_row_too_long(qwen_tokenizer, no_encoding):
    rows = [parse_row({**huge_row(1), "id": "a"}), parse_row({**huge_row(2), "id": "b"})]
    with pytest.raises(PromptRejected) as refused:
        shared_prompts.encode_shared(qwen_tokenizer, rows, 100)
    assert refused.value.row_index == 0


def test_bytes_per_token_of_the_project_tokenizers(qwen_tokenizer, smollm2_tokenizer):  # noqa: F811
    assert bytes_per_token(qwen_tokenizer) == 256 * 3  # its longest entry; NFC shrinks by 3
    assert bytes_per_token(smollm2_tokenizer) is not None
    assert bytes_per_token(byte_tokenizer()) == 2  # "Ġ" spells one byte in two: a safe bound


def test_fewest_tokens_rounds_up():
    assert fewest_tokens("", 4) == 0
    assert fewest_tokens("abcd", 4) == 1
    assert fewest_tokens("abcde", 4) == 2
    assert fewest_tokens("é", 1) == 2  # bytes, not characters


HOSTILE = [
    " " * 3000,  # the longest entries are whitespace runs
    "-" * 3000,
    "\u1100\u1161\u11a8" * 300,  # Hangul jamo: NFC composes three 3-byte ones into one
    "\U0001d400" * 300,  # a 4-byte mathematical letter
    "\u212a" * 300,  # the Kelvin sign
    "e\u0301" * 500,
]


@given(data=st.data())
@EXAMPLES
def test_no_text_encodes_to_fewer_tokens_than_the_bound(tokenizer, data):
    """The bound is a bound: the real encoding of drawn (and hostile) text is never shorter."""
    text = data.draw(
        st.lists(
            st.one_of(st.sampled_from(HOSTILE), st.text(st.characters(exclude_categories=("Cs",)))),
            max_size=4,
        ).map("".join)
    )
    bound = bytes_per_token(tokenizer)
    assert bound is not None
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= fewest_tokens(text, bound)


@pytest.fixture(scope="module", params=["qwen35", "smollm2"])
def tokenizer(request):
    return request.getfixturevalue(
        "qwen_tokenizer" if request.param == "qwen35" else "smollm2_tokenizer"
    )


def fast(normalizer=None, pre_tokenizer=None, model=None) -> PreTrainedTokenizerFast:
    vocab = {"a": 0, "b": 1, "ab": 2, "[UNK]": 3}
    backend = Tokenizer(
        model or models.BPE(vocab, [("a", "b")], unk_token="[UNK]", byte_fallback=True)
    )
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: fast(), 5),  # "[UNK]" is the longest entry
        (lambda: fast(normalizers.NFKC()), 20),
        (lambda: fast(normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])), 45),
        (lambda: fast(normalizers.Replace(" ", "\u2581")), 5),
        (lambda: fast(normalizers.Replace("abcdef", "ab")), 15),
        (lambda: fast(normalizers.Replace("a", "")), None),  # deletes text
        (lambda: fast(normalizers.Strip()), None),
        (lambda: fast(normalizers.StripAccents()), None),
        (lambda: fast(normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])), None),
        (lambda: fast(pre_tokenizer=pre_tokenizers.Whitespace()), None),  # drops spaces
        (lambda: fast(pre_tokenizer=pre_tokenizers.Metaspace()), 5),
        (
            lambda: fast(
                pre_tokenizer=pre_tokenizers.Sequence(
                    [pre_tokenizers.Digits(), pre_tokenizers.Split(" ", "removed")]
                )
            ),
            None,
        ),
        (lambda: fast(model=models.BPE({"a": 0}, [], unk_token="a")), None),  # no byte fallback
        (lambda: fast(model=models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")), None),
    ],
)
def test_only_tokenizers_that_keep_every_byte_have_a_bound(build, expected):
    assert bytes_per_token(build()) == expected


def test_a_tokenizer_without_a_fast_backend_has_no_bound():
    assert bytes_per_token(object()) is None
