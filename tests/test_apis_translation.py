"""Golden translation fixtures for POST /v1/systemone and POST /v1/decisions (semif_serve/apis):
every mapping rule of upstream SemIf's System One layer (../shared/spec/decision-apis.md §3) and
the Decisions rendering documented in semif_serve/apis/decisions.py, as the exact rows a request
becomes (`Mapped`, and the `Row`s the fake scorer receives), every refusal with its exact message
and code, the replies' exact shapes (floats always written as floats, confidence, score, usage,
the `semif` block, the model that answered), and the routes' HTTP surface: OpenAI's `type` and
`param` on their errors only, Retry-After with retry-after-ms, x-typesafe-request-id on every
reply. No server, no model: direct calls and falcon's test client over tests/fakes.py."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
from fakes import AUTH, FakeScorer, decision, fake_app
from falcon import testing
from hypothesis import given, settings
from hypothesis import strategies as st

from semif_serve.apis import decisions, mapping, systemone
from semif_serve.apis.fields import Field, refused
from semif_serve.apis.mapping import NO, YES, Mapped, Scored
from semif_serve.errors import (
    InsufficientMemory,
    InvalidRequest,
    ModelLoadFailed,
    ModelNotFound,
    OptionCountUnsupported,
    OutOfMemory,
    QueueTimedOut,
    RequestTimeout,
    ScoringFailed,
    ServerBusy,
    Unauthorized,
)
from semif_serve.http.environ import CLIENT_GONE_KEY
from semif_serve.http.errors import classify, hosted_detail, openai_fields
from semif_serve.runtime.admission import InFlightLimit
from semif_serve.scoring.result import PROBABILITY_STATUS

IMAGE_REFUSED = "images are not supported: this server runs a text-only model"
OVER_LIMIT = (
    "{where}: {count} {noun}, over the {limit} this server scores (SEMIF_MAX_OPTIONS; the "
    "format allows 255). Nothing is truncated: split the question"
)


def api(scorer=None, **overrides):
    app, scorer = fake_app(scorer or FakeScorer(), **overrides)
    return testing.TestClient(app), scorer


def post(path, body, scorer=None, **overrides):
    client, scorer = api(scorer, **overrides)
    return client.simulate_post(path, json=body, headers=AUTH), scorer


def rows(scorer):
    """Every row the scorer was sent, over all its calls."""
    return [row for _, call in scorer.calls for row in call]


def shown(row):
    """A Row as (id, state, question, [(option id, description)])."""
    return (row.id, row.state, row.question, [(o.id, o.description) for o in row.options])


def refusal(body_or_error, message, code="invalid_request"):
    """The 422 body: OpenAI's fields in `error`, System One's `detail` (the field as a path)."""
    field = None if message.startswith("body:") else re.match(r"([^:\s][^:]*): ", message)[1]
    path = [] if field is None else re.findall(r"[^.\[\]]+", field)
    loc = ["body", *(int(step) if step.isdigit() else step for step in path)]
    msg = message if field is None else message[len(field) + 2 :]
    return {
        "error": {
            "code": code,
            "message": message,
            "type": "invalid_request_error",
            "param": field,
        },
        "detail": [{"loc": loc, "msg": msg, "type": code}],
    }


def noul(instructions="Is it open?", **more):
    return {"type": "noul", "instructions": instructions, **more}


def s1(*questions, **more):
    """A System One body whose questions are named a, b, c, ..."""
    named = {chr(ord("a") + k): q for k, q in enumerate(questions)}
    return {"state": {"door": "open"}, "questions": named, **more}


def dq(kind="predicate", instructions="Is it open?", **more):
    return {"type": kind, "instructions": instructions, **more}


def od(*questions, **more):
    return {"input": "The door is open.", "questions": list(questions), **more}


CHOICES2 = [{"value": "a"}, {"value": "b"}]
LEVELS2 = [{"label": "low"}, {"label": "high"}]


# --- mapping's helpers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "text"),
    [
        ("  as it is\n", "  as it is\n"),
        ("", ""),
        ({"b": 1, "a": ["é", None, True, 1.5]}, '{"b": 1, "a": ["é", null, true, 1.5]}'),
        (["x", {"z": "ü", "y": {}}], '["x", {"z": "ü", "y": {}}]'),
        ({}, "{}"),
    ],
)
def test_content_is_a_string_as_it_is_or_json_in_insertion_order_with_non_ascii_kept(content, text):
    assert mapping.content_text(content, "w") == text


@pytest.mark.parametrize(
    ("value", "name"), [(5, "number"), (2.5, "number"), (True, "boolean"), (None, "null")]
)
def test_content_of_another_type_is_refused_naming_it(value, name):
    with pytest.raises(InvalidRequest) as raised:
        mapping.content_text(value, "questions.a.criteria.x")
    assert (
        str(raised.value)
        == f"questions.a.criteria.x: must be a string, object or array, got {name}"
    )


def test_content_holding_nan_is_never_rendered():
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        mapping.content_text({"x": math.nan}, "w")


def test_content_nested_too_deeply_is_refused():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(InvalidRequest) as raised:
        mapping.content_text(deep, "questions.a.instructions")
    assert str(raised.value) == "questions.a.instructions: nested too deeply"


@pytest.mark.parametrize(
    ("content", "text"),
    [
        (None, "fallback"),
        ("", "fallback"),
        (" ", " "),
        ({}, "{}"),
        ([], "[]"),
        ("0", "0"),
        ({"a": 1}, '{"a": 1}'),
    ],
)
def test_a_description_falls_back_only_when_null_or_empty(content, text):
    assert mapping.described(content, "fallback", "w") == text


@pytest.mark.parametrize(("content", "name"), [(0, "number"), (False, "boolean"), (0.0, "number")])
def test_a_falsy_description_of_another_type_is_refused_not_replaced(content, name):
    with pytest.raises(InvalidRequest) as raised:
        mapping.described(content, "fallback", "questions.a.criteria.x")
    assert (
        str(raised.value)
        == f"questions.a.criteria.x: must be a string, object or array, got {name}"
    )


def test_instructions_missing_null_or_blank_are_refused():
    with pytest.raises(InvalidRequest) as raised:
        mapping.instructions_text(None, "w.instructions")
    assert str(raised.value) == "w.instructions: missing; every question needs instructions"
    for blank in ("", " \n\t"):
        with pytest.raises(InvalidRequest) as raised:
            mapping.instructions_text(blank, "w.instructions")
        assert str(raised.value) == "w.instructions: must not be empty"
    assert mapping.instructions_text(" Q? ", "w") == " Q? "
    assert mapping.instructions_text({"q": 1}, "w") == '{"q": 1}'


def test_option_counts_are_2_to_the_limit_and_more_is_option_count_unsupported():
    for count in (2, 3, 16, 17, 254, 255):
        assert mapping.check_option_count(count, "w", "levels", 255) is None
    assert mapping.check_option_count(40, "w", "levels", 40) is None
    with pytest.raises(OptionCountUnsupported) as raised:
        mapping.check_option_count(256, "questions.a.criteria", "levels", 255)
    assert str(raised.value) == OVER_LIMIT.format(
        where="questions.a.criteria", count=256, noun="levels", limit=255
    )
    with pytest.raises(OptionCountUnsupported) as raised:
        mapping.check_option_count(17, "w", "choices", 16)
    assert str(raised.value).startswith("w: 17 choices, over the 16 this server scores")
    for count in (1, 0):
        with pytest.raises(InvalidRequest) as raised:
            mapping.check_option_count(count, "w", "choices", 255)
        assert type(raised.value) is InvalidRequest
        assert str(raised.value) == f"w: needs at least 2 choices, got {count}"


def test_question_counts_are_1_to_400():
    for count in (1, 400):
        assert mapping.check_question_count(count) is None
    for count in (0, 401):
        with pytest.raises(InvalidRequest) as raised:
            mapping.check_question_count(count)
        assert str(raised.value) == f"questions: must hold 1..400 questions, got {count}"
    with pytest.raises(InvalidRequest, match=r"^elsewhere: must hold 1\.\.400 questions, got 0$"):
        mapping.check_question_count(0, "elsewhere")


def test_a_yes_no_question_is_true_then_false_with_the_default_descriptions():
    assert YES == "The answer to the question is yes."
    assert NO == "The answer to the question is no."
    assert mapping.yes_no("questions.a", "Q?") == Mapped(
        "questions.a", "Q?", (YES, NO), (("criteria", "true"), ("criteria", "false"))
    )
    assert mapping.yes_no("w", "Q?", "Y", "N", ("i", "i")) == Mapped(
        "w", "Q?", ("Y", "N"), ("i", "i")
    )


@pytest.mark.parametrize(
    ("probabilities", "confidence"),
    [
        ([0.5, 0.25, 0.25], 0.25),
        ([0.5, 0.5], 0.0),
        ([1 / 3, 1 / 3, 1 / 3], 0.0),
        ([0.75, 0.25], 0.5),
        ([1.0, 0.0, 0.0, 0.0], 1.0),
        ([0.25, 0.5, 0.125, 0.125], (4 * 0.5 - 1) / 3),
        ([1.25, -0.25], 1.0),  # clamped above
        ([0.25, 0.125], 0.0),  # clamped below: (2 * 0.25 - 1) / 1 < 0
    ],
)
def test_confidence_is_the_normalized_peak_clamped_to_0_1(probabilities, confidence):
    assert mapping.confidence(probabilities) == confidence
    assert type(mapping.confidence(probabilities)) is float


def test_the_score_is_the_probability_weighted_level_and_top_the_first_peak():
    assert mapping.expected_score([0.5, 0.25, 0.25]) == 0.75
    assert mapping.expected_score([0.0, 0.0, 1.0]) == 2.0
    assert mapping.expected_score([0.125, 0.5, 0.25, 0.125]) == 0.5 + 0.5 + 0.375
    assert type(mapping.expected_score([1, 0])) is float
    assert mapping.top([0.25, 0.5, 0.25]) == 1
    assert mapping.top([0.4, 0.2, 0.4]) == 0  # a tie: the first
    assert mapping.top([0.1, 0.2, 0.7]) == 2


@pytest.mark.parametrize(
    ("value", "name"),
    [
        ({}, "object"),
        ([], "array"),
        ("", "string"),
        (False, "boolean"),
        (None, "null"),
        (0, "number"),
        (0.5, "number"),
        (b"", "value"),
        (object(), "value"),
    ],
)
def test_type_names_are_json_s(value, name):
    assert mapping.type_name(value) == name


def test_check_keys_refuses_a_non_object_and_names_unknown_keys_sorted():
    allowed = frozenset({"type", "criteria", "instructions"})
    assert mapping.check_keys({"type": 1}, allowed, "w") == {"type": 1}
    with pytest.raises(InvalidRequest) as raised:
        mapping.check_keys(["type"], allowed, "questions.a")
    assert str(raised.value) == "questions.a: must be an object, got array"
    with pytest.raises(InvalidRequest) as raised:
        mapping.check_keys({"zeta": 1, "type": 1, "alpha": 2}, allowed, "questions.a")
    assert str(raised.value) == (
        "questions.a: unknown keys ['alpha', 'zeta']; allowed: criteria, instructions, type"
    )


def test_an_image_is_refused_naming_where():
    error = mapping.refuse_image("input[2].content[1]")
    assert type(error) is InvalidRequest
    assert str(error) == f"input[2].content[1]: {IMAGE_REFUSED}"


QUESTIONS = [
    Mapped("questions.a", "Q1", ("x", "y"), ("criteria.calm", "criteria.angry")),
    Mapped("questions.b", "Q2", ("x", "y", "z"), ("levels[0]", "levels[1]", "levels[2]")),
]


def test_shared_bodies_are_one_call_or_as_many_as_max_decisions_needs():
    three = [*QUESTIONS, Mapped("questions.c", "Q3", ("p", "q"), ("i", "i"))]
    bodies = mapping.shared_bodies("S", three, {"timeout_s": 5}, 2)
    first = {
        "id": "q0",
        "question": "Q1",
        "options": [{"id": "o0", "description": "x"}, {"id": "o1", "description": "y"}],
    }
    second = {
        "id": "q1",
        "question": "Q2",
        "options": [
            {"id": "o0", "description": "x"},
            {"id": "o1", "description": "y"},
            {"id": "o2", "description": "z"},
        ],
    }
    third = {
        "id": "q2",
        "question": "Q3",
        "options": [{"id": "o0", "description": "p"}, {"id": "o1", "description": "q"}],
    }
    assert bodies == [
        {"state": "S", "decisions": [first, second], "timeout_s": 5},
        {"state": "S", "decisions": [third], "timeout_s": 5},
    ]
    assert mapping.shared_bodies("S", three, {}, 64) == [
        {"state": "S", "decisions": [first, second, third]}
    ]
    assert [len(b["decisions"]) for b in mapping.shared_bodies("S", three * 3, {}, 4)] == [4, 4, 1]


def result(probabilities, hit=False, **more):
    return {"probabilities": probabilities, "cache_hit": hit, **more}


def test_scored_counts_the_state_once_and_reads_the_cache_from_the_first_call():
    replies = [
        {
            "results": [result([0.5, 0.5], hit=True), result([1.0, 0.0])],
            "timing": {
                "prefix_tokens": 6,
                "true_suffix_tokens": 8,
                "prefix_stored": True,
                "cached_tokens": 4,  # a state that grew: 4 of its 6 tokens resumed
            },
        },
        {
            "results": [result([0.25, 0.75], hit=False)],
            "timing": {
                "prefix_tokens": 9,
                "true_suffix_tokens": 5,
                "prefix_stored": False,
                "cached_tokens": 9,
            },
        },
    ]
    got = mapping.scored(iter(replies))
    assert got == Scored(
        results=[*replies[0]["results"], *replies[1]["results"]],
        input_tokens=6 + 8 + 5,
        cached_tokens=4,
        written_tokens=6,
    )
    replies[0]["timing"]["cached_tokens"] = 0  # only the first call says for the state
    replies[0]["timing"]["prefix_stored"] = False
    replies[1]["timing"]["prefix_stored"] = True
    assert mapping.scored(replies) == Scored(
        results=[*replies[0]["results"], *replies[1]["results"]],
        input_tokens=19,
        cached_tokens=0,
        written_tokens=0,
    )
    del replies[0]["timing"]["prefix_stored"]  # a timing that does not say: nothing written
    del replies[0]["timing"]["cached_tokens"]  # nor reused
    assert mapping.scored(replies).written_tokens == 0
    assert mapping.scored(replies).cached_tokens == 0


def test_answered_runs_each_call_and_names_a_refusal_by_its_question_in_that_call():
    three = [
        *QUESTIONS,
        Mapped("questions.c", "Q3", ("p", "q"), ("criteria.true", "criteria.false")),
    ]
    sent = []

    def decide_shared(body):
        sent.append(body)
        return {
            "results": [result([0.5, 0.5]) for _ in body["decisions"]],
            "timing": {"prefix_tokens": 3, "true_suffix_tokens": 2 * len(body["decisions"])},
        }

    got = mapping.answered("S", three, {"timeout_s": 1}, 2, decide_shared)
    assert sent == mapping.shared_bodies("S", three, {"timeout_s": 1}, 2)
    assert (len(got.results), got.input_tokens) == (3, 3 + 6)

    def refuse_second(body):
        if body["decisions"][0]["id"] == "q2":
            raise OptionCountUnsupported("decisions[0].options[1].description: too long")
        return decide_shared(body)

    with pytest.raises(OptionCountUnsupported) as raised:
        mapping.answered("S", three, {}, 2, refuse_second, "input")
    assert str(raised.value) == "questions.c.criteria.false: too long"

    def refuse_state(body):
        raise InvalidRequest("state: must be a nonempty string, object or array")

    with pytest.raises(InvalidRequest) as raised:
        mapping.answered("", three, {}, 2, refuse_state)
    assert str(raised.value) == "state: must be a nonempty string, object or array"
    with pytest.raises(InvalidRequest) as raised:
        mapping.answered("", three, {}, 2, refuse_state, "input")
    assert str(raised.value) == "input: must be a nonempty string, object or array"


@pytest.mark.parametrize(
    ("message", "state_field", "renamed"),
    [
        (
            "decisions[1].options[0].description: must be a nonempty string",
            "state",
            "questions.b.levels[0]: must be a nonempty string",
        ),
        (
            "decisions[0].options[1].description: must be a nonempty string",
            "input",
            "questions.a.criteria.angry: must be a nonempty string",
        ),
        (
            "decisions[0].options[1]: must be an object",
            "state",
            "questions.a.criteria.angry: must be an object",
        ),
        ("decisions[1].options[2].id: duplicate", "state", "questions.b.levels[2]: duplicate"),
        (
            "decisions[1].options[3].description: x",
            "state",
            "questions.b.options[3].description: x",
        ),
        (
            "decisions[1] (row 'q1'): max_tokens: the prompt has 5000 tokens",
            "state",
            "questions.b: max_tokens: the prompt has 5000 tokens",
        ),
        (
            "decisions[0] (row 'q0'): letter guard: letters share a token",
            "input",
            "questions.a: letter guard: letters share a token",
        ),
        (
            "decisions[0].question: must be a nonempty string",
            "state",
            "questions.a.instructions: must be a nonempty string",
        ),
        (
            "decisions[1].orderings: must be one of none",
            "state",
            "questions.b.orderings: must be one of none",
        ),
        ("decisions[0]: must be an object", "state", "questions.a: must be an object"),
        (
            "state: must be a nonempty string, object or array",
            "input",
            "input: must be a nonempty string, object or array",
        ),
        (
            "state: nested deeper than 32 levels (at state.a)",
            "input",
            "input: nested deeper than 32 levels (at state.a)",
        ),
    ],
)
def test_located_names_the_question_s_own_fields(message, state_field, renamed):
    error = mapping.located(InvalidRequest(message), QUESTIONS, state_field)
    assert type(error) is InvalidRequest
    assert str(error) == renamed


@pytest.mark.parametrize(
    ("message", "state_field"),
    [
        ("decisions[2].options[0].description: x", "state"),  # no such question in this call
        ("decisions[9] (row 'q9'): x", "input"),
        ("decisions: must hold 1..64 entries, got 65", "state"),
        ("state: must be a nonempty string, object or array", "state"),
        ("timeout_s: must be a number of seconds, 0 < timeout_s <= 86400", "input"),
        ("max_tokens: the prompt has 5000 tokens", "input"),
    ],
)
def test_located_keeps_a_message_that_names_no_question(message, state_field):
    error = InvalidRequest(message)
    assert mapping.located(error, QUESTIONS, state_field) is error


def test_located_keeps_the_error_s_kind():
    error = mapping.located(OptionCountUnsupported("decisions[0]: x"), QUESTIONS, "state")
    assert (type(error), str(error)) == (OptionCountUnsupported, "questions.a: x")


def test_the_readout_block_records_how_the_answer_was_read():
    fake = FakeScorer().result(systemone_row())
    block = mapping.readout(fake, with_confidence=True)
    assert block == {
        "method": "direct-options-v1",
        "option_logits": fake["option_logits"],
        "probabilities": fake["probabilities"],
        "prompt_sha256": "f" * 64,
        "prompt_version": "direct-options-v1",
        "input_tokens": 10,
        "temperature": 1.0,
        "probability_status": PROBABILITY_STATUS,
        "cache_hit": False,
        "prefix_sha256": "e" * 64,
        "model": fake["model"],
        "confidence_formula": "normalized-peak-v1",
    }
    del fake["cache_hit"], fake["prefix_sha256"]
    plain = mapping.readout(fake, with_confidence=False)
    assert "confidence_formula" not in plain
    assert (plain["cache_hit"], plain["prefix_sha256"]) == (None, None)
    assert list(plain) == list(block)[:-1]


def systemone_row():
    from semif_serve.scoring.rows import parse_row

    return parse_row(
        {
            "id": "q0",
            "state": "s",
            "question": "q",
            "options": [{"id": "o0", "description": "a"}, {"id": "o1", "description": "b"}],
        }
    )


# --- System One: golden fixtures ---------------------------------------------------------------


def parsed_s1(question):
    [parsed] = systemone.parse({"state": "S", "questions": {"urgency": question}}).questions
    return parsed


@pytest.mark.parametrize(
    ("criteria", "descriptions"),
    [
        ("absent", (YES, NO)),
        (None, (YES, NO)),
        ({}, (YES, NO)),
        ({"true": "It is about money."}, ("It is about money.", NO)),
        ({"false": "It is not."}, (YES, "It is not.")),
        ({"true": None, "false": ""}, (YES, NO)),
        ({"true": "", "false": None}, (YES, NO)),
        ({"true": {"k": "ü", "a": 1}, "false": ["n", None]}, ('{"k": "ü", "a": 1}', '["n", null]')),
        ({"false": "F", "true": "T"}, ("T", "F")),  # always true then false
    ],
)
def test_noul_is_true_then_false_a_described_side_replacing_its_default(criteria, descriptions):
    question = (
        noul("Is it urgent?") if criteria == "absent" else noul("Is it urgent?", criteria=criteria)
    )
    assert parsed_s1(question) == systemone.Question(
        "urgency",
        "noul",
        (),
        Mapped(
            "questions.urgency",
            "Is it urgent?",
            descriptions,
            (("criteria", "true"), ("criteria", "false")),
        ),
    )


def test_choice_is_its_criteria_in_key_order_an_empty_description_being_the_name():
    criteria = {
        "calm": None,
        "angry": "An upset message",
        "mixed": "",
        "meta": {"b": 1, "a": [1, "é"]},
        "list": ["x", 2],
        "Zürich": "Ort",
    }
    question = {"type": "choice", "instructions": "What is the tone?", "criteria": criteria}
    assert parsed_s1(question) == systemone.Question(
        "urgency",
        "choice",
        ("calm", "angry", "mixed", "meta", "list", "Zürich"),
        Mapped(
            "questions.urgency",
            "What is the tone?",
            ("calm", "An upset message", "mixed", '{"b": 1, "a": [1, "é"]}', '["x", 2]', "Ort"),
            tuple(("criteria", name) for name in criteria),
        ),
    )


def test_score_is_one_option_per_level_in_order_with_the_level_texts():
    question = {
        "type": "score",
        "instructions": "How urgent?",
        "criteria": ["Can wait", {"when": "today"}, "Now"],
    }
    assert parsed_s1(question) == systemone.Question(
        "urgency",
        "score",
        ("Can wait", '{"when": "today"}', "Now"),
        Mapped(
            "questions.urgency",
            "How urgent?",
            ("Can wait", '{"when": "today"}', "Now"),
            (("criteria", 0), ("criteria", 1), ("criteria", 2)),
        ),
    )


@pytest.mark.parametrize(
    ("instructions", "text"),
    [
        ("  Is it urgent?\n", "  Is it urgent?\n"),
        (
            {"ask": "Urgent?", "lang": "de", "ß": [1, None]},
            '{"ask": "Urgent?", "lang": "de", "ß": [1, null]}',
        ),
        (["Urgent?", {"scale": "0-2"}], '["Urgent?", {"scale": "0-2"}]'),
    ],
)
def test_instructions_are_a_string_as_is_or_json(instructions, text):
    assert parsed_s1(noul(instructions)).mapped.question == text


def test_the_request_keeps_its_model_state_order_and_timeout():
    body = {
        "model": "jev-latest",
        "state": {"b": 1, "a": "x"},
        "questions": {"z": noul("Z?"), "a": noul("A?"), "m": noul("M?")},
        "timeout_s": 2.5,
        "assets": None,
    }
    request = systemone.parse(body)
    assert (request.model, request.state, request.routing) == (
        "jev-latest",
        {"b": 1, "a": "x"},
        {"timeout_s": 2.5},
    )
    assert [q.name for q in request.questions] == ["z", "a", "m"]
    assert [q.mapped.where for q in request.questions] == [
        "questions.z",
        "questions.a",
        "questions.m",
    ]
    plain = systemone.parse({"state": "S", "questions": {"q": noul()}})
    assert (plain.model, plain.state, plain.routing) == (None, "S", {})


def test_16_options_are_scored_and_2_too():
    names = {f"c{k}": None for k in range(16)}
    assert len(parsed_s1({"type": "choice", "instructions": "q", "criteria": names}).labels) == 16
    assert (
        len(parsed_s1({"type": "score", "instructions": "q", "criteria": ["a"] * 16}).labels) == 16
    )
    assert parsed_s1({"type": "score", "instructions": "q", "criteria": ["lo", "hi"]}).labels == (
        "lo",
        "hi",
    )


def test_system_one_rows_reach_the_scorer_as_one_shared_call():
    body = {
        "state": {"ticket": "Printer jams", "by": "Ana Müller"},
        "questions": {
            "billing": noul("Is this about billing?"),
            "tone": {
                "type": "choice",
                "instructions": {"ask": "Tone?"},
                "criteria": {"calm": None, "angry": "An upset message"},
            },
            "urgency": {
                "type": "score",
                "instructions": "How urgent?",
                "criteria": ["Can wait", {"when": "today"}, "Now"],
            },
        },
    }
    response, scorer = post("/v1/systemone", body)
    assert response.status_code == 200, response.text
    assert len(scorer.calls) == 1 and scorer.calls[0][0] == "score_shared"
    state = body["state"]
    assert [shown(row) for row in rows(scorer)] == [
        ("q0", state, "Is this about billing?", [("o0", YES), ("o1", NO)]),
        ("q1", state, '{"ask": "Tone?"}', [("o0", "calm"), ("o1", "An upset message")]),
        (
            "q2",
            state,
            "How urgent?",
            [("o0", "Can wait"), ("o1", '{"when": "today"}'), ("o2", "Now")],
        ),
    ]
    assert list(response.json["answers"]) == ["billing", "tone", "urgency"]


# --- System One: refusals ----------------------------------------------------------------------


def choice(criteria, instructions="Tone?"):
    return {"type": "choice", "instructions": instructions, "criteria": criteria}


def score(criteria, instructions="How urgent?"):
    return {"type": "score", "instructions": instructions, "criteria": criteria}


SYSTEM_ONE_REFUSED = [
    (s1(noul(), assets=[{"type": "image"}]), f"assets: {IMAGE_REFUSED}"),
    (s1(noul(), assets=[]), f"assets: {IMAGE_REFUSED}"),
    (s1(noul(), assets={}), f"assets: {IMAGE_REFUSED}"),
    (s1(noul(), assets=""), f"assets: {IMAGE_REFUSED}"),
    (s1({"type": 5, "instructions": "q"}), "questions.a.type: must be a string, got number"),
    (s1({"type": ["noul"], "instructions": "q"}), "questions.a.type: must be a string, got array"),
    (
        s1({"type": None, "instructions": "q"}),
        "questions.a.type: missing; this server answers noul, choice and score",
    ),
    ({"questions": {"a": noul()}}, "state: missing"),
    (s1(noul(), model=5), "model: must be a model name string"),
    ({"state": "s", "questions": [noul()]}, "questions: must be an object {name: question}"),
    ({"state": "s"}, "questions: must be an object {name: question}"),
    ({"state": "s", "questions": {}}, "questions: must hold 1..400 questions, got 0"),
    (
        {"state": "s", "questions": {f"q{k}": noul() for k in range(401)}},
        "questions: must hold 1..400 questions, got 401",
    ),
    (s1("Is it?"), "questions.a: must be an object with a type"),
    (
        s1({"type": "box", "instructions": "Find the cat"}),
        "questions.a: box questions locate things in images, which needs a vision model; this server runs a text-only model",
    ),
    (
        s1({"instructions": "q"}),
        "questions.a.type: missing; this server answers noul, choice and score",
    ),
    (
        s1({"type": "rank", "instructions": "q"}),
        "questions.a.type: unknown question type 'rank'; this server answers noul, choice and score",
    ),
    (
        s1({"type": "NOUL", "instructions": "q"}),
        "questions.a.type: unknown question type 'NOUL'; this server answers noul, choice and score",
    ),
    (
        s1(noul(weight=1)),
        "questions.a: unknown keys ['weight']; allowed: criteria, instructions, type",
    ),
    (
        s1(noul(), choice({"x": None, "y": None}) | {"levels": []}),
        "questions.b: unknown keys ['levels']; allowed: criteria, instructions, type",
    ),
    (
        {"state": "s", "questions": {"urgency": noul(criteria={"true": "a", "maybe": "b"})}},
        "questions.urgency.criteria: unknown keys ['maybe']; allowed: false, true",
    ),
    (s1(noul(criteria="yes")), "questions.a.criteria: must be an object, got string"),
    (
        s1(noul(criteria={"true": 5})),
        "questions.a.criteria.true: must be a string, object or array, got number",
    ),
    (
        s1(noul(criteria={"false": True})),
        "questions.a.criteria.false: must be a string, object or array, got boolean",
    ),
    (
        s1(noul(criteria={"true": 0})),
        "questions.a.criteria.true: must be a string, object or array, got number",
    ),
    (
        s1(noul(criteria={"true": "T", "false": False})),
        "questions.a.criteria.false: must be a string, object or array, got boolean",
    ),
    (
        s1(choice({"calm": 0, "angry": None})),
        "questions.a.criteria.calm: must be a string, object or array, got number",
    ),
    (
        s1(choice({"calm": None, "angry": False})),
        "questions.a.criteria.angry: must be a string, object or array, got boolean",
    ),
    (
        s1({"type": "noul", "criteria": {"true": "", "false": None}}),
        "questions.a.instructions: missing; every question needs instructions",
    ),
    (s1(noul(None)), "questions.a.instructions: missing; every question needs instructions"),
    (s1(noul("")), "questions.a.instructions: must not be empty"),
    (s1(noul(" \n")), "questions.a.instructions: must not be empty"),
    (s1(noul(7)), "questions.a.instructions: must be a string, object or array, got number"),
    (s1(choice(["calm", "angry"])), "questions.a.criteria: must be an object {name: description}"),
    (
        s1({"type": "choice", "instructions": "q"}),
        "questions.a.criteria: must be an object {name: description}",
    ),
    (s1(choice({"calm": None})), "questions.a.criteria: needs at least 2 choices, got 1"),
    (
        s1(choice({"calm": None, "angry": 5})),
        "questions.a.criteria.angry: must be a string, object or array, got number",
    ),
    (s1(score({"0": "low"})), "questions.a.criteria: must be an array of levels, from score 0 up"),
    (
        s1({"type": "score", "instructions": "q"}),
        "questions.a.criteria: must be an array of levels, from score 0 up",
    ),
    (s1(score(["only"])), "questions.a.criteria: needs at least 2 levels, got 1"),
    (
        s1(score(["low", None])),
        "questions.a.criteria[1]: must be a string, object or array, got null",
    ),
]
SYSTEM_ONE_UNSUPPORTED = [
    (
        s1(choice({f"c{k}": None for k in range(256)})),
        OVER_LIMIT.format(where="questions.a.criteria", count=256, noun="choices", limit=255),
    ),
    (
        s1(noul(), score([f"l{k}" for k in range(256)])),
        OVER_LIMIT.format(where="questions.b.criteria", count=256, noun="levels", limit=255),
    ),
]


@pytest.mark.parametrize(("body", "message"), SYSTEM_ONE_REFUSED)
def test_a_malformed_system_one_request_is_a_422_naming_the_field(body, message):
    with pytest.raises(InvalidRequest) as raised:
        systemone.parse(body)
    assert (type(raised.value), str(raised.value)) == (InvalidRequest, message)
    response, scorer = post("/v1/systemone", body)
    assert response.status_code == 422
    assert response.json == refusal(body, message)
    assert scorer.calls == []


@pytest.mark.parametrize(("body", "message"), SYSTEM_ONE_UNSUPPORTED)
def test_over_255_options_is_option_count_unsupported_never_truncated(body, message):
    with pytest.raises(OptionCountUnsupported) as raised:
        systemone.parse(body)
    assert str(raised.value) == message
    response, scorer = post("/v1/systemone", body)
    assert response.status_code == 422
    assert response.json == refusal(body, message, "option_count_unsupported")
    assert scorer.calls == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            b'{"state": "s", "questions": {"a": {"type": "noul", "instructions": "q"}, "a": {"type": "noul", "instructions": "r"}}}',
            'body: the key "a" appears twice in one object',
        ),
        (
            b'{"state": "s", "questions": {"t": {"type": "choice", "instructions": "q", "criteria": {"calm": null, "angry": "x", "calm": "y"}}}}',
            'body: the key "calm" appears twice in one object',
        ),
        (
            b'{"state": {"k": 1, "k": 2}, "questions": {"a": {"type": "noul", "instructions": "q"}}}',
            'body: the key "k" appears twice in one object',
        ),
    ],
)
def test_duplicate_names_are_refused_never_silently_merged(body, message):
    client, scorer = api()
    response = client.simulate_post(
        "/v1/systemone", body=body, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json == refusal(body, message)
    assert scorer.calls == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (s1(choice({"  ": None, "b": None})), "questions.a.criteria.  : must be a nonempty string"),
        (
            s1(noul(), choice({"calm": "   ", "angry": None})),
            "questions.b.criteria.calm: must be a nonempty string",
        ),
        (s1(noul(criteria={"true": " "})), "questions.a.criteria.true: must be a nonempty string"),
        (
            s1(noul(criteria={"false": "\t"})),
            "questions.a.criteria.false: must be a nonempty string",
        ),
        (s1(score(["low", ""])), "questions.a.criteria[1]: must be a nonempty string"),
        (s1(noul(), timeout_s=0), "timeout_s: must be a number of seconds, 0 < timeout_s <= 86400"),
    ],
)
def test_a_service_refusal_is_renamed_onto_the_question(body, message):
    response, scorer = post("/v1/systemone", body)
    assert response.status_code == 422
    assert response.json == refusal(body, message)
    assert scorer.calls == []


@pytest.mark.parametrize(
    "content_type", ["multipart/form-data; boundary=x", "Multipart/Form-Data; boundary=x"]
)
def test_image_assets_sent_as_multipart_are_a_422(content_type):
    client, scorer = api()
    body = b'--x\r\nContent-Disposition: form-data; name="request"\r\n\r\n{}\r\n--x--\r\n'
    response = client.simulate_post(
        "/v1/systemone", body=body, headers={**AUTH, "Content-Type": content_type}
    )
    assert response.status_code == 422
    assert response.json == refusal(None, f"assets: {IMAGE_REFUSED}")
    assert scorer.calls == []


def test_a_multipart_body_in_an_unknown_coding_is_a_415_first():
    client, scorer = api()
    response = client.simulate_post(
        "/v1/systemone",
        body=b"--x--",
        headers={
            **AUTH,
            "Content-Type": "multipart/form-data; boundary=x",
            "Content-Encoding": "br",
        },
    )
    assert response.status_code == 415
    assert (
        response.json["error"]["message"]
        == "Content-Encoding: 'br' is not supported; send identity, gzip or zstd"
    )
    response = client.simulate_post(
        "/v1/systemone",
        body=b"--x--",
        headers={
            **AUTH,
            "Content-Type": "multipart/form-data; boundary=x",
            "Content-Encoding": "GZIP",
        },
    )
    assert response.status_code == 422  # a coding it decodes: the assets refusal
    assert scorer.calls == []


def test_a_multipart_body_is_still_bounded_by_the_limit():
    client, _ = api(max_body_bytes=100)
    response = client.simulate_post(
        "/v1/systemone",
        body=b"x" * 101,
        headers={**AUTH, "Content-Type": "multipart/form-data; boundary=x"},
    )
    assert response.status_code == 413
    assert response.json["error"]["message"] == "the body declares 101 bytes, over the limit of 100"


# --- Decisions: golden fixtures ----------------------------------------------------------------

ITEMS = [
    {"role": "system", "content": "Be brief."},
    {
        "type": "message",
        "role": "developer",
        "content": [{"type": "input_text", "text": "dev"}],
        "id": "m0",
    },
    {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit"}},
            {"type": "input_json", "data": {"k": "ü", "a": [1]}},
            {"type": "input_text", "text": ""},
        ],
        "phase": "x",
    },
    {"role": "user", "content": [{"type": "input_json", "data": [{"row": 1}, {"row": 2}]}]},
    {
        "role": "assistant",
        "content": [{"type": "output_text", "text": "ok"}, {"type": "refusal", "refusal": "no"}],
        "id": "m1",
        "status": "completed",
    },
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
    {
        "type": "function_call",
        "call_id": "c1",
        "name": "lookup",
        "arguments": '{"id": 7}',
        "id": "fc1",
        "status": "completed",
    },
    {
        "type": "function_call_output",
        "call_id": "c1",
        "output": "42",
        "id": "o1",
        "status": "completed",
    },
    {
        "type": "custom_tool_call",
        "call_id": "c2",
        "name": "grep",
        "input": "",
        "namespace": "tools",
    },
    {
        "type": "custom_tool_call_output",
        "call_id": "c2",
        "output": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
    },
    {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "", "namespace": 7},
    {
        "type": "function_call_output",
        "call_id": "c3",
        "output": [{"type": "input_text", "text": "only"}],
    },
    {"type": "function_call_output", "call_id": "c1", "output": "again"},  # a second output of c1
]
RENDERED = (
    '[{"role": "system", "content": "Be brief."}, '
    '{"role": "developer", "content": "dev"}, '
    '{"role": "user", "content": ["hi", {"input_json": {"k": "ü", "a": [1]}}, ""]}, '
    '{"role": "user", "content": {"input_json": [{"row": 1}, {"row": 2}]}}, '
    '{"role": "assistant", "content": ["ok", {"refusal": "no"}]}, '
    '{"role": "assistant", "content": {"refusal": "I can\'t."}}, '
    '{"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{\\"id\\": 7}"}, '
    '{"type": "function_call_output", "call_id": "c1", "output": "42"}, '
    '{"type": "custom_tool_call", "call_id": "c2", "name": "grep", "namespace": "tools", "input": ""}, '
    '{"type": "custom_tool_call_output", "call_id": "c2", "output": ["a", "b"]}, '
    '{"type": "function_call", "call_id": "c3", "name": "f", "arguments": ""}, '
    '{"type": "function_call_output", "call_id": "c3", "output": "only"}, '
    '{"type": "function_call_output", "call_id": "c1", "output": "again"}]'
)


def test_input_items_are_rendered_as_documented_ids_and_statuses_left_out():
    rendered = decisions.rendered_input(ITEMS)
    assert json.dumps(rendered, ensure_ascii=False) == RENDERED
    request = decisions.parse(od(dq(), input=ITEMS))
    assert json.dumps(request.state, ensure_ascii=False) == RENDERED


def test_a_string_input_is_the_state_as_it_is():
    assert decisions.rendered_input("  The door is open.\n") == "  The door is open.\n"
    assert decisions.parse(od(dq())).state == "The door is open."


def test_decisions_rows_reach_the_scorer_with_the_rendered_input():
    response, scorer = post("/v1/decisions", od(dq(), input=ITEMS))
    assert response.status_code == 200, response.text
    [row] = rows(scorer)
    assert json.dumps(row.state, ensure_ascii=False) == RENDERED
    assert shown(row)[2:] == ("Is it open?", [("o0", YES), ("o1", NO)])


def parsed_od(question, index=0):
    return decisions.parse(od(*([dq()] * index), question)).questions[index]


def test_a_predicate_is_the_yes_no_mapping():
    assert parsed_od(dq(name="open")) == decisions.Question(
        "open",
        "predicate",
        (),
        Mapped("questions[0]", "Is it open?", (YES, NO), (("instructions",), ("instructions",))),
    )
    assert parsed_od(dq(), 2).name is None
    assert parsed_od(dq(), 2).mapped.where == "questions[2]"


def test_choices_are_described_by_their_description_else_their_value_s_text():
    choices = [
        {"value": "a", "description": "Alpha"},
        {"value": "b"},
        {"value": True},
        {"value": False, "description": ""},
        {"value": "true", "description": None},
        {"value": "", "description": "Nothing"},
    ]
    assert parsed_od(dq("choice", "Which?", choices=choices, name="w")) == decisions.Question(
        "w",
        "choice",
        ("a", "b", True, False, "true", ""),
        Mapped(
            "questions[0]",
            "Which?",
            ("Alpha", "b", "true", "false", "true", "Nothing"),
            tuple(("choices", k) for k in range(6)),
        ),
    )


def test_score_levels_are_label_colon_description_or_the_label():
    levels = [
        {"label": "low", "description": "barely"},
        {"label": "mid"},
        {"label": "high", "description": ""},
        {"label": " top ", "description": None},
    ]
    assert parsed_od(dq("score", "How much?", levels=levels)) == decisions.Question(
        None,
        "score",
        ("low", "mid", "high", " top "),
        Mapped(
            "questions[0]",
            "How much?",
            ("low: barely", "mid", "high", " top "),
            tuple(("levels", k) for k in range(4)),
        ),
    )


@pytest.mark.parametrize(
    ("instructions", "text"),
    [
        ("Is it?", "Is it?"),
        ([{"type": "input_text", "text": "Only"}], "Only"),
        (
            [
                {"type": "input_text", "text": "Is"},
                {"type": "input_json", "data": [{"n": 1}, {"é": 2}]},
            ],
            'Is\n[{"n": 1}, {"é": 2}]',
        ),
        (
            [
                {
                    "type": "input_text",
                    "text": "A",
                    "prompt_cache_breakpoint": {"mode": "explicit"},
                },
                {"type": "input_text", "text": ""},
                {"type": "input_text", "text": "B"},
            ],
            "A\n\nB",
        ),
        ({"ask": "Open?"}, '{"ask": "Open?"}'),
    ],
)
def test_decision_instructions_are_a_string_or_parts_one_per_line(instructions, text):
    assert parsed_od(dq(instructions=instructions)).mapped.question == text


def test_instructions_parts_nested_too_deeply_are_refused_naming_them():
    deep: dict = {}
    for _ in range(100_000):
        deep = {"a": deep}
    question = dq(
        instructions=[{"type": "input_text", "text": "q"}, {"type": "input_json", "data": deep}]
    )
    with pytest.raises(InvalidRequest) as raised:
        decisions.parse(od(dq(), question))
    assert str(raised.value) == "questions[1].instructions: nested too deeply"


def test_the_decisions_request_keeps_model_cache_fields_and_timeout():
    body = od(
        dq(),
        model="gpt-x",
        prompt_cache_key="tenant-1",
        safety_identifier="user-9",
        prompt_cache_options={"mode": "explicit", "ttl": "30m"},
        timeout_s=3,
    )
    request = decisions.parse(body)
    assert (request.model, request.routing) == ("gpt-x", {"timeout_s": 3})
    for options in (None, {}, {"mode": "implicit"}, {"mode": None, "ttl": None}, {"ttl": "30m"}):
        assert decisions.parse(od(dq(), prompt_cache_options=options)).routing == {}
    assert decisions.parse(od(dq(), prompt_cache_key=None, safety_identifier=None)).model is None


# --- Decisions: refusals -----------------------------------------------------------------------

BAD_IMAGE = {"type": "input_image", "image_url": "https://example.com/cat.png"}
DECISIONS_REFUSED = [
    (od(dq(), model=["m"]), "model: must be a model name string"),
    (od(dq(), prompt_cache_key=5), "prompt_cache_key: must be a string"),
    (od(dq(), safety_identifier=[]), "safety_identifier: must be a string"),
    (
        od(dq(), prompt_cache_options="explicit"),
        "prompt_cache_options: must be an object, got string",
    ),
    (
        od(dq(), prompt_cache_options={"scope": 1}),
        "prompt_cache_options: unknown keys ['scope']; allowed: mode, ttl",
    ),
    (
        od(dq(), prompt_cache_options={"mode": "always"}),
        "prompt_cache_options.mode: must be implicit or explicit",
    ),
    (od(dq(), prompt_cache_options={"ttl": "1h"}), "prompt_cache_options.ttl: must be 30m"),
    ({"questions": [dq()]}, "input: missing"),
    ({"input": "s", "questions": {"a": dq()}}, "questions: must be an array of questions"),
    ({"input": "s"}, "questions: must be an array of questions"),
    (od(), "questions: must hold 1..400 questions, got 0"),
    (od(*[dq()] * 401), "questions: must hold 1..400 questions, got 401"),
    (od("Is it?"), "questions[0]: must be an object with a type"),
    (
        od(dq(), {"instructions": "q"}),
        "questions[1].type: missing; this server answers predicate, choice and score",
    ),
    (
        od(dq("noul")),
        "questions[0].type: unknown question type 'noul'; this server answers predicate, choice and score",
    ),
    (od(dq({"kind": "choice"})), "questions[0].type: must be a string, got object"),
    (od(dq(), dq(True)), "questions[1].type: must be a string, got boolean"),
    (od(dq(None)), "questions[0].type: missing; this server answers predicate, choice and score"),
    (
        od(dq(), input=[{"type": 5, "role": "user", "content": "x"}]),
        "input[0].type: must be a string, got number",
    ),
    (
        od(dq(), input=[{"type": None, "role": "user", "content": "x"}]),
        "input[0].type: must be a string, got null",
    ),
    (
        od(dq(), input=[{"type": ["message"], "role": "user", "content": "x"}]),
        "input[0].type: must be a string, got array",
    ),
    (
        od(dq(), input=[{"role": ["user"], "content": "x"}]),
        "input[0].role: must be one of user, developer, system, assistant, got ['user']",
    ),
    (
        od(dq(), input=[{"role": {"user": 1}, "content": "x"}]),
        "input[0].role: must be one of user, developer, system, assistant, got {'user': 1}",
    ),
    (
        od(dq(), input=[{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]),
        "input[0].content[0]: must be a part of type input_image, input_json, input_text, got ['input_text']",
    ),
    (
        od(dq(instructions=[{"type": {"t": 1}, "text": "x"}])),
        "questions[0].instructions[0]: must be a part of type input_image, input_json, input_text, got {'t': 1}",
    ),
    (
        od(dq(choices=CHOICES2)),
        "questions[0]: unknown keys ['choices']; allowed: instructions, name, type",
    ),
    (
        od(dq(), dq(), dq(), dq("choice", choices=CHOICES2, levels=[])),
        "questions[3]: unknown keys ['levels']; allowed: choices, instructions, name, type",
    ),
    (
        od(dq("score", levels=LEVELS2, criteria=[])),
        "questions[0]: unknown keys ['criteria']; allowed: instructions, levels, name, type",
    ),
    (od(dq(name=5)), "questions[0].name: must be a string"),
    (
        od({"type": "predicate"}),
        "questions[0].instructions: missing; every question needs instructions",
    ),
    (od(dq(instructions="")), "questions[0].instructions: must not be empty"),
    (od(dq(instructions=[])), "questions[0].instructions: must not be empty"),
    (
        od(dq(instructions=[{"type": "input_text", "text": " "}])),
        "questions[0].instructions: must not be empty",
    ),
    (
        od(dq(instructions=3)),
        "questions[0].instructions: must be a string, object or array, got number",
    ),
    (
        od(dq(instructions=[{"type": "input_text", "text": "q"}, BAD_IMAGE])),
        f"questions[0].instructions[1]: {IMAGE_REFUSED}",
    ),
    (
        od(dq(instructions=[{"type": "refusal", "refusal": "no"}])),
        "questions[0].instructions[0]: must be a part of type input_image, input_json, input_text, got 'refusal'",
    ),
    (
        od(dq(instructions=["plain"])),
        "questions[0].instructions[0]: must be a part of type input_image, input_json, input_text, got None",
    ),
    (od(dq("choice")), "questions[0].choices: must be an array of {value, description}"),
    (
        od(dq(), dq(), dq(), dq("choice", choices={"a": 1})),
        "questions[3].choices: must be an array of {value, description}",
    ),
    (
        od(dq("choice", choices=[{"value": "a"}])),
        "questions[0].choices: needs at least 2 choices, got 1",
    ),
    (
        od(dq("choice", choices=[{"value": "a"}, "b"])),
        "questions[0].choices[1]: must be an object, got string",
    ),
    (
        od(dq(), dq(), dq(), dq("choice", choices=[{"value": "a"}, {"value": "b", "label": "B"}])),
        "questions[3].choices[1]: unknown keys ['label']; allowed: description, value",
    ),
    (
        od(dq("choice", choices=[{"value": "a"}, {"value": 5}])),
        "questions[0].choices[1].value: must be a string or a boolean",
    ),
    (
        od(dq("choice", choices=[{"value": "a"}, {"description": "B"}])),
        "questions[0].choices[1].value: must be a string or a boolean",
    ),
    (
        od(dq("choice", choices=[{"value": "a"}, {"value": "b"}, {"value": "a"}])),
        "questions[0].choices[2].value: 'a' is already the value of questions[0].choices[0]",
    ),
    (
        od(dq("choice", choices=[{"value": True}, {"value": "true"}, {"value": True}])),
        "questions[0].choices[2].value: True is already the value of questions[0].choices[0]",
    ),
    (
        od(dq("choice", choices=[{"value": "a"}, {"value": "b", "description": 5}])),
        "questions[0].choices[1].description: must be a string",
    ),
    (
        od(dq("score")),
        "questions[0].levels: must be an array of {label, description}, lowest first",
    ),
    (
        od(dq("score", levels=[{"label": "x"}])),
        "questions[0].levels: needs at least 2 levels, got 1",
    ),
    (
        od(dq("score", levels=[{"label": "x"}, ["y"]])),
        "questions[0].levels[1]: must be an object, got array",
    ),
    (
        od(dq("score", levels=[{"label": "x", "value": 0}, {"label": "y"}])),
        "questions[0].levels[0]: unknown keys ['value']; allowed: description, label",
    ),
    (
        od(dq("score", levels=[{"label": "x"}, {"description": "y"}])),
        "questions[0].levels[1].label: must be a nonempty string",
    ),
    (
        od(dq("score", levels=[{"label": " "}, {"label": "y"}])),
        "questions[0].levels[0].label: must be a nonempty string",
    ),
    (
        od(dq("score", levels=[{"label": 0}, {"label": "y"}])),
        "questions[0].levels[0].label: must be a nonempty string",
    ),
    (
        od(dq("score", levels=[{"label": "x"}, {"label": "y", "description": 1}])),
        "questions[0].levels[1].description: must be a string",
    ),
    (od(dq(), input=5), "input: must be a string or an array of items"),
    (
        od(dq(), input={"role": "user", "content": "x"}),
        "input: must be a string or an array of items",
    ),
    (od(dq(), input=["hi"]), "input[0]: must be an object, got string"),
    (
        od(dq(), input=[{"type": "reasoning", "summary": []}]),
        "input[0].type: unknown input item type 'reasoning'",
    ),
    (
        od(dq(), input=[{"role": "user", "content": "x", "name": "bob"}]),
        "input[0]: unknown keys ['name']; allowed: content, id, phase, role, status, type",
    ),
    (
        od(dq(), input=[{"role": "tool", "content": "x"}]),
        "input[0].role: must be one of user, developer, system, assistant, got 'tool'",
    ),
    (
        od(dq(), input=[{"content": "x"}]),
        "input[0].role: must be one of user, developer, system, assistant, got None",
    ),
    (
        od(dq(), input=[{"role": "user"}]),
        "input[0].content: must be a string or a nonempty array of parts",
    ),
    (
        od(dq(), input=[{"role": "user", "content": []}]),
        "input[0].content: must be a string or a nonempty array of parts",
    ),
    (
        od(dq(), input=[{"role": "user", "content": {"type": "input_text", "text": "x"}}]),
        "input[0].content: must be a string or a nonempty array of parts",
    ),
    (
        od(dq(), input=[{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]),
        "input[0].content[0]: must be a part of type input_image, input_json, input_text, got 'output_text'",
    ),
    (
        od(dq(), input=[{"role": "developer", "content": [{"type": "input_json", "data": {}}]}]),
        "input[0].content[0]: must be a part of type input_text, got 'input_json'",
    ),
    (
        od(dq(), input=[{"role": "system", "content": [BAD_IMAGE]}]),
        "input[0].content[0]: must be a part of type input_text, got 'input_image'",
    ),
    (
        od(dq(), input=[{"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}]),
        "input[0].content[0]: must be a part of type output_text, refusal, got 'input_text'",
    ),
    (
        od(dq(), input=[{"role": "user", "content": ["x"]}]),
        "input[0].content[0]: must be a part of type input_image, input_json, input_text, got None",
    ),
    (
        od(
            dq(),
            input=[
                {"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "input_text", "text": "b"}, BAD_IMAGE]},
            ],
        ),
        f"input[1].content[1]: {IMAGE_REFUSED}",
    ),
    (
        od(
            dq(),
            input=[{"role": "user", "content": [{"type": "input_json", "data": {}, "schema": {}}]}],
        ),
        "input[0].content[0]: unknown keys ['schema']; allowed: data, type",
    ),
    (
        od(dq(), input=[{"role": "user", "content": [{"type": "input_json", "data": "x"}]}]),
        "input[0].content[0].data: must be an object or an array of objects",
    ),
    (
        od(dq(), input=[{"role": "user", "content": [{"type": "input_json"}]}]),
        "input[0].content[0].data: must be an object or an array of objects",
    ),
    (
        od(
            dq(),
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "x", "cache_control": {}}],
                }
            ],
        ),
        "input[0].content[0]: unknown keys ['cache_control']; allowed: prompt_cache_breakpoint, text, type",
    ),
    (
        od(
            dq(),
            input=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "input_text",
                            "text": "x",
                            "prompt_cache_breakpoint": {"mode": "implicit"},
                        }
                    ],
                }
            ],
        ),
        'input[0].content[0].prompt_cache_breakpoint: must be {"mode": "explicit"}',
    ),
    (
        od(
            dq(),
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "x", "prompt_cache_breakpoint": {}}],
                }
            ],
        ),
        'input[0].content[0].prompt_cache_breakpoint: must be {"mode": "explicit"}',
    ),
    (
        od(
            dq(),
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "x", "prompt_cache_breakpoint": "explicit"}
                    ],
                }
            ],
        ),
        'input[0].content[0].prompt_cache_breakpoint: must be {"mode": "explicit"}',
    ),
    (
        od(
            dq(),
            input=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "input_text",
                            "text": "x",
                            "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "1h"},
                        }
                    ],
                }
            ],
        ),
        'input[0].content[0].prompt_cache_breakpoint: must be {"mode": "explicit"}',
    ),
    (
        od(
            dq(
                instructions=[
                    {"type": "input_text", "text": "x", "prompt_cache_breakpoint": {"mode": "x"}}
                ]
            )
        ),
        'questions[0].instructions[0].prompt_cache_breakpoint: must be {"mode": "explicit"}',
    ),
    (
        od(dq(), input=[{"role": "user", "content": [{"type": "input_text"}]}]),
        "input[0].content[0].text: must be a string",
    ),
    (
        od(dq(), input=[{"role": "user", "content": [{"type": "input_text", "text": 5}]}]),
        "input[0].content[0].text: must be a string",
    ),
    (
        od(dq(), input=[{"role": "assistant", "content": [{"type": "refusal"}]}]),
        "input[0].content[0].refusal: must be a string",
    ),
    (
        od(dq(), input=[{"role": "assistant", "content": [{"type": "refusal", "text": "no"}]}]),
        "input[0].content[0]: unknown keys ['text']; allowed: refusal, type",
    ),
    (
        od(
            dq(),
            input=[
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "", "input": ""}
            ],
        ),
        "input[0]: unknown keys ['input']; allowed: arguments, call_id, id, name, namespace, status, type",
    ),
    (
        od(
            dq(),
            input=[
                {
                    "type": "custom_tool_call",
                    "call_id": "c",
                    "name": "f",
                    "input": "",
                    "arguments": "",
                }
            ],
        ),
        "input[0]: unknown keys ['arguments']; allowed: call_id, id, input, name, namespace, status, type",
    ),
    (
        od(dq(), input=[{"type": "function_call", "name": "f", "arguments": ""}]),
        "input[0].call_id: must be a nonempty string",
    ),
    (
        od(dq(), input=[{"type": "function_call", "call_id": " ", "name": "f", "arguments": ""}]),
        "input[0].call_id: must be a nonempty string",
    ),
    (
        od(dq(), input=[{"type": "function_call", "call_id": "c", "name": "", "arguments": ""}]),
        "input[0].name: must be a nonempty string",
    ),
    (
        od(dq(), input=[{"type": "function_call", "call_id": "c", "name": "f"}]),
        "input[0].arguments: must be a string",
    ),
    (
        od(dq(), input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]),
        "input[0].arguments: must be a string",
    ),
    (
        od(dq(), input=[{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": 1}]),
        "input[0].input: must be a string",
    ),
    (
        od(dq(), input=[{"type": "function_call_output", "call_id": "c9", "output": "x"}]),
        "input[0].call_id: 'c9' matches no earlier function_call item",
    ),
    (
        od(
            dq(),
            input=[
                {"type": "function_call_output", "call_id": "c1", "output": "x"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": ""},
            ],
        ),
        "input[0].call_id: 'c1' matches no earlier function_call item",
    ),
    (
        od(
            dq(),
            input=[
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": ""},
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "x"},
            ],
        ),
        "input[1].call_id: 'c1' matches no earlier custom_tool_call item",
    ),
    (
        od(
            dq(),
            input=[
                {"type": "custom_tool_call", "call_id": "c1", "name": "f", "input": ""},
                {"type": "function_call_output", "call_id": "c1", "output": "x"},
            ],
        ),
        "input[1].call_id: 'c1' matches no earlier function_call item",
    ),
    (
        od(dq(), input=[{"type": "function_call_output", "output": "x"}]),
        "input[0].call_id: must be a nonempty string",
    ),
    (
        od(
            dq(),
            input=[
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": ""},
                {"type": "function_call_output", "call_id": "c1", "output": "x", "name": "f"},
            ],
        ),
        "input[1]: unknown keys ['name']; allowed: call_id, id, output, status, type",
    ),
    (
        od(
            dq(),
            input=[
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": ""},
                {"type": "function_call_output", "call_id": "c1"},
            ],
        ),
        "input[1].output: must be a string or a nonempty array of parts",
    ),
    (
        od(
            dq(),
            input=[
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": ""},
                {"type": "function_call_output", "call_id": "c1", "output": [BAD_IMAGE]},
            ],
        ),
        f"input[1].output[0]: {IMAGE_REFUSED}",
    ),
    (
        od(
            dq(),
            input=[
                {"type": "custom_tool_call", "call_id": "c1", "name": "f", "input": ""},
                {
                    "type": "custom_tool_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_json", "data": {}}],
                },
            ],
        ),
        "input[1].output[0]: must be a part of type input_image, input_text, got 'input_json'",
    ),
]
DECISIONS_UNSUPPORTED = [
    (
        od(dq("choice", choices=[{"value": f"c{k}"} for k in range(256)])),
        OVER_LIMIT.format(where="questions[0].choices", count=256, noun="choices", limit=255),
    ),
    (
        od(dq(), dq("score", levels=[{"label": f"l{k}"} for k in range(256)])),
        OVER_LIMIT.format(where="questions[1].levels", count=256, noun="levels", limit=255),
    ),
]


@pytest.mark.parametrize(("body", "message"), DECISIONS_REFUSED)
def test_a_malformed_decisions_request_is_a_422_naming_the_field(body, message):
    with pytest.raises(InvalidRequest) as raised:
        decisions.parse(body)
    assert (type(raised.value), str(raised.value)) == (InvalidRequest, message)
    response, scorer = post("/v1/decisions", body)
    assert response.status_code == 422
    assert response.json == refusal(body, message)
    assert scorer.calls == []


@pytest.mark.parametrize(("body", "message"), DECISIONS_UNSUPPORTED)
def test_over_255_choices_or_levels_is_option_count_unsupported(body, message):
    with pytest.raises(OptionCountUnsupported) as raised:
        decisions.parse(body)
    assert str(raised.value) == message
    response, scorer = post("/v1/decisions", body)
    assert response.status_code == 422
    assert response.json == refusal(body, message, "option_count_unsupported")
    assert scorer.calls == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            od(dq("choice", choices=[{"value": "a"}, {"value": "b", "description": "  "}])),
            "questions[0].choices[1]: must be a nonempty string",
        ),
        (
            od(dq(), dq("choice", choices=[{"value": " "}, {"value": "b"}])),
            "questions[1].choices[0]: must be a nonempty string",
        ),
        (od(dq(), timeout_s=-1), "timeout_s: must be a number of seconds, 0 < timeout_s <= 86400"),
    ],
)
def test_a_service_refusal_of_a_decisions_request_names_its_own_fields(body, message):
    response, scorer = post("/v1/decisions", body)
    assert response.status_code == 422
    assert response.json == refusal(body, message)
    assert scorer.calls == []


# --- replies -----------------------------------------------------------------------------------


class FixedScorer(FakeScorer):
    """Each row's probabilities by its question (else uniform), as ints where asked."""

    def __init__(self, by_question, hits=(), stored=False, **kwargs):
        super().__init__(**kwargs)
        self.by_question, self.hits, self.stored = by_question, hits, stored

    def result(self, row):
        answer = super().result(row)
        if row.question in self.by_question:
            answer["probabilities"] = list(self.by_question[row.question])
        answer["cache_hit"] = row.id in self.hits
        return answer

    def timing(self, rows):
        cached = 6 if rows[0].id in self.hits else 0  # the whole state, as a hit reuses it
        return {**super().timing(rows), "prefix_stored": self.stored, "cached_tokens": cached}


FLOAT_FIELDS = re.compile(rb'"(?:noul|probability|confidence|score|temperature|\d+)": -?\d+[,}\]]')


def floats(reply: dict) -> list:
    """Every probability, confidence, score and noul of a reply's answers (the `semif` block
    aside: it passes the scorer's own values on)."""
    answers = reply["answers"]
    found = []
    for answer in answers.values() if isinstance(answers, dict) else answers:
        found += [
            answer[key] for key in ("noul", "probability", "confidence", "score") if key in answer
        ]
        listed = answer.get("probabilities", {})
        if isinstance(listed, dict):
            found += list(listed.values())
        else:
            found += [entry["probability"] for entry in listed]
    return found


def no_bare_integer(raw: bytes) -> None:
    """The raw reply writes each of those numbers with a decimal point or an exponent (json
    reads `1` as an int and `1.0` as a float, so the parsed type is the text's)."""
    assert FLOAT_FIELDS.search(raw) is None, FLOAT_FIELDS.search(raw)
    numbers = floats(json.loads(raw))
    assert numbers and all(type(number) is float for number in numbers), numbers


def s1_body():
    return {
        "state": "S",
        "questions": {
            "open": noul("Open?"),
            "tone": choice({"calm": None, "angry": "Upset", "mixed": None}, "Tone?"),
            "level": score(["low", "mid", "high"], "Level?"),
        },
    }


def test_system_one_reply_shapes_with_exact_arithmetic():
    scorer = FixedScorer(
        {"Open?": [0.75, 0.25], "Tone?": [0.25, 0.5, 0.25], "Level?": [0.125, 0.25, 0.625]}
    )
    response, _ = post("/v1/systemone", s1_body(), scorer)
    assert response.status_code == 200, response.text
    reply = response.json
    semif = {name: answer.pop("x_semif") for name, answer in reply["answers"].items()}
    assert reply == {
        "model": "default",
        "answers": {
            "open": {"type": "noul", "noul": 0.75},
            "tone": {
                "type": "choice",
                "choice": "angry",
                "confidence": 0.25,
                "probabilities": {"calm": 0.25, "angry": 0.5, "mixed": 0.25},
            },
            "level": {
                "type": "score",
                "score": 0.25 + 1.25,
                "confidence": (3 * 0.625 - 1) / 2,
                "legend": {"0": "low", "1": "mid", "2": "high"},
                "probabilities": {"0": 0.125, "1": 0.25, "2": 0.625},
            },
        },
        "usage": {"input_tokens": 6 + 3 * 4, "output_tokens": 0},
    }
    assert "confidence_formula" not in semif["open"]
    assert semif["tone"]["confidence_formula"] == "normalized-peak-v1"
    assert semif["level"]["probabilities"] == [0.125, 0.25, 0.625]
    assert set(semif["open"]) == {
        "method",
        "option_logits",
        "probabilities",
        "prompt_sha256",
        "prompt_version",
        "input_tokens",
        "temperature",
        "probability_status",
        "cache_hit",
        "prefix_sha256",
        "model",
    }
    assert semif["open"]["temperature"] == 1.0
    assert semif["open"]["model"]["source"] == "fake"


def test_decisions_reply_shapes_with_exact_arithmetic():
    scorer = FixedScorer(
        {"Open?": [0.75, 0.25], "Which?": [0.25, 0.125, 0.625], "Level?": [0.5, 0.5]}
    )
    body = od(
        dq(instructions="Open?", name="open"),
        dq("choice", "Which?", choices=[{"value": "true"}, {"value": True}, {"value": False}]),
        dq(
            "score",
            "Level?",
            levels=[{"label": "low"}, {"label": "high", "description": "a lot"}],
            name="lvl",
        ),
    )
    response, _ = post("/v1/decisions", body, scorer)
    assert response.status_code == 200, response.text
    reply = response.json
    semif = [answer.pop("x_semif") for answer in reply["answers"]]
    assert reply == {
        "object": "decision",
        "model": "default",
        "answers": [
            {"type": "predicate", "name": "open", "probability": 0.75},
            {
                "type": "choice",
                "name": None,
                "choice": False,
                "confidence": (3 * 0.625 - 1) / 2,
                "probabilities": [
                    {"value": "true", "probability": 0.25},
                    {"value": True, "probability": 0.125},
                    {"value": False, "probability": 0.625},
                ],
            },
            {
                "type": "score",
                "name": "lvl",
                "score": 0.5,
                "confidence": 0.0,
                "probabilities": [
                    {"label": "low", "value": 0, "probability": 0.5},
                    {"label": "high", "value": 1, "probability": 0.5},
                ],
            },
        ],
        "usage": {
            "input_tokens": 18,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 18,
        },
    }
    assert "confidence_formula" not in semif[0]
    assert [s.get("confidence_formula") for s in semif[1:]] == ["normalized-peak-v1"] * 2
    raw = response.content
    assert b'{"value": "true", "probability": 0.25}, {"value": true, "probability": 0.125}' in raw


def test_string_true_and_boolean_true_are_different_answers():
    scorer = FixedScorer({"Which?": [0.25, 0.75]})
    body = od(dq("choice", "Which?", choices=[{"value": True}, {"value": "true"}]))
    response, _ = post("/v1/decisions", body, scorer)
    answer = response.json["answers"][0]
    assert answer["choice"] == "true" and type(answer["choice"]) is str
    scorer = FixedScorer({"Which?": [0.75, 0.25]})
    response, _ = post("/v1/decisions", body, scorer)
    answer = response.json["answers"][0]
    assert answer["choice"] is True


@pytest.mark.parametrize("as_ints", [False, True])
def test_certain_answers_are_still_written_as_floats(as_ints):
    one, zero = (1, 0) if as_ints else (1.0, 0.0)
    scorer = FixedScorer(
        {
            "Open?": [one, zero],
            "Tone?": [zero, one, zero],
            "Level?": [zero, zero, one],
            "Which?": [one, zero],
            "How?": [zero, one],
        }
    )
    response, _ = post("/v1/systemone", s1_body(), scorer)
    raw = response.content
    assert b'"noul": 1.0' in raw and b'"confidence": 1.0' in raw and b'"score": 2.0' in raw
    assert b'"probabilities": {"calm": 0.0, "angry": 1.0, "mixed": 0.0}' in raw
    assert b'"probabilities": {"0": 0.0, "1": 0.0, "2": 1.0}' in raw
    no_bare_integer(raw)
    body = od(
        dq(instructions="Open?"),
        dq("choice", "Which?", choices=[{"value": "a"}, {"value": "b"}]),
        dq("score", "How?", levels=[{"label": "lo"}, {"label": "hi"}]),
    )
    response, _ = post("/v1/decisions", body, FixedScorer(scorer.by_question))
    raw = response.content
    assert b'"probability": 1.0' in raw and b'"score": 1.0' in raw and b'"confidence": 1.0' in raw
    assert b'{"label": "lo", "value": 0, "probability": 0.0}' in raw  # the level's value: an int
    no_bare_integer(raw)


def test_a_saturated_softmax_is_written_as_floats():
    scorer = FakeScorer(base={YES: 1000.0, "angry": 1000.0, "high": 1000.0})
    response, _ = post("/v1/systemone", s1_body(), scorer)
    raw = response.content
    assert response.json["answers"]["open"]["noul"] == 1.0
    assert response.json["answers"]["open"]["x_semif"]["probabilities"] == [1.0, 0.0]
    assert b'"noul": 1.0,' in raw and b'"score": 2.0,' in raw
    no_bare_integer(raw)


def test_no_bare_integer_catches_what_it_must():
    for bad in (
        b'{"answers": {"a": {"noul": 1}}}',
        b'{"answers": {"a": {"confidence": 0.5, "probabilities": {"x": 1, "y": 0.0}}}}',
        b'{"answers": {"a": {"probabilities": {"0": 1.0, "1": 0}}}}',
        b'{"answers": [{"probabilities": [{"value": 0, "probability": 1}]}]}',
        b'{"answers": [{"score": 2}]}',
    ):
        with pytest.raises(AssertionError):
            no_bare_integer(bad)
    no_bare_integer(
        b'{"answers": [{"probability": 1e-22, "probabilities": [{"value": 0, "probability": 1.0}]}]}'
    )


def test_usage_counts_the_state_once_and_the_cache_from_the_first_result():
    body = od(dq(instructions="A?"), dq(instructions="B?"))
    response, _ = post("/v1/decisions", body, FixedScorer({}, hits=("q0",), stored=True))
    assert response.json["usage"] == {
        "input_tokens": 14,
        "input_tokens_details": {"cached_tokens": 6, "cache_write_tokens": 6},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 14,
    }
    assert [a["x_semif"]["cache_hit"] for a in response.json["answers"]] == [True, False]
    response, _ = post("/v1/decisions", body, FixedScorer({}, hits=("q1",)))
    assert response.json["usage"]["input_tokens_details"] == {
        "cached_tokens": 0,
        "cache_write_tokens": 0,
    }
    response, _ = post("/v1/systemone", s1_body(), FixedScorer({}, hits=("q0",), stored=True))
    assert response.json["usage"] == {"input_tokens": 18, "output_tokens": 0}


def test_400_questions_are_split_into_calls_of_max_decisions_answered_in_order():
    questions = [dq(instructions=f"q{k}?", name=f"n{k}") for k in range(400)]
    scorer = FixedScorer({f"q{k}?": [k / 512, 1 - k / 512] for k in range(400)})
    response, _ = post("/v1/decisions", od(*questions), scorer, max_decisions=64)
    assert response.status_code == 200, response.text
    assert [len(call) for _, call in scorer.calls] == [64] * 6 + [16]
    assert [row.id for row in rows(scorer)] == [f"q{k}" for k in range(400)]
    answers = response.json["answers"]
    assert [(a["name"], a["probability"]) for a in answers] == [
        (f"n{k}", k / 512) for k in range(400)
    ]
    assert response.json["usage"]["input_tokens"] == 6 + 4 * 400
    questions = {f"n{k}": noul(f"q{k}?") for k in range(400)}
    response, scorer = post(
        "/v1/systemone", {"state": "S", "questions": questions}, scorer, max_decisions=64
    )
    assert [len(call) for _, call in scorer.calls][-7:] == [64] * 6 + [16]
    assert [(n, a["noul"]) for n, a in response.json["answers"].items()] == [
        (f"n{k}", k / 512) for k in range(400)
    ]


def test_a_blank_description_in_a_later_call_is_refused_before_any_call():
    questions = [dq(instructions=f"q{k}?") for k in range(5)]
    questions[3] = dq("choice", "q3?", choices=[{"value": "a"}, {"value": "b", "description": " "}])
    response, scorer = post("/v1/decisions", od(*questions), max_decisions=2)
    assert response.status_code == 422
    assert response.json["error"]["message"] == "questions[3].choices[1]: must be a nonempty string"
    assert response.json["error"]["param"] == "questions[3].choices[1]"
    assert scorer.calls == []  # refused whole, before its first call was scored


def test_a_reply_needs_one_result_per_question_and_one_probability_per_option():
    request = systemone.parse({"state": "S", "questions": {"x": noul(), "y": noul()}})
    results = [FakeScorer().result(systemone_row()) for _ in range(2)]
    with pytest.raises(ValueError):
        systemone.reply(request, Scored(results[:1], 1, 0, 0), "m")
    assert list(systemone.reply(request, Scored(results, 1, 0, 0), "m")["answers"]) == ["x", "y"]
    request = decisions.parse(od(dq(), dq()))
    with pytest.raises(ValueError):
        decisions.reply(request, Scored(results[:1], 1, 0, 0), "m")
    three = {**results[0], "probabilities": [0.5, 0.25, 0.25]}
    for question in (
        choice({"calm": None, "angry": None}),
        score(["lo", "hi"]),
    ):
        request = systemone.parse({"state": "S", "questions": {"x": question}})
        with pytest.raises(ValueError):
            systemone.reply(request, Scored([three], 1, 0, 0), "m")
    for question in (dq("choice", choices=CHOICES2), dq("score", levels=LEVELS2)):
        with pytest.raises(ValueError):
            decisions.reply(decisions.parse(od(question)), Scored([three], 1, 0, 0), "m")


def test_replies_from_the_translators_directly():
    request = systemone.parse({"state": "S", "questions": {"x": noul()}})
    fake = {**FakeScorer().result(systemone_row()), "probabilities": [1, 0]}
    assert systemone.reply(request, Scored([fake], 9, 3, 2), "real") == {
        "model": "real",
        "answers": {
            "x": {
                "type": "noul",
                "noul": 1.0,
                "x_semif": mapping.readout(fake, with_confidence=False),
            }
        },
        "usage": {"input_tokens": 9, "output_tokens": 0},
    }
    assert (
        type(systemone.reply(request, Scored([fake], 9, 3, 2), "real")["answers"]["x"]["noul"])
        is float
    )
    request = decisions.parse(od(dq(name="x")))
    assert decisions.reply(request, Scored([fake], 9, 3, 2), "real")["usage"] == {
        "input_tokens": 9,
        "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 2},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 9,
    }
    answer = decisions.reply(request, Scored([fake], 9, 3, 2), "real")["answers"][0]
    assert answer == {
        "type": "predicate",
        "name": "x",
        "probability": 1.0,
        "x_semif": mapping.readout(fake, with_confidence=False),
    }
    assert type(answer["probability"]) is float


# --- the routes' HTTP surface: errors, headers --------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (408, "timeout_error"),
        (413, "invalid_request_error"),
        (415, "invalid_request_error"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (499, "invalid_request_error"),
        (500, "server_error"),
        (503, "server_error"),
    ],
)
def test_openai_error_types_by_status(status, kind):
    assert openai_fields(status, "no field here", ScoringFailed("x")) == {
        "type": kind,
        "param": None,
    }


@pytest.mark.parametrize(
    ("error", "param"),
    [
        (
            InvalidRequest("questions[3].choices[1].value: must be a string"),
            "questions[3].choices[1].value",
        ),
        (
            OptionCountUnsupported("questions.a.criteria: 17 choices, over the 16"),
            "questions.a.criteria",
        ),
        (InvalidRequest("input: missing"), "input"),
        (InvalidRequest("body: unknown keys ['x']; allowed: a"), None),
        (InvalidRequest('body: the key "a" appears twice in one object'), None),
        (InvalidRequest("no field is named"), None),
        (InvalidRequest(" spaced: first"), None),
        (InvalidRequest(": empty"), None),
        (InvalidRequest("questions.\ud800: bad"), "questions.\\ud800"),
        (ModelNotFound("model 'x': not registered"), None),
        (RequestTimeout("body: too slow"), None),
    ],
)
def test_param_is_the_field_an_invalid_request_names_first(error, param):
    assert openai_fields(422, str(error), error)["param"] == param


ODD_NAMES = ["a: b", "a:b", "a.b", "a[0]", 'say "hi"', "it's", "x: y.z[1]"]


@pytest.mark.parametrize("name", ODD_NAMES)
def test_a_question_name_holding_colons_dots_brackets_or_quotes_is_one_segment(name):
    """Issue 43, finding 5: `param` was parsed back out of the message, so a question named
    "a: b" gave `questions.a`, "a:b" gave null. Now it is built from the segments."""
    body = {"state": "s", "questions": {name: {"type": "noul", "instructions": ""}}}
    response, _ = post("/v1/systemone", body)
    assert response.status_code == 422
    error = response.json["error"]
    assert error["param"] == f"questions.{name}.instructions"
    assert error["message"] == f"questions.{name}.instructions: must not be empty"
    assert response.json["detail"] == [
        {
            "loc": ["body", "questions", name, "instructions"],
            "msg": "must not be empty",
            "type": "invalid_request",
        }
    ]


@settings(max_examples=60, deadline=None)
@given(name=st.text(max_size=12))
def test_any_question_name_round_trips_into_param_and_loc(name):
    body = {"state": "s", "questions": {name: {"type": "noul", "instructions": ""}}}
    response, _ = post("/v1/systemone", body)
    assert response.status_code == 422
    assert response.json["error"]["param"] == f"questions.{name}.instructions"
    assert response.json["detail"][0]["loc"] == ["body", "questions", name, "instructions"]


def test_a_segment_that_utf8_cannot_encode_is_escaped_in_param_and_loc():
    # The parsers refuse a key holding a lone surrogate before any field is named by it; a
    # refusal naming one anyway still renders (`envelope` encodes every reply).
    error = refused(Field("questions", "\ud800", "instructions"), "must not be empty")
    assert openai_fields(422, str(error), error)["param"] == "questions.\\ud800.instructions"
    assert hosted_detail(422, "invalid_request", str(error), error) == [
        {
            "loc": ["body", "questions", "\\ud800", "instructions"],
            "msg": "must not be empty",
            "type": "invalid_request",
        }
    ]


@pytest.mark.parametrize("label", ODD_NAMES)
def test_a_choice_label_holding_colons_dots_brackets_or_quotes_is_one_segment(label):
    # Refused where the translator reads it (a description of another type) and where the
    # service refuses the row it became (a blank description), named by the label as sent.
    for description, problem in [(5, "must be a string, object or array, got number")]:
        body = s1(choice({label: description, "other": "Other"}))
        response, _ = post("/v1/systemone", body)
        assert response.json["error"]["param"] == f"questions.a.criteria.{label}"
        assert response.json["detail"][0]["loc"] == ["body", "questions", "a", "criteria", label]
        assert response.json["detail"][0]["msg"] == problem
    blank = s1(choice({label: " ", "other": "Other"}))
    response, _ = post("/v1/systemone", blank)
    assert response.json["error"]["param"] == f"questions.a.criteria.{label}"
    assert response.json["detail"][0]["loc"] == ["body", "questions", "a", "criteria", label]
    assert response.json["detail"][0]["msg"] == "must be a nonempty string"


def test_the_two_routes_errors_carry_type_and_param():
    response, _ = post("/v1/systemone", s1(noul("")))
    assert response.json == {
        "error": {
            "code": "invalid_request",
            "message": "questions.a.instructions: must not be empty",
            "type": "invalid_request_error",
            "param": "questions.a.instructions",
        },
        "detail": [
            {
                "loc": ["body", "questions", "a", "instructions"],
                "msg": "must not be empty",
                "type": "invalid_request",
            }
        ],
    }
    client, _ = api()
    for path in ("/v1/systemone", "/v1/decisions"):
        response = client.simulate_post(path, json={}, headers={"Authorization": "Bearer wrong"})
        assert response.status_code == 401
        assert response.json == {
            "error": {
                "code": "unauthorized",
                "message": "missing or wrong bearer token",
                "type": "authentication_error",
                "param": None,
            },
            "detail": {
                "error_type": "authentication_error",
                "message": "missing or wrong bearer token",
            },
        }
        response = client.simulate_get(path, headers=AUTH)
        assert response.json == {
            "error": {
                "code": "method_not_allowed",
                "message": f"GET is not allowed on {path}",
                "type": "invalid_request_error",
                "param": None,
            },
            "detail": {
                "error_type": "invalid_request_error",
                "message": f"GET is not allowed on {path}",
            },
        }


@pytest.mark.parametrize(
    ("error", "status", "code", "kind"),
    [
        (RuntimeError("kernel exploded"), 500, "scoring_failed", "server_error"),
        (OutOfMemory("CUDA out of memory"), 503, "out_of_memory", "server_error"),
    ],
)
def test_a_server_failure_on_the_two_routes_is_a_server_error(error, status, code, kind):
    for path, body in (("/v1/systemone", s1(noul())), ("/v1/decisions", od(dq()))):
        response, _ = post(path, body, FakeScorer(error=error))
        assert response.status_code == status
        assert set(response.json["error"]) == {"code", "message", "type", "param"}
        assert (response.json["error"]["code"], response.json["error"]["type"]) == (code, kind)
        assert response.json["error"]["param"] is None


def test_other_routes_keep_exactly_code_and_message():
    client, _ = api(FakeScorer(error=OutOfMemory("CUDA out of memory")))
    replies = [
        client.simulate_post("/decide", json={"id": "x"}, headers=AUTH),
        client.simulate_post(
            "/decide/shared", json={"state": "s", "decisions": [decision("a")]}, headers=AUTH
        ),
        client.simulate_post("/decide", json={}, headers={"Authorization": "Bearer wrong"}),
        client.simulate_get("/v1/nope", headers=AUTH),
        client.simulate_get("/v1/systemone/x", headers=AUTH),
        client.simulate_put("/v1/models/m", json={}, headers=AUTH),
        client.simulate_post("/health"),
    ]
    assert [r.status_code for r in replies] == [422, 503, 401, 404, 404, 403, 405]
    for response in replies:
        assert set(response.json) == {"error"}
        assert set(response.json["error"]) == {"code", "message"}, response.json


@pytest.mark.parametrize(
    ("error", "seconds"),
    [
        (ServerBusy("full"), "1"),
        (QueueTimedOut("waited"), "1"),
        (OutOfMemory("oom"), "1"),
        (InsufficientMemory("no room"), "5"),
        (ModelLoadFailed("failed"), "5"),
    ],
)
def test_retry_after_is_sent_in_seconds_and_in_milliseconds(error, seconds):
    _, _, _, headers = classify(error)
    assert headers == {"Retry-After": seconds, "retry-after-ms": str(int(seconds) * 1000)}


def test_a_refused_unauthorised_request_gets_no_retry_header():
    assert classify(Unauthorized("x"))[3] == {"WWW-Authenticate": "Bearer"}


def test_429_and_503_replies_carry_retry_after_ms():
    limit = InFlightLimit(1)
    limit.acquire()  # the one request in progress
    app, _ = fake_app(FakeScorer(), in_flight=limit)
    client = testing.TestClient(app)
    for path, body in (
        ("/v1/systemone", s1(noul())),
        ("/v1/decisions", od(dq())),
        ("/decide/shared", {}),
    ):
        response = client.simulate_post(path, json=body, headers=AUTH)
        assert response.status_code == 429
        assert (response.headers["retry-after"], response.headers["retry-after-ms"]) == (
            "1",
            "1000",
        )
    assert response.json == {
        "error": {"code": "busy", "message": "1 requests are already in progress; retry later"}
    }
    response, _ = post(
        "/v1/decisions", od(dq()), FakeScorer(error=OutOfMemory("CUDA out of memory"))
    )
    assert response.status_code == 503
    assert (response.headers["retry-after"], response.headers["retry-after-ms"]) == ("1", "1000")
    assert response.json["error"]["type"] == "server_error"


def test_every_reply_carries_x_typesafe_request_id():
    client, _ = api()
    replies = [
        client.simulate_post("/v1/systemone", json=s1(noul()), headers=AUTH),
        client.simulate_post("/v1/decisions", json=od(dq()), headers=AUTH),
        client.simulate_post("/v1/systemone", json={}, headers={"Authorization": "Bearer wrong"}),
        client.simulate_get("/no/such/route", headers=AUTH),
        client.simulate_get("/health"),
    ]
    assert [r.status_code for r in replies] == [200, 200, 401, 404, 200]
    ids = set()
    for response in replies:
        assert re.fullmatch("[0-9a-f]{32}", response.headers["x-typesafe-request-id"])
        assert response.headers["x-typesafe-request-id"] == response.headers["x-request-id"]
        ids.add(response.headers["x-request-id"])
    assert len(ids) == len(replies)
    response = client.simulate_post(
        "/v1/systemone", json=s1(noul()), headers={**AUTH, "X-Request-Id": "caller-7"}
    )
    assert (response.headers["x-request-id"], response.headers["x-typesafe-request-id"]) == (
        "caller-7",
        "caller-7",
    )


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/systemone", s1(noul(), noul())), ("/v1/decisions", od(dq(), dq()))]
)
def test_a_request_whose_client_left_is_dropped_before_scoring(path, body):
    client, scorer = api()
    checks = []

    def gone():
        checks.append(len(scorer.calls))
        return True

    response = client.simulate_post(path, json=body, headers=AUTH, extras={CLIENT_GONE_KEY: gone})
    assert response.status_code == 499
    assert response.json["error"]["code"] == "client_closed_request"
    assert scorer.calls == [] and checks == [0]
    response = client.simulate_post(
        path, json=body, headers=AUTH, extras={CLIENT_GONE_KEY: lambda: False}
    )
    assert response.status_code == 200 and len(scorer.calls) == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/systemone", s1(noul(), noul(), noul())), ("/v1/decisions", od(dq(), dq(), dq()))],
)
def test_the_access_log_counts_the_questions_as_decisions(path, body, caplog):
    client, _ = api()
    with caplog.at_level(logging.INFO, logger="semif_serve.access"):
        response = client.simulate_post(path, json=body, headers={**AUTH, "X-Request-Id": "log-1"})
    assert response.status_code == 200
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == "semif_serve.access"]
    assert (line["request_id"], line["route"], line["status"], line["decisions"]) == (
        "log-1",
        path,
        200,
        3,
    )


def test_the_reply_carries_the_state_key_of_the_rendered_state():
    from semif_serve.state_key import state_key

    response, _ = post("/v1/decisions", od(dq(), input=ITEMS))
    assert response.headers["x-semif-state-key"] == state_key(json.loads(RENDERED))
    response, _ = post("/v1/systemone", s1(noul()))
    assert response.headers["x-semif-state-key"] == state_key({"door": "open"})
