"""The official OpenAI SDK (openai 3.51.0, unmodified) against POST /v1/decisions and GET
/v1/models of a real gunicorn over the fake scorer (tests/serve_steered.py fake): every question type, in
order with its name, choice values typed (the string "true" and the boolean true kept apart),
usage and the model that answered, every error status as the SDK's typed exception, retries after
the server's retry-after, and the body's codings (raw gzip and zstd, an unknown coding, a zstd
bomb).

The fake scorer's logits are all 0, so every option is equally likely: a predicate is 0.5, every
confidence 0.0, a score the mean level. Its shared calls count the state's 6 tokens once and 4 of
each question's own."""

import json
import logging
import re

import openai
import pytest
from fakes import TOKEN
from openai.types.decision import (
    AnswerAnswerResourceChoice,
    AnswerAnswerResourcePredicate,
    AnswerAnswerResourceScore,
    Decision,
)
from sdk_helpers import (
    BODY_LIMIT,
    Holder,
    InThread,
    MiB,
    access_statuses,
    encoded,
    gated_servers,
    peak_growth,
    post_raw,
    retry_headers_agree,
    wait_for_status,
    zstd_bomb,
)

pytestmark = pytest.mark.server

ROUTE = "/v1/decisions"
TICKET = "I was charged twice for one order. Ana Müller"
QUESTIONS = [
    {"type": "predicate", "name": "billing", "instructions": "Is this about billing?"},
    {
        "type": "choice",
        "name": "flag",
        "instructions": "Which flag is set?",
        "choices": [
            {"value": "true"},
            {"value": True},
            {"value": "false", "description": "The text false"},
            {"value": False},
        ],
    },
    {
        "type": "choice",
        "name": "boolean-first",
        "instructions": [
            {"type": "input_text", "text": "Which one?"},
            {"type": "input_json", "data": {"hint": "typed values"}},
        ],
        "choices": [{"value": True}, {"value": "true"}],
    },
    {
        "type": "score",
        "name": "urgency",
        "instructions": "How urgent is it?",
        "levels": [{"label": "low"}, {"label": "mid", "description": "Today"}, {"label": "high"}],
    },
    {"type": "predicate", "instructions": "Is it polite?"},  # no name: answered with name null
]
INPUTS = {
    "text": TICKET,
    "messages": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Classify the ticket."}]},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": TICKET},
                {"type": "input_json", "data": {"order": 17}},
            ],
        },
        {"role": "assistant", "content": "Noted."},
    ],
    "tools": [
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"order": 17}'},
        {"type": "function_call_output", "call_id": "c1", "output": "charged twice"},
    ],
}
USAGE = {
    "input_tokens": 6 + 4 * len(QUESTIONS),
    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
    "output_tokens": 0,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 6 + 4 * len(QUESTIONS),
}
ONE = [{"type": "predicate", "name": "fine", "instructions": "Is it fine?"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """`busy`: a request waits at most 0.2 s for a held model, then 503. `full`: one POST
    admitted at a time, a second one is a 429."""
    variants = {"busy": {"SEMIF_QUEUE_TIMEOUT_S": "0.2"}, "full": {"SEMIF_MAX_QUEUE": "1"}}
    with gated_servers(tmp_path_factory.mktemp("decisions"), **variants) as gated:
        yield gated


@pytest.fixture(scope="module")
def server(servers):
    return servers["busy"]


@pytest.fixture(scope="module")
def full_server(servers):
    return servers["full"]


def client(server, api_key=TOKEN, **options) -> openai.OpenAI:
    return openai.OpenAI(api_key=api_key, base_url=f"http://127.0.0.1:{server.port}/v1", **options)


def decide(gated, questions=QUESTIONS, input=TICKET, model="gpt-6-luna", **options):
    """One Decisions call through the SDK, with its raw HTTP response: (parsed, raw)."""
    client_options = {key: options.pop(key) for key in ("max_retries", "api_key") if key in options}
    with client(gated[0], **client_options) as sdk:
        raw = sdk.decisions.with_raw_response.create(
            model=model, input=input, questions=questions, **options
        )
        return raw.parse(), raw


# -- answers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("input", list(INPUTS.values()), ids=list(INPUTS))
def test_every_question_type_is_answered_in_order_with_the_uniform_fakes_values(server, input):
    decision, raw = decide(server, input=input)
    assert isinstance(decision, Decision)
    Decision.model_validate_json(raw.content, strict=True)
    assert [answer.name for answer in decision.answers] == [
        "billing", "flag", "boolean-first", "urgency", None,
    ]  # fmt: skip
    billing, flag, boolean_first, urgency, polite = decision.answers
    for predicate in (billing, polite):
        assert isinstance(predicate, AnswerAnswerResourcePredicate)
        assert predicate.probability == 0.5
    assert isinstance(flag, AnswerAnswerResourceChoice)
    assert flag.confidence == 0.0
    assert [(p.value, type(p.value), p.probability) for p in flag.probabilities] == [
        ("true", str, 0.25), (True, bool, 0.25), ("false", str, 0.25), (False, bool, 0.25),
    ]  # fmt: skip
    # A tie: the first most probable, typed as it was sent.
    assert (flag.choice, type(flag.choice)) == ("true", str)
    assert (boolean_first.choice, type(boolean_first.choice)) == (True, bool)
    assert [type(p.value) for p in boolean_first.probabilities] == [bool, str]
    assert isinstance(urgency, AnswerAnswerResourceScore)
    assert urgency.score == pytest.approx(1.0) and urgency.confidence == 0.0
    assert [(p.label, p.value) for p in urgency.probabilities] == [
        ("low", 0),
        ("mid", 1),
        ("high", 2),
    ]
    assert [p.probability for p in urgency.probabilities] == [pytest.approx(1 / 3)] * 3
    assert decision.usage.model_dump() == USAGE
    assert decision.model == "gpt-6-luna"  # the name sent, echoed


def test_typed_values_are_typed_on_the_wire_and_every_float_is_a_json_float(server):
    _, raw = decide(server)
    answers = json.loads(raw.content)["answers"]
    assert [choice["value"] for choice in answers[1]["probabilities"]] == [
        "true",
        True,
        "false",
        False,
    ]
    assert answers[1]["choice"] == "true" and answers[2]["choice"] is True
    floats = [answers[0]["probability"], answers[1]["confidence"], answers[3]["score"]]
    floats += [p["probability"] for answer in answers[1:4] for p in answer["probabilities"]]
    assert all(type(value) is float for value in floats), floats  # 0.0, never 0
    assert answers[3]["x_semif"]["confidence_formula"] == "normalized-peak-v1"


@pytest.mark.parametrize("questions", [1, 3, 9, 70])  # 70: two shared calls (64 each at most)
def test_usage_counts_the_state_once_and_each_questions_own_tokens(server, questions):
    many = [
        {"type": "predicate", "name": f"q{n}", "instructions": f"Is it case {n}?"}
        for n in range(questions)
    ]
    decision, _ = decide(server, many)
    assert [answer.name for answer in decision.answers] == [f"q{n}" for n in range(questions)]
    usage = decision.usage
    assert usage.input_tokens == usage.total_tokens == 6 + 4 * questions
    assert usage.output_tokens == 0
    details = usage.input_tokens_details
    assert (details.cached_tokens, details.cache_write_tokens) == (0, 0)


@pytest.mark.parametrize("model", ["gpt-6-luna", "jev-latest", "default", "gpt-6-luna-2026"])
def test_the_reply_echoes_the_name_sent_and_the_header_names_the_model(server, model):
    decision, raw = decide(server, ONE, model=model)
    assert json.loads(raw.http_request.content)["model"] == model
    assert decision.model == model
    assert raw.headers["x-semif-model"].split(";")[0] == "default"


def test_the_prompt_cache_and_safety_options_are_accepted(server):
    marked = [{"role": "user", "content": [
        {"type": "input_text", "text": TICKET, "prompt_cache_breakpoint": {"mode": "explicit"}},
    ]}]  # fmt: skip
    decision, raw = decide(
        server, ONE, input=marked, prompt_cache_key="tenant-1", safety_identifier="user-1",
        prompt_cache_options={"mode": "explicit", "ttl": "30m"},
    )  # fmt: skip
    sent = json.loads(raw.http_request.content)
    assert (sent["prompt_cache_key"], sent["safety_identifier"]) == ("tenant-1", "user-1")
    assert decision.answers[0].probability == 0.5


def test_the_sdk_exposes_the_request_id(server):
    with client(server[0]) as sdk:
        decision = sdk.decisions.create(
            model="gpt-6-luna",
            input=TICKET,
            questions=ONE,
            extra_headers={"X-Request-Id": "sdk-d-1"},
        )
        generated = sdk.decisions.with_raw_response.create(
            model="default", input=TICKET, questions=ONE
        )
    assert decision._request_id == "sdk-d-1"
    assert re.fullmatch(r"[0-9a-f]{32}", generated.request_id)
    assert generated.headers["x-typesafe-request-id"] == generated.request_id


# -- errors -----------------------------------------------------------------------------------


def check_error(error, status: int, code: str, kind: str, param=None) -> dict:
    """The SDK's exception reads the route's error envelope and the request id."""
    assert error.status_code == status
    assert set(error.body) == {"code", "message", "type", "param"}
    assert (error.code, error.type, error.param) == (code, kind, param)
    assert error.request_id and error.request_id == error.response.headers["x-typesafe-request-id"]
    assert error.body["message"] in str(error)
    return error.body


def test_a_wrong_key_is_the_sdks_authentication_error(server):
    with pytest.raises(openai.AuthenticationError) as caught:
        decide(
            server, ONE, api_key="wrong-" + "k" * 34, extra_headers={"X-Request-Id": "sdk-d-401"}
        )
    check_error(caught.value, 401, "unauthorized", "authentication_error")
    assert caught.value.request_id == "sdk-d-401"


def test_an_unknown_model_is_the_sdks_not_found_error(server):
    with pytest.raises(openai.NotFoundError) as caught:
        decide(server, ONE, model="gpt-6-sol")
    envelope = check_error(caught.value, 404, "model_not_found", "not_found_error")
    assert "'gpt-6-sol'" in envelope["message"] and "gpt-6-luna, jev-latest" in envelope["message"]


def test_sixteen_options_the_letters_a_to_p_are_scored(server):
    sixteen = [
        {
            "type": "choice",
            "instructions": "Which?",
            "choices": [{"value": f"c{n}"} for n in range(16)],
        },
        {
            "type": "score",
            "instructions": "How?",
            "levels": [{"label": f"level {n}"} for n in range(16)],
        },
    ]
    decision, _ = decide(server, sixteen)
    pick, rate = decision.answers
    assert [(p.value, p.probability) for p in pick.probabilities] == [
        (f"c{n}", 0.0625) for n in range(16)
    ]
    assert rate.score == pytest.approx(7.5) and rate.probabilities[15].label == "level 15"


IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}


def choice(choices):
    return [*ONE, {"type": "choice", "name": "c", "instructions": "Which?", "choices": choices}]


@pytest.mark.parametrize(
    ("input", "questions", "code", "param"),
    [
        (
            TICKET,
            choice([{"value": f"c{n}"} for n in range(256)]),
            "option_count_unsupported",
            "questions[1].choices",
        ),
        (
            TICKET,
            [
                *ONE,
                {
                    "type": "score",
                    "instructions": "How?",
                    "levels": [{"label": f"{n}"} for n in range(256)],
                },
            ],
            "option_count_unsupported",
            "questions[1].levels",
        ),
        (TICKET, choice([{"value": "only"}]), "invalid_request", "questions[1].choices"),
        (
            TICKET,
            choice([{"value": "a"}, {"value": "a"}]),
            "invalid_request",
            "questions[1].choices[1].value",
        ),
        (
            [{"role": "user", "content": [{"type": "input_text", "text": "Look:"}, IMAGE]}],
            ONE,
            "invalid_request",
            "input[0].content[1]",
        ),
        (
            TICKET,
            [*ONE, {"type": "predicate", "instructions": [IMAGE]}],
            "invalid_request",
            "questions[1].instructions[0]",
        ),
        (
            TICKET,
            [*ONE, {"type": "predicate", "instructions": ""}],
            "invalid_request",
            "questions[1].instructions",
        ),
        (
            TICKET,
            [*ONE, {"type": "predicate", "instructions": [{"type": "input_text", "text": " "}]}],
            "invalid_request",
            "questions[1].instructions",
        ),
    ],
    ids=[
        "256-choices",
        "256-levels",
        "one-choice",
        "same-value-twice",
        "input-image",
        "image-instructions",
        "empty-instructions",
        "blank-instructions",
    ],
)
def test_a_request_the_server_cannot_score_is_the_sdks_unprocessable_entity_error(
    server, input, questions, code, param
):
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        decide(server, questions, input=input)
    envelope = check_error(caught.value, 422, code, "invalid_request_error", param)
    if code == "option_count_unsupported":
        assert "over the 255 this server scores" in envelope["message"]


def test_a_string_and_a_boolean_of_the_same_text_are_two_choices_not_a_repeat(server):
    decision, _ = decide(server, choice([{"value": "false"}, {"value": False}]))
    assert [p.value for p in decision.answers[1].probabilities] == ["false", False]


def test_an_input_past_the_body_limit_is_413_unretried_and_the_client_goes_on(server):
    seen = len(access_statuses(server[0], ROUTE))
    huge = "The printer jams. " * (BODY_LIMIT // 16)  # over 1 MiB, sent as it is
    with client(server[0]) as sdk:  # retries enabled: a 413 is not one the SDK retries
        with pytest.raises(openai.APIStatusError) as caught:
            sdk.decisions.create(model="gpt-6-luna", input=huge, questions=ONE)
        after = sdk.decisions.create(model="gpt-6-luna", input=TICKET, questions=ONE)
    assert type(caught.value) is openai.APIStatusError  # the SDK has no class of its own for it
    envelope = check_error(caught.value, 413, "request_too_large", "invalid_request_error")
    assert "over the limit of 1048576" in envelope["message"]
    assert access_statuses(server[0], ROUTE)[seen:] == [413, 200]
    assert after.answers[0].probability == 0.5


def test_past_the_admission_limit_the_call_is_the_sdks_rate_limit_error(full_server):
    with Holder(full_server) as holder:
        with pytest.raises(openai.RateLimitError) as caught:
            decide(full_server, ONE, max_retries=0, extra_headers={"X-Request-Id": "sdk-d-429"})
        holder.release()
    error = caught.value
    check_error(error, 429, "busy", "rate_limit_error")
    assert error.request_id == "sdk-d-429"
    assert retry_headers_agree(error.response.headers)


def test_past_the_queue_timeout_the_call_is_the_sdks_internal_server_error(server):
    with Holder(server) as holder:
        with pytest.raises(openai.InternalServerError) as caught:
            decide(server, ONE, max_retries=0)
        holder.release()
    check_error(caught.value, 503, "server_busy", "server_error")
    assert retry_headers_agree(caught.value.response.headers)


@pytest.mark.parametrize(
    ("gated", "refusal"), [("full_server", 429), ("server", 503)], ids=["429", "503"]
)
def test_a_refused_call_is_retried_after_the_servers_retry_after_and_answered(
    request, caplog, gated, refusal
):
    gated = request.getfixturevalue(gated)
    server = gated[0]
    seen = len(access_statuses(server, ROUTE))
    with caplog.at_level(logging.INFO, logger="openai"), Holder(gated) as holder:
        call = InThread(lambda: decide(gated, ONE, max_retries=3))
        wait_for_status(server, ROUTE, refusal, seen)  # the first attempt was refused
        holder.release()
        decision, _ = call.outcome()
    assert decision.answers[0].probability == 0.5 and decision.model == "gpt-6-luna"
    statuses = access_statuses(server, ROUTE)[seen:]
    assert statuses[0] == refusal and statuses[-1] == 200, statuses
    assert set(statuses[:-1]) == {refusal}
    # Each wait is the server's retry-after-ms (1000), not the SDK's own backoff (0.5 s at first).
    waits = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("Retrying request in")
    ]
    assert waits and all(w.startswith("Retrying request in 1.000000 seconds") for w in waits), waits
    assert len(waits) == len(statuses) - 1
    assert call.seconds >= 1.0


# -- models -----------------------------------------------------------------------------------


def test_the_model_list_parses_and_names_every_model_and_alias(server):
    with client(server[0]) as sdk:
        models = list(sdk.models.list())
    assert [model.id for model in models] == ["default", "jev-latest", "gpt-6-luna"]
    assert all(model.object == "model" and model.owned_by == "semif-serve" for model in models)
    assert all(isinstance(model.created, int) and model.created > 0 for model in models)
    assert [getattr(model, "alias_of", None) for model in models] == [None, "default", "default"]


@pytest.mark.parametrize(("name", "alias_of"), [("gpt-6-luna", "default"), ("default", None)])
def test_models_retrieve_reads_one_name(server, name, alias_of):
    with client(server[0]) as sdk:
        model = sdk.models.retrieve(name)
    assert (model.id, model.object, model.owned_by) == (name, "model", "semif-serve")
    assert getattr(model, "alias_of", None) == alias_of
    with client(server[0]) as sdk, pytest.raises(openai.NotFoundError) as caught:
        sdk.models.retrieve("claude-9")
    assert caught.value.body["code"] == "model_not_found"


# -- the body's coding ------------------------------------------------------------------------

BODY = {"model": "gpt-6-luna", "input": INPUTS["messages"], "questions": QUESTIONS}


def test_the_sdk_sends_its_body_uncompressed(server):
    _, raw = decide(server)
    assert "content-encoding" not in raw.http_request.headers


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_raw_gzip_or_zstd_body_is_answered_as_the_same_body_uncompressed(server, encoding):
    status, plain, _ = post_raw(server[0], ROUTE, json.dumps(BODY).encode())
    assert status == 200, plain
    status, reply, headers = post_raw(server[0], ROUTE, encoded(BODY, encoding), encoding)
    assert status == 200, reply
    assert reply == plain and reply["model"] == "gpt-6-luna"
    assert headers["x-typesafe-request-id"] == headers["x-request-id"]


def test_an_encoding_the_server_does_not_decode_is_415(server):
    status, reply, headers = post_raw(server[0], ROUTE, b"\x8b\x02\x80{}\x03", "br")
    assert status == 415, reply
    assert reply["error"]["code"] == "unsupported_media_type"
    assert reply["error"]["type"] == "invalid_request_error"
    assert "'br'" in reply["error"]["message"]
    assert headers["x-typesafe-request-id"]


def test_a_zstd_bomb_is_413_and_never_inflated_past_the_limit(server):
    bomb = zstd_bomb()  # 100 MB of zeros in a few KB
    (status, reply, headers), grown = peak_growth(
        server[0], lambda: post_raw(server[0], ROUTE, bomb, "zstd")
    )
    assert status == 413, reply
    assert reply["error"]["code"] == "request_too_large"
    assert (
        f"decodes (zstd) to more than the limit of {BODY_LIMIT} bytes" in reply["error"]["message"]
    )
    assert headers["connection"] == "close"
    assert grown < 32 * MiB, f"the worker's memory peaked {grown / MiB:.0f} MiB higher"
    assert server[0].request("GET", "/health")[0] == 200
