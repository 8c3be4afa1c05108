"""The official TypeSafe SDK (typesafe-sdk 0.7.5, unmodified) against POST /v1/systemone and
GET /v1/models of a real gunicorn over the fake scorer (tests/serve_steered.py fake): every question type
as the SDK's objects and as raw dicts, usage and the model that answered, every error status as
the SDK's typed exception, retries after the server's retry-after, and the body's codings (the
SDK's own zstd, raw gzip and zstd, an unknown coding, a zstd bomb).

The fake scorer's logits are all 0, so every option is equally likely: a noul is 0.5, every
confidence 0.0, a score the mean level. Its shared calls count the state's 6 tokens once and 4 of
each question's own."""

import gzip
import json
import re
import struct
import zlib

import pytest
from backports import zstd
from fakes import TOKEN
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
from typesafe_sdk import (
    Box,
    Choice,
    ChoiceAnswer,
    Image,
    ListModelsResponse,
    Noul,
    NoulAnswer,
    RetryPolicy,
    Score,
    ScoreAnswer,
    SystemOneResponse,
    TypeSafeAPIError,
    TypeSafeAuthenticationError,
    TypeSafeClient,
    TypeSafeInternalServerError,
    TypeSafeNotFoundError,
    TypeSafeRateLimitError,
    TypeSafeUnprocessableEntityError,
)

pytestmark = pytest.mark.server

ROUTE = "/v1/systemone"
NO_RETRIES = RetryPolicy(max_retries=0)
STATE = {"ticket": "I was charged twice for one order.", "reporter": "Ana Müller"}
QUESTIONS = {
    "billing": Noul(instructions="Is this about billing?"),
    "refund": Noul(
        instructions={"ask": "Is a refund wanted?"},
        criteria={"true": "The customer asks for money back", "false": None},
    ),
    "tone": Choice(
        instructions="What is the tone?",
        criteria={"calm": None, "angry": "An upset message", "mixed": {"both": True}},
    ),
    "urgency": Score(
        instructions="How urgent is it?",
        criteria=["Can wait", {"when": "today"}, "Now", "Yesterday"],
    ),
}
RAW_QUESTIONS = {  # the same questions as the wire's dicts
    "billing": {"type": "noul", "instructions": "Is this about billing?"},
    "refund": {
        "type": "noul",
        "instructions": {"ask": "Is a refund wanted?"},
        "criteria": {"true": "The customer asks for money back", "false": None},
    },
    "tone": {
        "type": "choice",
        "instructions": "What is the tone?",
        "criteria": {"calm": None, "angry": "An upset message", "mixed": {"both": True}},
    },
    "urgency": {
        "type": "score",
        "instructions": "How urgent is it?",
        "criteria": ["Can wait", {"when": "today"}, "Now", "Yesterday"],
    },
}
USAGE = {"input_tokens": 6 + 4 * len(QUESTIONS), "output_tokens": 0}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """`busy`: a request waits at most 0.2 s for a held model, then 503. `full`: one POST
    admitted at a time, a second one is a 429."""
    variants = {"busy": {"SEMIF_QUEUE_TIMEOUT_S": "0.2"}, "full": {"SEMIF_MAX_QUEUE": "1"}}
    with gated_servers(tmp_path_factory.mktemp("systemone"), **variants) as gated:
        yield gated


@pytest.fixture(scope="module")
def server(servers):
    return servers["busy"]


@pytest.fixture(scope="module")
def full_server(servers):
    return servers["full"]


def client(server, api_key=TOKEN, **options) -> TypeSafeClient:
    return TypeSafeClient(api_key=api_key, base_url=f"http://127.0.0.1:{server.port}", **options)


def ask(gated, questions=None, **options) -> SystemOneResponse:
    """One System One call through the SDK (its default model, jev-latest, unless `model`)."""
    client_options = {key: options.pop(key) for key in ("retry", "api_key") if key in options}
    with client(gated[0], **client_options) as sdk:
        return sdk.system_one(state=STATE, questions=questions or QUESTIONS, **options)


# -- answers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("questions", [QUESTIONS, RAW_QUESTIONS], ids=["objects", "dicts"])
def test_every_question_type_is_answered_by_name_with_the_uniform_fakes_values(server, questions):
    reply = ask(server, questions)
    assert isinstance(reply, SystemOneResponse)
    assert list(reply.answers) == ["billing", "refund", "tone", "urgency"]
    assert reply.nouls == {
        "billing": NoulAnswer(noul=0.5),
        "refund": NoulAnswer(noul=0.5),
    }
    third = pytest.approx(1 / 3)
    tone = reply.choices["tone"]
    assert isinstance(tone, ChoiceAnswer)
    assert (tone.choice, tone.confidence) == ("calm", 0.0)  # a tie: the first most probable
    assert tone.probabilities == {"calm": third, "angry": third, "mixed": third}
    assert list(tone.probabilities) == ["calm", "angry", "mixed"]  # in the order sent
    urgency = reply.scores["urgency"]
    assert isinstance(urgency, ScoreAnswer)
    assert urgency.score == pytest.approx(1.5) and urgency.confidence == 0.0
    assert urgency.legend == {0: "Can wait", 1: '{"when": "today"}', 2: "Now", 3: "Yesterday"}
    assert urgency.probabilities == {level: pytest.approx(0.25) for level in range(4)}
    assert reply.usage.model_dump() == USAGE
    assert reply.model == "jev-latest"  # the SDK's default name, echoed


def test_the_objects_and_the_dicts_send_the_same_questions(server):
    by_objects, by_dicts = ask(server, QUESTIONS), ask(server, RAW_QUESTIONS)
    assert json.loads(by_objects.raw_http_response.content) == json.loads(
        by_dicts.raw_http_response.content
    )
    sent = json.loads(by_objects.raw_http_response.request.content)
    assert sent["questions"] == RAW_QUESTIONS  # a nested null kept, unset fields left out


def test_every_float_is_a_json_float_and_the_extension_block_is_ignored(server):
    reply = ask(server)
    raw = json.loads(reply.raw_http_response.content)["answers"]
    floats = [raw["billing"]["noul"], raw["tone"]["confidence"], raw["urgency"]["score"]]
    floats += [*raw["tone"]["probabilities"].values(), *raw["urgency"]["probabilities"].values()]
    assert all(type(value) is float for value in floats), floats  # 0.0, never 0
    assert raw["tone"]["x_semif"]["confidence_formula"] == "normalized-peak-v1"
    assert "x_semif" not in reply.answers["tone"].model_dump()


@pytest.mark.parametrize("questions", [1, 3, 9, 70])  # 70: two shared calls (64 each at most)
def test_usage_counts_the_state_once_and_each_questions_own_tokens(server, questions):
    many = {f"q{n}": Noul(instructions=f"Is it case {n}?") for n in range(questions)}
    reply = ask(server, many)
    assert list(reply.answers) == list(many)
    assert reply.usage.input_tokens == 6 + 4 * questions and reply.usage.output_tokens == 0


@pytest.mark.parametrize("model", [None, "jev-latest", "gpt-6-luna", "default", "jev-1.13.0"])
def test_the_reply_echoes_the_name_sent_and_the_header_names_the_model(server, model):
    reply = ask(server, model=model)  # None: the SDK's default, jev-latest
    sent = json.loads(reply.raw_http_response.request.content)["model"]
    assert sent == (model or "jev-latest")
    assert reply.model == sent
    assert reply.raw_http_response.headers["x-semif-model"].split(";")[0] == "default"


def test_the_sdk_exposes_the_request_id(server):
    reply = ask(server, extra_headers={"X-Request-Id": "sdk-s1-1"})
    assert reply.request_id == "sdk-s1-1"
    assert reply.raw_http_response.headers["x-typesafe-request-id"] == "sdk-s1-1"
    generated = ask(server)
    assert re.fullmatch(r"[0-9a-f]{32}", generated.request_id)
    assert generated.raw_http_response.headers["x-request-id"] == generated.request_id


# -- errors -----------------------------------------------------------------------------------


def check_envelope(error, status: int, code: str, kind: str, param=None) -> dict:
    """The SDK's exception carries the route's error envelope and the request id."""
    assert error.status == status
    envelope = error.body["error"]
    assert set(envelope) == {"code", "message", "type", "param"}
    assert (envelope["code"], envelope["type"], envelope["param"]) == (code, kind, param)
    assert error.request_id and error.request_id == error.headers["x-request-id"]
    assert envelope["message"] in str(error)
    return envelope


def test_a_wrong_key_is_the_sdks_authentication_error(server):
    with pytest.raises(TypeSafeAuthenticationError) as caught:
        ask(server, api_key="wrong-" + "k" * 34, extra_headers={"X-Request-Id": "sdk-s1-401"})
    check_envelope(caught.value, 401, "unauthorized", "authentication_error")
    assert caught.value.request_id == "sdk-s1-401"
    assert caught.value.headers["www-authenticate"] == "Bearer"


def test_an_unknown_model_is_the_sdks_not_found_error(server):
    with pytest.raises(TypeSafeNotFoundError) as caught:
        ask(server, model="claude-nonexistent")
    envelope = check_envelope(caught.value, 404, "model_not_found", "not_found_error")
    assert "'claude-nonexistent'" in envelope["message"]
    assert "gpt-6-luna, jev-latest" in envelope["message"]  # the aliases it could have sent


OVER_LIMIT = {f"c{n}": None for n in range(256)}


def test_sixteen_options_the_letters_a_to_p_are_scored(server):
    sixteen = {
        "pick": Choice(instructions="Which?", criteria={f"c{n}": None for n in range(16)}),
        "rate": Score(instructions="How?", criteria=[f"level {n}" for n in range(16)]),
    }
    reply = ask(server, sixteen)
    assert reply.choices["pick"].probabilities == {f"c{n}": 0.0625 for n in range(16)}
    assert reply.scores["rate"].score == pytest.approx(7.5)
    assert reply.scores["rate"].legend[15] == "level 15"


@pytest.mark.parametrize(
    ("questions", "code", "param"),
    [
        (
            {"many": Choice(instructions="Which?", criteria=OVER_LIMIT)},
            "option_count_unsupported",
            "questions.many.criteria",
        ),
        (
            {
                "many": {
                    "type": "score",
                    "instructions": "How?",
                    "criteria": [f"{n}" for n in range(256)],
                }
            },
            "option_count_unsupported",
            "questions.many.criteria",
        ),
        (
            {"one": Choice(instructions="Which?", criteria={"only": None})},
            "invalid_request",
            "questions.one.criteria",
        ),
        ({"dog": Box(instructions="The dog")}, "invalid_request", "questions.dog"),
        ({"blank": Noul(instructions="")}, "invalid_request", "questions.blank.instructions"),
        (
            {"blank": {"type": "score", "instructions": "  ", "criteria": ["a", "b"]}},
            "invalid_request",
            "questions.blank.instructions",
        ),
    ],
    ids=[
        "256-choices",
        "256-levels",
        "one-choice",
        "box",
        "empty-instructions",
        "blank-instructions",
    ],
)
def test_a_question_the_server_cannot_score_is_the_sdks_unprocessable_entity_error(
    server, questions, code, param
):
    with pytest.raises(TypeSafeUnprocessableEntityError) as caught:
        ask(server, {"fine": Noul(instructions="Is it fine?"), **questions})
    envelope = check_envelope(caught.value, 422, code, "invalid_request_error", param)
    if code == "option_count_unsupported":
        assert "over the 255 this server scores" in envelope["message"]


def tiny_png() -> bytes:
    """A valid 1x1 PNG."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    pixels = chunk(b"IDAT", zlib.compress(b"\0\xff\x00\x00"))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + pixels + chunk(b"IEND", b"")


def test_an_image_asset_is_the_sdks_unprocessable_entity_error_and_the_client_goes_on(server):
    photo = Image(tiny_png())
    with client(server[0], retry=NO_RETRIES) as sdk:
        with pytest.raises(TypeSafeUnprocessableEntityError) as caught:
            sdk.system_one(
                state=f"The photo: {photo}", questions=QUESTIONS, assets={"photo": photo}
            )
        reply = sdk.system_one(state=STATE, questions=QUESTIONS)  # the same connection pool
    envelope = check_envelope(
        caught.value, 422, "invalid_request", "invalid_request_error", "assets"
    )
    assert "text-only model" in envelope["message"]
    assert reply.usage.model_dump() == USAGE


def test_a_state_that_decodes_past_the_limit_is_413_unretried_and_the_client_goes_on(server):
    seen = len(access_statuses(server[0], ROUTE))
    huge = "The printer jams. " * (BODY_LIMIT // 16)  # over 1 MiB; its zstd body a few KB
    with client(server[0]) as sdk:  # retries enabled: a 413 is not one the SDK retries
        with pytest.raises(TypeSafeAPIError) as caught:
            sdk.system_one(state=huge, questions=QUESTIONS)
        reply = sdk.system_one(state=STATE, questions=QUESTIONS)
    error = caught.value
    assert type(error) is TypeSafeAPIError  # the SDK has no class of its own for a 413
    envelope = check_envelope(error, 413, "request_too_large", "invalid_request_error")
    assert "decodes (zstd)" in envelope["message"]
    assert access_statuses(server[0], ROUTE)[seen:] == [413, 200]
    assert reply.usage.model_dump() == USAGE


def test_past_the_admission_limit_the_call_is_the_sdks_rate_limit_error(full_server):
    with Holder(full_server) as holder:
        with pytest.raises(TypeSafeRateLimitError) as caught:
            ask(full_server, retry=NO_RETRIES, extra_headers={"X-Request-Id": "sdk-s1-429"})
        holder.release()
    error = caught.value
    check_envelope(error, 429, "busy", "rate_limit_error")
    assert error.request_id == "sdk-s1-429"
    assert error.retry_after_ms == float(error.headers["retry-after-ms"])  # read from it
    assert retry_headers_agree(error.headers)


def test_past_the_queue_timeout_the_call_is_the_sdks_internal_server_error(server):
    with Holder(server) as holder:
        with pytest.raises(TypeSafeInternalServerError) as caught:
            ask(server, retry=NO_RETRIES)
        holder.release()
    check_envelope(caught.value, 503, "server_busy", "server_error")
    assert retry_headers_agree(caught.value.headers)


@pytest.mark.parametrize(
    ("gated", "refusal"), [("full_server", 429), ("server", 503)], ids=["429", "503"]
)
def test_a_refused_call_is_retried_after_the_servers_retry_after_and_answered(
    request, gated, refusal
):
    gated = request.getfixturevalue(gated)
    server = gated[0]
    seen = len(access_statuses(server, ROUTE))
    # No backoff of the SDK's own: any wait between the attempts is the server's retry-after.
    retry = RetryPolicy(max_retries=3, backoff_initial=0.0)
    with Holder(gated) as holder:
        call = InThread(lambda: ask(gated, retry=retry))
        wait_for_status(server, ROUTE, refusal, seen)  # the first attempt was refused
        holder.release()
        reply = call.outcome()
    assert reply.nouls["billing"].noul == 0.5 and reply.model == "jev-latest"
    statuses = access_statuses(server, ROUTE)[seen:]
    assert statuses[0] == refusal and statuses[-1] == 200, statuses
    assert set(statuses[:-1]) == {refusal}
    assert call.seconds >= 1.0  # it slept the server's retry-after-ms (1000) at least once


# -- models -----------------------------------------------------------------------------------


def test_the_model_list_parses_and_names_the_registered_model(server):
    with client(server[0]) as sdk:
        listing = sdk.models.list()
    assert isinstance(listing, ListModelsResponse)
    assert [model.name for model in listing.models] == ["default"]
    (model,) = listing.models
    assert model.description and re.fullmatch(r"\d{4}-\d{2}-\d{2}", model.release_date)
    assert listing.request_id == listing.raw_http_response.headers["x-typesafe-request-id"]
    raw = json.loads(listing.raw_http_response.content)["models"][0]
    assert raw["aliases"] == ["gpt-6-luna", "jev-latest"]


# -- the body's coding ------------------------------------------------------------------------

LONG_STATE = {"log": [f"step {n}: printed page {n} of the quarterly report" for n in range(60)]}


def test_the_sdks_zstd_body_is_answered_as_the_same_body_uncompressed(server):
    replies = {}
    for compression in (None, False):  # None: the SDK's default, zstd (backports.zstd here)
        with client(server[0], compression=compression) as sdk:
            replies[compression] = sdk.system_one(state=LONG_STATE, questions=QUESTIONS)
    squeezed, plain = replies[None].raw_http_response, replies[False].raw_http_response
    assert len(plain.request.content) >= 1024
    assert squeezed.request.headers["content-encoding"] == "zstd"
    assert len(squeezed.request.content) < len(plain.request.content)
    assert "content-encoding" not in plain.request.headers
    assert json.loads(squeezed.content) == json.loads(plain.content)
    assert replies[None].usage.model_dump() == USAGE


BODY = {"model": "jev-latest", "state": LONG_STATE, "questions": RAW_QUESTIONS}


@pytest.mark.parametrize("encoding", ["gzip", "zstd", "GZIP"])
def test_a_raw_gzip_or_zstd_body_is_answered_as_the_same_body_uncompressed(server, encoding):
    status, plain, _ = post_raw(server[0], ROUTE, json.dumps(BODY).encode())
    assert status == 200, plain
    status, reply, headers = post_raw(server[0], ROUTE, encoded(BODY, encoding.lower()), encoding)
    assert status == 200, reply
    assert reply == plain and reply["model"] == "jev-latest"
    assert headers["x-typesafe-request-id"] == headers["x-request-id"]


@pytest.mark.parametrize(
    ("encoding", "data", "problem"),
    [
        ("zstd", b"(\xb5/\xfd not a frame", "not valid zstd data"),
        (
            "zstd",
            zstd.compress(json.dumps(BODY).encode())[:-8],
            "the zstd stream ends inside a frame",
        ),
        (
            "gzip",
            gzip.compress(json.dumps(BODY).encode())[:-12],
            "the gzip stream ends inside a frame",
        ),
        ("gzip", b"\x1f\x8b not gzip", "not valid gzip data"),
    ],
    ids=["damaged-zstd", "truncated-zstd", "truncated-gzip", "damaged-gzip"],
)
def test_a_damaged_or_cut_off_coded_body_is_400(server, encoding, data, problem):
    status, reply, _ = post_raw(server[0], ROUTE, data, encoding)
    assert status == 400, reply
    assert reply["error"]["code"] == "bad_request" and problem in reply["error"]["message"]


def test_an_encoding_the_server_does_not_decode_is_415(server):
    status, reply, headers = post_raw(server[0], ROUTE, b"\x8b\x02\x80{}\x03", "br")
    assert status == 415, reply
    assert reply["error"]["code"] == "unsupported_media_type"
    assert "'br'" in reply["error"]["message"]
    assert headers["x-typesafe-request-id"]


def test_a_zstd_bomb_is_413_and_never_inflated_past_the_limit(server):
    bomb = zstd_bomb()  # 100 MB of zeros in a few KB
    assert len(bomb) < 64 * 1024
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
