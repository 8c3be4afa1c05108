"""schemathesis over docs/openapi.yaml against a live server with the fake scorer (issue 13).

The server: tests/serve_steered.py fake under gunicorn on 127.0.0.1, with a calibration table (so
`workload` has names to draw), an admin token, the parallel runtime (so `slots` in a model
table is valid, as the document describes) and two model aliases, one of them taking a hosted
name (so `/v1/systemone`, `/v1/decisions` and `GET /v1/models/{model_id}` draw their `model`
from ids, aliases and the hosted names, listed or not). The document's `x-semif-deployment`
values are filled in from this server's /health and /v1/models
(openapi_rules.deployment_document).

The schemathesis CLI (the version pinned in pyproject's dev extra) then runs every operation, the
management calls included (with the admin token), with valid and invalid requests generated
derandomized (the same cases every run), and every check on every reply. Two settings are
stricter than schemathesis's defaults: a valid request must get exactly 200 (the default would
also let a 404, a 409, a 429 or a 5xx pass), and the run continues past a failure, so that one
failure cannot hide another. tests/openapi_hooks.py drops a generated valid body that breaks one
of the document's `x-semif-rules`; nothing else is filtered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fakes import TOKEN
from live_server import fake_server
from openapi_check import spec
from openapi_rules import (
    RULE_FILTERS,
    RULES_WITHOUT_FILTER,
    body_rules,
    deployment_document,
    nesting_depth,
    request_body_schema,
    walk,
)

ADMIN_TOKEN = "a" * 40
CALIBRATION = {"triage": 1.3, "routing": 0.7}
ALIASES = "fast=default,jev-latest=default"  # a plain alias, and one that takes a hosted name
FUZZ_EXAMPLES = 15  # per operation; the coverage phase adds its own fixed cases
RUN_TIMEOUT_S = 300
TESTS = Path(__file__).parent

CONFIG = f"""\
hooks = "openapi_hooks"
continue-on-failure = true
request-timeout = 30
workers = 1

[generation]
mode = "all"
deterministic = true
max-examples = {FUZZ_EXAMPLES}
database = "none"

[phases.stateful]
enabled = false

[checks]
enabled = true

[checks.positive_data_acceptance]
expected-statuses = ["200"]

[auth.openapi.bearer]
bearer = "{TOKEN}"

[[operations]]
include-path-regex = "^/v1/models"
headers = {{ Authorization = "Bearer {ADMIN_TOKEN}" }}
"""

# Failures schemathesis finds that are server defects reported to the lead and not fixed yet:
# (failure code, operation) -> the defect. Each makes the test an xfail naming it; one that no
# longer happens fails the test, so the entry is removed once the server is fixed.
KNOWN_DEFECTS: dict[tuple[str, str], str] = {}


# Two runs against one server, in this order. `PUT /v1/models/{id}` registers every new id it is
# given, so it runs last: before it, the registered ids (the `model_ids` the document was filled
# with) stay exactly those, and an id outside them is a 404 as the document says.
# Each accepted PUT swaps an engine, and closing one collects garbage (~0.3 s with torch loaded),
# so the PUT run draws fewer examples.
PUT_MODEL = "PUT /v1/models/{model_id}"
PUT_EXAMPLES = 5
RUNS = {
    "all-but-put": ["--exclude-name", PUT_MODEL],
    "put": ["--include-name", PUT_MODEL, "--max-examples", str(PUT_EXAMPLES)],
}


@pytest.fixture(scope="module")
def schemathesis_runs(tmp_path_factory):
    """{run name: (JSON report, CLI output)}, after each run against the one live server."""
    folder = tmp_path_factory.mktemp("schemathesis")
    calibration = folder / "calibration.json"
    calibration.write_text(json.dumps(CALIBRATION))
    env = {
        "SEMIF_CALIBRATION": str(calibration),
        "SEMIF_ADMIN_TOKEN": ADMIN_TOKEN,
        "SEMIF_PARALLEL_SLOTS": "2",
        "SEMIF_MODEL_ALIASES": ALIASES,
    }
    with fake_server(folder, **env) as server:
        status, health, _ = server.request("GET", "/health")
        assert status == 200
        auth = {"Authorization": f"Bearer {TOKEN}"}
        status, models, _ = server.request("GET", "/v1/models", headers=auth)
        assert status == 200
        document = folder / "openapi.json"
        document.write_text(json.dumps(deployment_document(spec(), health, models)))
        config = folder / "schemathesis.toml"
        config.write_text(CONFIG)
        pythonpath = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
        run_env = {
            **os.environ,
            "PYTHONPATH": pythonpath,
            "SEMIF_SCHEMATHESIS_HEALTH": json.dumps(health),
            "NO_COLOR": "1",
        }
        runs = {}
        for name, selection in RUNS.items():
            report_path = folder / f"{name}.json"
            command = [
                sys.executable, "-m", "schemathesis.cli", "--config-file", str(config),
                "run", str(document), "--url", f"http://127.0.0.1:{server.port}", *selection,
                "--report", "json", "--report-json-path", str(report_path),
            ]  # fmt: skip
            finished = subprocess.run(
                command, env=run_env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                cwd=folder,
            )  # fmt: skip
            output = finished.stdout + finished.stderr
            assert report_path.exists(), output
            runs[name] = json.loads(report_path.read_text()), output
        assert server.request("GET", "/health")[0] == 200, "the runs left the server down"
        yield runs


@pytest.mark.server
def test_schemathesis_finds_no_failure(schemathesis_runs):
    found: dict[tuple[str, str], str] = {}  # (code, operation) -> the output that shows it
    for report, output in schemathesis_runs.values():
        assert report["complete"] and report["stop_reason"] == "completed", output
        assert not report["errors"], output
        for failure in report["failures"]:
            found.update({(failure["code"], op): output for op in failure["operations"]})
        if not report["failures"]:
            assert report["exit_code"] == 0, output
    unexpected = found.keys() - KNOWN_DEFECTS.keys()
    outputs = "\n".join(dict.fromkeys(found[key] for key in unexpected))
    assert not unexpected, f"schemathesis failures {sorted(unexpected)}:\n{outputs}"
    fixed = KNOWN_DEFECTS.keys() - found.keys()
    assert not fixed, f"fixed now, remove from KNOWN_DEFECTS: {sorted(fixed)}"
    if found:
        pytest.xfail("; ".join(KNOWN_DEFECTS[key] for key in sorted(found)))


@pytest.mark.server
def test_every_operation_got_valid_requests_through(schemathesis_runs):
    """Each operation was tested, and the filters left each with valid requests that got a 200."""
    tested = sum(report["operations"]["tested"] for report, _ in schemathesis_runs.values())
    assert tested == 11
    accepted: dict[str, int] = {}
    for report, _ in schemathesis_runs.values():
        for operation, phases in report["valid_rates"].items():
            accepted[operation] = sum(phase["accepted"] for phase in phases.values())
    assert len(accepted) == 11 and min(accepted.values()) >= 1, accepted


def test_every_documented_rule_has_a_filter_or_a_reason():
    documented = {rule["id"] for schema in walk(spec()) for rule in schema.get("x-semif-rules", [])}
    assert documented == RULE_FILTERS.keys() | RULES_WITHOUT_FILTER.keys()


def decision(id, options=("a", "b"), **extra):
    return {
        "id": id,
        "question": "q",
        "options": [{"id": option, "description": option} for option in options],
        **extra,
    }


HEALTH = {"max_decisions": 8, "workloads": {"triage": 1.3}}


def choice(criteria):
    return {
        "state": "s",
        "questions": {"c": {"type": "choice", "instructions": "q", "criteria": criteria}},
    }


def choices(*listed):
    question = {"type": "choice", "instructions": "q", "choices": list(listed)}
    return {"input": "s", "questions": [question]}


def scores(*labels):
    question = {"type": "score", "instructions": "q", "levels": [{"label": x} for x in labels]}
    return {"input": "s", "questions": [question]}


def items(*listed):
    return {"input": list(listed), "questions": [{"type": "predicate", "instructions": "q"}]}


def call(kind, call_id):
    field = "arguments" if kind == "function_call" else "input"
    return {"type": kind, "call_id": call_id, "name": "f", field: "{}"}


def output(kind, call_id):
    return {"type": kind, "call_id": call_id, "output": "42"}


def nested(depth):
    """An object `depth` levels deep."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def json_message(*datas):
    return {"role": "user", "content": [{"type": "input_json", "data": data} for data in datas]}


@pytest.mark.parametrize(
    ("rule", "body", "keep"),
    [
        ("unique-option-ids", decision("d", ("a", "b")), True),
        ("unique-option-ids", decision("d", ("a", "a")), False),
        ("unique-option-ids", {"decisions": [decision("d"), decision("e", ("x", "x"))]}, False),
        ("rows-within-max-decisions", decision("d", "abcdefgh", orderings="rotations"), True),
        ("rows-within-max-decisions", decision("d", "abcdefghi", orderings="rotations"), False),
        ("rows-within-max-decisions", decision("d", "abc", orderings="all"), True),  # 6 rows
        ("rows-within-max-decisions", decision("d", "abcd", orderings="all"), False),  # 24 rows
        ("rows-within-max-decisions", {"decisions": [decision(str(i)) for i in range(9)]}, False),
        ("unique-decision-ids", {"decisions": [decision("d"), decision("e")]}, True),
        ("unique-decision-ids", {"decisions": [decision("d"), decision("d")]}, False),
        (
            "unique-decision-ids",
            {"decisions": [decision("d"), decision("d", orderings="rotations")]},
            False,
        ),
        (
            "unique-decision-ids",
            {"decisions": [decision("d#o1"), decision("d", orderings="rotations")]},
            False,
        ),
        (
            "unique-decision-ids",
            {
                "decisions": [
                    decision("d#o0", orderings="rotations"),
                    decision("d", orderings="all"),
                ]
            },
            False,
        ),
        (
            "unique-decision-ids",
            {"decisions": [decision("d", orderings="rotations"), decision("e", orderings="all")]},
            True,
        ),
        ("integer-literals", {"source": "s", "max_tokens": 5, "keep_alive_s": 5.0}, True),
        ("integer-literals", {"source": "s", "max_tokens": 5.0}, False),
        ("integer-literals", {"source": "s", "slots": 2.0}, False),
        ("choice-name-describes-itself", choice({"a": None, "b": "B"}), True),
        ("choice-name-describes-itself", choice({" ": "described", "b": None}), True),
        ("choice-name-describes-itself", choice({" ": None, "b": "B"}), False),
        ("choice-name-describes-itself", choice({"": "", "b": "B"}), False),
        ("choice-name-describes-itself", choice({"": {}, "b": "B"}), True),  # described as {}
        ("unique-choice-values", choices({"value": "a"}, {"value": "b"}), True),
        ("unique-choice-values", choices({"value": "true"}, {"value": True}), True),
        (
            "unique-choice-values",
            choices({"value": "a"}, {"value": "a", "description": "x"}),
            False,
        ),
        ("unique-choice-values", choices({"value": False}, {"value": False}), False),
        (
            "choice-value-describes-itself",
            choices({"value": " ", "description": "x"}, {"value": False}),
            True,
        ),
        ("choice-value-describes-itself", choices({"value": " "}, {"value": "b"}), False),
        (
            "choice-value-describes-itself",
            choices({"value": "", "description": ""}, {"value": "b"}),
            False,
        ),
        (
            "choice-value-describes-itself",
            choices({"value": "a", "description": None}, {"value": ""}),
            False,
        ),
        ("unique-level-labels", scores("low", "high"), True),
        ("unique-level-labels", scores("low", "high", "low"), False),
        ("unique-level-labels", {"input": "s", "questions": [{"type": "predicate"}]}, True),
        ("unique-call-ids", {"input": "text", "questions": []}, True),
        ("unique-call-ids", items(call("function_call", "a"), call("custom_tool_call", "b")), True),
        ("unique-call-ids", items(call("function_call", "c"), call("function_call", "c")), False),
        (
            "unique-call-ids",
            items(call("function_call", "c"), call("custom_tool_call", "c")),
            False,
        ),
        (
            "unique-call-ids",
            items(call("function_call", "c"), output("function_call_output", "c")),
            True,
        ),
        ("tool-output-follows-its-call", {"input": "text", "questions": []}, True),
        (
            "tool-output-follows-its-call",
            items(call("function_call", "c"), output("function_call_output", "c")),
            True,
        ),
        (
            "tool-output-follows-its-call",
            items(output("function_call_output", "c"), call("function_call", "c")),
            False,
        ),
        (
            "tool-output-follows-its-call",
            items(call("function_call", "c"), output("custom_tool_call_output", "c")),
            False,
        ),
        (
            "tool-output-follows-its-call",
            items(
                call("function_call", "c"),
                call("custom_tool_call", "c"),
                output("function_call_output", "c"),
            ),
            False,
        ),
        ("input-depth", {"input": "text", "questions": []}, True),
        ("input-depth", {"input": [], "questions": []}, True),
        # [{"content": {"input_json": data}}]: 3 + 29
        ("input-depth", items(json_message(nested(29))), True),
        ("input-depth", items(json_message(nested(30))), False),
        ("input-depth", items(json_message(nested(28), {})), True),  # content a list: 4 + 28
        ("input-depth", items(json_message(nested(29), {})), False),
    ],
)
def test_each_rule_filter_drops_exactly_the_bodies_that_break_its_rule(rule, body, keep):
    assert RULE_FILTERS[rule](body, HEALTH) is keep


@pytest.mark.parametrize(
    ("state", "depth"),
    [("text", 0), ({"a": 1}, 1), ({"a": [1]}, 2), ([[[]]], 3), ({"a": 1, "b": [{"c": {}}]}, 4)],
)
def test_nesting_depth_counts_levels_of_arrays_and_objects(state, depth):
    assert nesting_depth(state) == depth


def test_the_state_depth_filter_keeps_the_documented_limit():
    document = spec()
    body = request_body_schema(document, "/decide", "post")
    state_depth = body_rules(document, body)["state-depth"]
    deepest: list = [1]
    for _ in range(document["components"]["schemas"]["State"]["x-semif-max-depth"] - 1):
        deepest = [deepest]
    assert state_depth({"state": deepest}, HEALTH)
    assert not state_depth({"state": [deepest]}, HEALTH)


def test_each_operation_gets_the_filters_of_the_rules_its_body_carries():
    document = spec()

    def rules(path, method):
        return set(body_rules(document, request_body_schema(document, path, method)))

    assert rules("/decide", "post") == {
        "unique-option-ids", "rows-within-max-decisions", "state-depth",
    }  # fmt: skip
    assert rules("/decide/shared", "post") == {
        "unique-option-ids", "rows-within-max-decisions", "unique-decision-ids", "state-depth",
    }  # fmt: skip
    assert rules("/v1/models/{model_id}", "put") == {"integer-literals"}
    assert rules("/v1/models/unload", "post") == set()
    assert rules("/v1/systemone", "post") == {"choice-name-describes-itself", "state-depth"}
    assert rules("/v1/decisions", "post") == {
        "unique-choice-values", "choice-value-describes-itself", "unique-level-labels",
        "unique-call-ids", "tool-output-follows-its-call", "input-depth",
    }  # fmt: skip


def test_the_deployment_values_come_from_the_server():
    models = {
        "models": [{"id": "default"}, {"id": "small"}],
        "data": [{"id": "default"}, {"id": "small"}, {"id": "jev-latest", "alias_of": "small"}],
    }
    filled = deployment_document(spec(), HEALTH, models)
    schemas = filled["components"]["schemas"]
    assert schemas["Workload"]["enum"] == ["triage"]
    assert schemas["ModelId"]["enum"] == ["default", "small"]
    assert schemas["ListedModelName"]["enum"] == ["default", "jev-latest", "small"]
    assert schemas["DecideSharedRequest"]["properties"]["decisions"]["maxItems"] == 8
    assert "enum" not in spec()["components"]["schemas"]["Workload"]  # the original is untouched
    without_table = deployment_document(spec(), {**HEALTH, "workloads": {}}, models)
    assert without_table["components"]["schemas"]["Workload"]["not"] == {}
    names = {s["x-semif-deployment"] for s in walk(spec()) if "x-semif-deployment" in s}
    assert names == {"workloads", "max_decisions", "model_ids", "model_names"}
