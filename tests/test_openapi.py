"""docs/openapi.yaml is valid OpenAPI 3.1 and the app keeps to it."""

import re

import pytest
from fakes import AUTH, FakeScorer, decision, fake_app, row, settings
from falcon import testing
from jsonschema import ValidationError
from openapi_check import spec, validate, validate_reply, validate_request
from openapi_rules import RULE_FILTERS
from openapi_spec_validator import validate as validate_spec
from rows_factory import make_rows

from semif_serve.apis.grouped import DIRECT, SHARED_NORMALISER
from semif_serve.apis.names import is_hosted_name
from semif_serve.config import DTYPES, MAX_OPTIONS_LIMIT, Settings
from semif_serve.decisions import MAX_OPTIONS_FOR_ALL, ORDERINGS
from semif_serve.http.errors import FALCON_CODES, STATUS_AND_CODE
from semif_serve.runtime.scheduler import ModelScheduler
from semif_serve.runtime.service import MAX_TIMEOUT_S
from semif_serve.runtime.specs import (
    MAX_KEEP_ALIVE_S,
    MAX_SLOTS,
    MAX_TOKENS_LIMIT,
    MODEL_ID,
    RESERVED_IDS,
    SPEC_KEYS,
    default_spec,
)
from semif_serve.scoring import score, score_shared
from semif_serve.scoring.result import READOUTS
from semif_serve.scoring.rows import MAX_OPTIONS, MAX_STATE_DEPTH, MIN_OPTIONS
from semif_serve.server import GUNICORN_ERROR_CODES


def test_the_document_is_valid_openapi_3_1():
    validate_spec(spec())
    assert spec()["openapi"].startswith("3.1")


def test_the_documented_routes_are_the_apps_routes():
    app, _ = fake_app()
    api = testing.TestClient(app)
    documented = {
        (path, method.upper()) for path, item in spec()["paths"].items() for method in item
    }
    assert documented == {
        ("/health", "GET"),
        ("/metrics", "GET"),
        ("/decide", "POST"),
        ("/decide/shared", "POST"),
        ("/v1/models", "GET"),
        ("/v1/models/{model_id}", "GET"),
        ("/v1/models/{model_id}", "PUT"),
        ("/v1/models/{model_id}/unload", "POST"),
        ("/v1/models/unload", "POST"),
        ("/v1/systemone", "POST"),
        ("/v1/decisions", "POST"),
        ("/v1/models/{model_id}", "PARAMETERS"),
        ("/v1/models/{model_id}/unload", "PARAMETERS"),
    }
    for path, method in documented - {(p, m) for p, m in documented if m == "PARAMETERS"}:
        concrete = path.replace("{model_id}", "default")
        assert api.simulate_request(method, concrete, headers=AUTH).status_code not in (404, 405)
    assert spec()["paths"]["/health"]["get"]["security"] == []


def test_every_error_code_the_service_can_send_is_documented():
    documented = set(
        spec()["components"]["schemas"]["Error"]["properties"]["error"]["properties"]["code"][
            "enum"
        ]
    )
    sent = {code for _, code in STATUS_AND_CODE.values()} | set(FALCON_CODES.values())
    sent |= set(GUNICORN_ERROR_CODES.values()) | {"http_error", "internal_error"}
    assert documented == sent


CASES = [
    ("/decide", row()),
    ("/decide", row(workload="triage")),
    ("/decide", row(options=("A", "B", "C"), orderings="rotations")),
    ("/decide", row(options=("A", "B"), orderings="all")),
    (
        "/decide/shared",
        {"state": ["a", 1], "decisions": [decision("a"), decision("b", orderings="rotations")]},
    ),
    ("/decide/shared", {"state": {"k": "v"}, "decisions": [decision("a")], "workload": "triage"}),
]


NOUL = {"type": "noul", "instructions": "Is it open?"}
PREDICATE = {"type": "predicate", "name": "open", "instructions": "The door is open."}
CASES += [
    (
        "/v1/systemone",
        {
            "model": "jev-latest",
            "state": {"door": "open"},
            "questions": {
                "open": NOUL,
                "sides": {**NOUL, "criteria": {"true": {"open": True}, "false": None}},
                "tone": {"type": "choice", "instructions": ["q"], "criteria": {"A": None, "b": "B"}},
                "level": {"type": "score", "instructions": {"q": 1}, "criteria": ["A", {"x": 1}, "C"]},
            },
            "assets": None,
            "timeout_s": 30,
        },
    ),
    ("/v1/systemone", {"state": "s", "questions": {"": {**NOUL, "criteria": {}}}, "model": None}),
    # What the ecosystem's apps send: hosted names with no alias, unknown top-level fields, empty
    # states, a noul without instructions, more than 16 options (option groups).
    (
        "/v1/systemone",
        {
            "model": "typesafe/jev-1.13",
            "state": "",
            "questions": {
                "refund": {"type": "noul", "criteria": {"true": "Money back."}},
                "blank": {"type": "noul", "instructions": " ", "criteria": {"false": {"no": 1}}},
                "team": {"type": "choice", "instructions": "q", "criteria": {f"t{k}": None for k in range(40)}},
                "level": {"type": "score", "instructions": "q", "criteria": [f"l{k}" for k in range(17)]},
            },
            "temperature": 0,
            "metadata": {"app": "inbox"},
        },
    ),
    ("/v1/systemone", {"model": "jev-1.13.0", "state": {}, "questions": {"q": NOUL}}),
    ("/v1/systemone", {"state": [], "questions": {"q": NOUL}, "seed": 7}),
    ("/v1/decisions", {"model": "gpt-6-luna-2026-10-06", "input": "", "questions": [PREDICATE], "seed": 7}),
    (
        "/v1/decisions",
        {
            "input": [{"role": "user", "content": [{"type": "input_json", "data": [{"a": 1}, {"b": 2}]}]}],
            "questions": [
                {"type": "choice", "instructions": "q", "choices": [{"value": str(k)} for k in range(255)]},
                {"type": "score", "instructions": "q", "levels": [{"label": str(k)} for k in range(20)]},
            ],
        },
    ),
    ("/v1/decisions", {"input": [], "questions": [PREDICATE]}),
    ("/v1/decisions", {"model": "default", "input": "The door is open.", "questions": [PREDICATE]}),
    (
        "/v1/decisions",
        {
            "model": "gpt-6-luna",
            "input": [
                {"role": "system", "content": "Front desk."},
                {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "Door?", "prompt_cache_breakpoint": {"mode": "explicit"}},
                    {"type": "input_json", "data": {"door": "open"}},
                ]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}], "phase": "final_answer"},
                {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}", "id": "fc_1"},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "open"}]},
                {"type": "custom_tool_call", "call_id": "c2", "name": "sh", "input": "ls", "namespace": "tools"},
                {"type": "custom_tool_call_output", "call_id": "c2", "output": "door.txt"},
            ],
            "questions": [
                PREDICATE,
                {"type": "choice", "instructions": [{"type": "input_text", "text": "Which?"}],
                 "choices": [{"value": "A"}, {"value": True, "description": "B"}, {"value": "true", "description": ""}]},
                {"type": "score", "name": None, "instructions": "How much?",
                 "levels": [{"label": "A"}, {"label": "high", "description": "very"}]},
            ],
            "prompt_cache_key": "k",
            "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
            "safety_identifier": None,
        },
    ),
]  # fmt: skip
ECOSYSTEM = {"model_aliases": {"jev-latest": "default", "gpt-6-luna": "default"}}
LEGACY = {"legacy_extension_block": True}


@pytest.mark.parametrize(("path", "body"), CASES)
def test_successful_requests_and_replies_match_the_schemas(path, body):
    validate_request(path, body)
    app, _ = fake_app(FakeScorer(base={"A": 1.0}), calibration={"triage": 1.3}, **ECOSYSTEM)
    response = testing.TestClient(app).simulate_post(path, json=body, headers=AUTH)
    assert response.status_code == 200, response.json
    validate_reply(path, "POST", 200, response.json)
    if path.startswith("/v1/"):
        assert response.headers["x-semif-model"].startswith("default")


@pytest.mark.parametrize(("path", "body"), [case for case in CASES if case[0].startswith("/v1/")])
def test_replies_with_the_legacy_block_match_the_schemas(path, body):
    app, _ = fake_app(FakeScorer(base={"A": 1.0}), **ECOSYSTEM, **LEGACY)
    response = testing.TestClient(app).simulate_post(path, json=body, headers=AUTH)
    assert response.status_code == 200, response.json
    validate_reply(path, "POST", 200, response.json)
    answers = response.json["answers"]
    for answer in answers.values() if isinstance(answers, dict) else answers:
        assert answer["semif"] == answer["x_semif"]


def test_a_grouped_answer_matches_the_readout_schema():
    body = {
        "state": "s",
        "questions": {
            "c": {
                "type": "choice",
                "instructions": "q",
                "criteria": {str(k): None for k in range(40)},
            }
        },
    }
    app, _ = fake_app(FakeScorer(base={"A": 1.0}))
    response = testing.TestClient(app).simulate_post("/v1/systemone", json=body, headers=AUTH)
    assert response.status_code == 200, response.json
    block = response.json["answers"]["c"]["x_semif"]
    validate({"$ref": "#/components/schemas/Readout"}, block)
    assert (block["method"], len(block["group_prompt_sha256"]), len(block["probabilities"])) == (
        "grouped-16",
        3,
        40,
    )


def test_the_model_list_matches_its_schema():
    app, _ = fake_app(**ECOSYSTEM)
    response = testing.TestClient(app).simulate_get("/v1/models", headers=AUTH)
    validate_reply("/v1/models", "GET", 200, response.json)
    assert [entry["id"] for entry in response.json["data"]] == [
        "default",
        "jev-latest",
        "gpt-6-luna",
    ]
    app, _ = fake_app()  # no alias: the exact hosted names are listed
    response = testing.TestClient(app).simulate_get("/v1/models", headers=AUTH)
    validate_reply("/v1/models", "GET", 200, response.json)
    assert [entry["id"] for entry in response.json["data"]] == [
        "default",
        "gpt-6-luna",
        "jev-latest",
    ]


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("default", 200),
        ("gpt-6-luna", 200),
        ("jev-1.13.0", 200),
        ("gpt-6-luna-x", 200),
        ("nope", 404),
        ("jev-", 404),
    ],
)
def test_a_model_lookup_matches_its_schema(name, status):
    app, _ = fake_app()
    response = testing.TestClient(app).simulate_get(f"/v1/models/{name}", headers=AUTH)
    assert response.status_code == status, response.json
    validate_reply("/v1/models/{model_id}", "GET", status, response.json)
    hosted = spec()["components"]["schemas"]["HostedModelName"]
    assert (status == 200 and name != "default") is (
        re.fullmatch(hosted["pattern"][1:-1], name) is not None
    )


def test_health_matches_its_schema():
    app, _ = fake_app(calibration={"triage": 1.3}, vram_cap_gib=5.5)
    validate_reply("/health", "GET", 200, testing.TestClient(app).simulate_get("/health").json)


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [({}, row(), 401), (AUTH, {"id": 1}, 422), (AUTH, "x" * 2000, 413)],
)
def test_error_replies_match_the_envelope(headers, body, status):
    app, _ = fake_app(max_body_bytes=1000)
    response = testing.TestClient(app).simulate_post("/decide", json=body, headers=headers)
    assert response.status_code == status
    validate_reply("/decide", "POST", status, response.json)


TOO_MANY = [{"value": str(k)} for k in range(256)]


@pytest.mark.parametrize("path", ["/v1/systemone", "/v1/decisions"])
@pytest.mark.parametrize(
    ("headers", "body", "status", "param"),
    [
        ({}, {}, 401, None),
        (AUTH, {"model": "nope"}, 404, None),
        (AUTH, "x" * 2000, 413, None),
        (AUTH, ["not an object"], 422, None),
        ({**AUTH, "Content-Encoding": "br"}, {}, 415, None),
        ({**AUTH, "Content-Encoding": "gzip"}, {}, 400, None),
    ],
)
def test_ecosystem_error_replies_carry_openai_type_and_param(path, headers, body, status, param):
    app, _ = fake_app(max_body_bytes=1000)
    if body == {"model": "nope"}:
        body = (
            {"model": "nope", "state": "s", "questions": {"q": NOUL}}
            if path == "/v1/systemone"
            else {"model": "nope", "input": "s", "questions": [PREDICATE]}
        )
    response = testing.TestClient(app).simulate_post(path, json=body, headers=headers)
    assert response.status_code == status, response.json
    validate_reply(path, "POST", status, response.json)
    assert response.json["error"]["param"] == param
    detail = response.json["detail"]
    if status == 422:
        assert detail == [
            {"loc": ["body"], "msg": response.json["error"]["message"], "type": "invalid_request"}
        ]
    else:
        assert detail == {
            "error_type": response.json["error"]["type"],
            "message": response.json["error"]["message"],
        }


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/systemone", {"state": "s", "questions": {"q": {"type": "choice", "instructions": "q", "criteria": {str(k): None for k in range(256)}}}}, "questions.q.criteria"),
        ("/v1/decisions", {"input": "s", "questions": [{"type": "choice", "instructions": "q", "choices": TOO_MANY}]}, "questions[0].choices"),
    ],
)  # fmt: skip
def test_more_than_255_options_is_option_count_unsupported(path, body, param):
    with pytest.raises(ValidationError):
        validate_request(path, body)
    app, _ = fake_app()
    response = testing.TestClient(app).simulate_post(path, json=body, headers=AUTH)
    assert response.status_code == 422
    validate_reply(path, "POST", 422, response.json)
    assert response.json["error"]["code"] == "option_count_unsupported"
    assert response.json["error"]["param"] == param
    assert response.json["detail"][0]["type"] == "option_count_unsupported"


HOSTED_SAMPLES = [
    "jev-latest", "jev-1.13.0", "typesafe/jev-1.13", "typesafe/jev-", "jev-", "jev", "JEV-1",
    "gpt-6-luna", "gpt-6-luna-2026-10-06", "gpt-6-luna-", "gpt-6-lunar", "gpt-6", "jev-" + "x" * 120,
    "jev-" + "x" * 121, "jev-a b", "jev-é", "xjev-1", "typesafe/gpt-6-luna", "default", "",
]  # fmt: skip


def test_the_documented_limits_are_the_servers():
    schemas = spec()["components"]["schemas"]
    assert (schemas["Options"]["minItems"], schemas["Options"]["maxItems"]) == (
        MIN_OPTIONS,
        MAX_OPTIONS,
    )
    assert schemas["State"]["x-semif-max-depth"] == MAX_STATE_DEPTH
    for name in ("DecideRequest", "Decision"):
        (all_rule,) = [
            rule for rule in schemas[name]["allOf"] if "options" in rule["then"]["properties"]
        ]
        assert all_rule["if"]["properties"]["orderings"]["const"] == "all"
        assert all_rule["then"]["properties"]["options"]["maxItems"] == MAX_OPTIONS_FOR_ALL
    assert schemas["Orderings"]["enum"] == list(ORDERINGS)
    assert schemas["TimeoutS"]["maximum"] == MAX_TIMEOUT_S
    decisions = schemas["DecideSharedRequest"]["properties"]["decisions"]
    assert decisions["maxItems"] == Settings.__dataclass_fields__["max_decisions"].default
    model = schemas["ModelSpec"]["properties"]
    assert model["max_tokens"]["maximum"] == MAX_TOKENS_LIMIT
    assert model["keep_alive_s"]["maximum"] == MAX_KEEP_ALIVE_S
    assert model["slots"]["maximum"] == MAX_SLOTS
    assert model["dtype"]["enum"] == list(DTYPES)
    # `default` is a models-file key: it picks the default model, which a PUT cannot.
    assert set(model) == SPEC_KEYS - {"default"}
    assert schemas["NewModelId"]["pattern"] == f"^{MODEL_ID.pattern}$"
    assert {schemas["NewModelId"]["not"]["const"]} == RESERVED_IDS
    assert schemas["Result"]["properties"]["readout"]["enum"] == list(READOUTS.values())
    # The ecosystem formats: up to SEMIF_MAX_OPTIONS (its default) choices or levels.
    max_options = Settings.__dataclass_fields__["max_options"].default
    option_lists = [
        schemas["SystemOneChoice"]["properties"]["criteria"]["maxProperties"],
        schemas["SystemOneScore"]["properties"]["criteria"]["maxItems"],
        schemas["DecisionsChoice"]["properties"]["choices"]["maxItems"],
        schemas["DecisionsScore"]["properties"]["levels"]["maxItems"],
    ]
    assert option_lists == [max_options] * 4 == [MAX_OPTIONS_LIMIT] * 4
    assert schemas["EcosystemState"]["x-semif-max-depth"] == MAX_STATE_DEPTH
    assert schemas["Readout"]["properties"]["method"]["enum"] == [DIRECT, SHARED_NORMALISER]
    hosted = re.compile(schemas["HostedModelName"]["pattern"])
    for name in HOSTED_SAMPLES:
        assert (hosted.search(name) is not None) is is_hosted_name(name), name


def test_real_scorer_results_match_the_result_schema(tiny_qwen):
    rows = make_rows(2, [2, 3])
    direct = score(tiny_qwen, rows[0], max_tokens=4096)
    shared, _ = score_shared(tiny_qwen, rows, max_tokens=4096)
    for result in (direct, *shared):
        validate({"$ref": "#/components/schemas/Result"}, result)


def test_a_non_blank_string_is_one_that_strip_does_not_empty():
    pattern = re.compile(spec()["components"]["schemas"]["NonBlank"]["pattern"])
    for code in range(0x3100):
        assert bool(pattern.search(chr(code))) == bool(chr(code).strip()), hex(code)
    assert pattern.search(" \t x ") and not pattern.search(" \u3000\x85\n")


ADMIN = {"Authorization": "Bearer " + "b" * 40}
DEEPEST_STATE: list = [1]
for _ in range(MAX_STATE_DEPTH - 1):
    DEEPEST_STATE = [DEEPEST_STATE]


def shared(*decisions, **extra):
    return {"state": "s", "decisions": list(decisions), **extra}


def system_one_choice(criteria):
    question = {"type": "choice", "instructions": "q", "criteria": criteria}
    return {"state": "s", "questions": {"c": question}}


def decisions_choice(*choices):
    return {
        "input": "s",
        "questions": [{"type": "choice", "instructions": "q", "choices": list(choices)}],
    }


def decisions_input(*items):
    return {"input": list(items), "questions": [PREDICATE]}


def decisions_levels(*labels):
    levels = [{"label": label} for label in labels]
    return {"input": "s", "questions": [{"type": "score", "instructions": "q", "levels": levels}]}


def deep_object(depth):
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def same_option_ids(body):
    body["options"] = [{"id": "o", "description": "A"}, {"id": "o", "description": "B"}]
    return body


# For each cross-field rule the document states, bodies that break it, and whether JSON Schema
# itself refuses them (the if/then rules) or only the x-semif rule says so. The server refuses
# every one: a rule tests/openapi_hooks.py filters on must be one the server enforces, or the
# filter would hide bodies the server accepts.
BROKEN_RULES = [
    ("unique-option-ids", "/decide", same_option_ids(row()), False),
    ("unique-option-ids", "/decide/shared", shared(decision("a"), same_option_ids(decision("b"))), False),
    ("rows-within-max-decisions", "/decide", row(options=tuple("ABCDEFGHI"), orderings="rotations"), False),
    ("rows-within-max-decisions", "/decide", row(options=tuple("ABCD"), orderings="all"), False),
    (
        "rows-within-max-decisions", "/decide/shared",
        shared(decision("a", tuple("ABCDE"), orderings="rotations"), decision("b", tuple("ABCD"), orderings="rotations")),
        False,
    ),
    ("unique-decision-ids", "/decide/shared", shared(decision("a"), decision("a")), False),
    ("unique-decision-ids", "/decide/shared", shared(decision("a#o1"), decision("a", orderings="rotations")), False),
    ("unique-decision-ids", "/decide/shared", shared(decision("a#o0", orderings="rotations"), decision("a", orderings="rotations")), False),
    ("unique-decision-ids", "/decide/shared", shared(decision("a"), decision("a", orderings="rotations")), False),
    ("state-depth", "/decide", row(state=[DEEPEST_STATE]), False),
    ("integer-literals", "/v1/models/{model_id}", {"source": "s", "max_tokens": 5.0}, False),
    ("integer-literals", "/v1/models/{model_id}", {"source": "s", "slots": 2.0}, False),
    ("all-at-most-4-options", "/decide", row(options=tuple("ABCDE"), orderings="all"), True),
    ("all-at-most-4-options", "/decide/shared", shared(decision("a", tuple("ABCDE"), orderings="all")), True),
    ("workload-without-orderings", "/decide", row(workload="triage", orderings="rotations"), True),
    ("workload-without-orderings", "/decide/shared", shared(decision("a", orderings="rotations"), workload="triage"), True),
    ("state-depth", "/v1/systemone", {"state": [DEEPEST_STATE], "questions": {"q": NOUL}}, False),
    ("choice-name-describes-itself", "/v1/systemone", system_one_choice({" ": None, "b": "B"}), False),
    ("choice-name-describes-itself", "/v1/systemone", system_one_choice({"": "", "b": "B"}), False),
    ("unique-choice-values", "/v1/decisions", decisions_choice({"value": "a"}, {"value": "a", "description": "x"}), False),
    ("unique-choice-values", "/v1/decisions", decisions_choice({"value": False}, {"value": False}), False),
    ("choice-value-describes-itself", "/v1/decisions", decisions_choice({"value": " "}, {"value": "b"}), False),
    ("choice-value-describes-itself", "/v1/decisions", decisions_choice({"value": "", "description": ""}, {"value": "b"}), False),
    ("tool-output-follows-its-call", "/v1/decisions", decisions_input({"type": "function_call_output", "call_id": "c", "output": "x"}), False),
    (
        "tool-output-follows-its-call", "/v1/decisions",
        decisions_input(
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": ""},
            {"type": "custom_tool_call_output", "call_id": "c", "output": "x"},
        ),
        False,
    ),
    ("input-depth", "/v1/decisions", decisions_input({"role": "user", "content": [{"type": "input_json", "data": deep_object(30)}]}), False),
    ("unique-level-labels", "/v1/decisions", decisions_levels("low", "high", "low"), False),
    ("unique-call-ids", "/v1/decisions", decisions_input({"type": "function_call", "call_id": "c", "name": "f", "arguments": ""}, {"type": "custom_tool_call", "call_id": "c", "name": "g", "input": ""}), False),
    ("noul-needs-instructions-or-a-side", "/v1/systemone", {"state": "s", "questions": {"q": {"type": "noul"}}}, True),
    ("noul-needs-instructions-or-a-side", "/v1/systemone", {"state": "s", "questions": {"q": {"type": "noul", "instructions": " ", "criteria": {"true": "", "false": None}}}}, True),
    ("input-json-data-objects", "/v1/decisions", decisions_input({"role": "user", "content": [{"type": "input_json", "data": [{"a": 1}, 2]}]}), True),
    ("breakpoint-on-input-text-only", "/v1/decisions", decisions_input({"role": "assistant", "content": [{"type": "output_text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit"}}]}), True),
]  # fmt: skip


@pytest.mark.parametrize(("rule", "path", "body", "in_json_schema"), BROKEN_RULES)
def test_every_documented_cross_field_rule_is_enforced(rule, path, body, in_json_schema):
    method = "put" if path.startswith("/v1/models") else "post"
    if in_json_schema:
        with pytest.raises(ValidationError):
            validate_request(path, body, method)
    else:
        validate_request(path, body, method)
    app, _ = fake_app(
        max_decisions=8, calibration={"triage": 1.3}, admin_token="b" * 40, parallel_slots=2
    )
    client = testing.TestClient(app)
    if method == "post":
        response = client.simulate_post(path, json=body, headers=AUTH)
        assert response.status_code == 422, response.json
    else:
        response = client.simulate_put(path.format(model_id="m"), json=body, headers=ADMIN)
        assert response.status_code == 400, response.json


def test_the_deepest_documented_state_is_accepted():
    app, _ = fake_app()
    body = row(state=DEEPEST_STATE)
    validate_request("/decide", body)
    response = testing.TestClient(app).simulate_post("/decide", json=body, headers=AUTH)
    assert response.status_code == 200, response.json


def test_every_filtered_rule_has_a_body_that_breaks_it():
    rules = {case.values[0] if hasattr(case, "values") else case[0] for case in BROKEN_RULES}
    assert rules >= RULE_FILTERS.keys() | {"state-depth"}


def test_a_model_table_key_the_document_does_not_list_is_refused():
    body = {"source": "s", "default": True}
    with pytest.raises(ValidationError):
        validate_request("/v1/models/{model_id}", body, "put")
    app, _ = fake_app(admin_token="b" * 40)
    response = testing.TestClient(app).simulate_put("/v1/models/m", json=body, headers=ADMIN)
    assert response.status_code == 400, response.json
    assert response.json["error"]["message"].startswith("m.default: only SEMIF_MODELS_FILE")


def test_a_model_status_with_a_load_error_matches_its_schema():
    entry = ModelScheduler(default_spec(settings()))
    batching = {"batching": {"max_rows": 8, "max_tokens": 2048, "wait_ms": 0}}
    validate({"$ref": "#/components/schemas/ModelStatus"}, entry.status() | batching)
    entry.record_load_error("loading model 'default' failed: no such folder")
    validate({"$ref": "#/components/schemas/ModelStatus"}, entry.status() | batching)
