"""What docs/openapi.yaml says beyond JSON Schema, made executable for tests/test_schemathesis.py.

The document marks three things JSON Schema cannot say on its own (see its `info.description`):
- `x-semif-deployment: <name>`: a value the running server publishes. `deployment_document`
  fills each one in from `GET /health` and `GET /v1/models`, so the schema holds for that server.
- `x-semif-rules`: rules JSON Schema cannot express (cross-field ones, and how integers are
  written), each `{id, rule}`. A body schemathesis generates as valid that breaks one is not
  valid after all; `RULE_FILTERS[id]` recognises it, and the filter drops it before it is sent.
  Each filter implements the rule of the same id and nothing more; a rule the fake server cannot
  break has its reason in `RULES_WITHOUT_FILTER` instead.
- `x-semif-max-depth`: the most levels `state` may nest; the `state-depth` filter.

Negative cases (generated to break the schema) are never dropped: the server must refuse them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from typing import Any

Body = dict[str, Any]


def walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object in a document (a mapping anywhere in it)."""
    pending = [node]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            yield item
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


# -- x-semif-deployment -------------------------------------------------------------------------


def deployment_values(health: dict[str, Any], models: dict[str, Any]) -> dict[str, dict]:
    """The keywords each `x-semif-deployment` name stands for on this server."""
    workloads = sorted(health["workloads"])
    return {
        # No calibration table: no workload is valid (an empty `enum` is not allowed).
        "workloads": {"enum": workloads} if workloads else {"not": {}},
        "max_decisions": {"maxItems": health["max_decisions"]},
        "model_ids": {"enum": sorted(model["id"] for model in models["models"])},
        # /v1/systemone and /v1/decisions: every model id and every alias (SEMIF_MODEL_ALIASES).
        "model_names": {"enum": sorted(entry["id"] for entry in models["data"])},
    }


def deployment_document(
    document: dict[str, Any], health: dict[str, Any], models: dict[str, Any]
) -> dict[str, Any]:
    """A copy of the document with every `x-semif-deployment` filled in for this server."""
    filled = copy.deepcopy(document)
    values = deployment_values(health, models)
    for schema in walk(filled):
        name = schema.get("x-semif-deployment")
        if name is not None:
            schema.update(values[name])
    return filled


# -- x-semif-rules ------------------------------------------------------------------------------


def _decisions(body: Body) -> list[Body]:
    """The decisions of a /decide body (itself) or of a /decide/shared body."""
    return body["decisions"] if "decisions" in body else [body]


def _row_ids(decision: Body) -> list[str]:
    """The ids of the rows one decision becomes (docs/api.md, "Order averaging")."""
    mode = decision.get("orderings", "none")
    if mode == "none":
        return [decision["id"]]
    count = len(decision["options"])
    orderings = count if mode == "rotations" else math.factorial(count)
    return [f"{decision['id']}#o{index}" for index in range(orderings)]


def unique_option_ids(body: Body, health: dict[str, Any]) -> bool:
    """unique-option-ids: no two options of a decision share an `id`."""
    for decision in _decisions(body):
        ids = [option["id"] for option in decision["options"]]
        if len(set(ids)) != len(ids):
            return False
    return True


def rows_within_max_decisions(body: Body, health: dict[str, Any]) -> bool:
    """rows-within-max-decisions: rows after expanding orderings <= /health max_decisions."""
    rows = sum(len(_row_ids(decision)) for decision in _decisions(body))
    return rows <= health["max_decisions"]


def unique_decision_ids(body: Body, health: dict[str, Any]) -> bool:
    """unique-decision-ids: decision ids and their orderings' row ids (`<id>#o<k>`) share one
    namespace; no id belongs to two decisions."""
    seen: set[str] = set()
    for decision in _decisions(body):
        names = {decision["id"], *_row_ids(decision)}
        if names & seen:
            return False
        seen |= names
    return True


INTEGER_FIELDS = ("max_tokens", "slots")  # of a model table, as the rule names them


def integer_literals(body: Body, health: dict[str, Any]) -> bool:
    """integer-literals: `max_tokens` and `slots` are JSON integers, never `5.0`."""
    return not any(isinstance(body.get(key), float) for key in INTEGER_FIELDS)


# -- /v1/systemone and /v1/decisions (docs/decision-apis.md) -----------------------------------


def _questions(body: Body, kind: str) -> list[Body]:
    """The questions of type `kind` of a /v1/systemone body (by name) or a /v1/decisions body."""
    questions = body.get("questions")
    listed = questions.values() if isinstance(questions, dict) else questions or []
    return [question for question in listed if question.get("type") == kind]


def choice_name_describes_itself(body: Body, health: dict[str, Any]) -> bool:
    """choice-name-describes-itself: a System One choice without a description (null or `""`)
    is described by its name, which must then be non-blank."""
    return all(
        name.strip() or description not in (None, "")
        for question in _questions(body, "choice")
        for name, description in question["criteria"].items()
    )


def unique_choice_values(body: Body, health: dict[str, Any]) -> bool:
    """unique-choice-values: no two choices of a Decisions question share a value; `"true"` and
    `true` are different values."""
    for question in _questions(body, "choice"):
        typed = [(type(choice["value"]), choice["value"]) for choice in question["choices"]]
        if len(set(typed)) != len(typed):
            return False
    return True


def unique_level_labels(body: Body, health: dict[str, Any]) -> bool:
    """unique-level-labels: no two levels of a Decisions score question share a label."""
    for question in _questions(body, "score"):
        labels = [level["label"] for level in question["levels"]]
        if len(set(labels)) != len(labels):
            return False
    return True


def choice_value_describes_itself(body: Body, health: dict[str, Any]) -> bool:
    """choice-value-describes-itself: a Decisions choice without a description (missing, null,
    empty) is described by its value's text, so a string value must then be non-blank."""
    return all(
        choice.get("description") or not isinstance(choice["value"], str) or choice["value"].strip()
        for question in _questions(body, "choice")
        for choice in question["choices"]
    )


TOOL_OUTPUTS = {
    "function_call_output": "function_call",
    "custom_tool_call_output": "custom_tool_call",
}


def unique_call_ids(body: Body, health: dict[str, Any]) -> bool:
    """unique-call-ids: no two tool calls (of either kind) share a call_id."""
    if not isinstance(body["input"], list):
        return True
    ids = [item["call_id"] for item in body["input"] if item.get("type") in TOOL_OUTPUTS.values()]
    return len(set(ids)) == len(ids)


def tool_output_follows_its_call(body: Body, health: dict[str, Any]) -> bool:
    """tool-output-follows-its-call: each tool output's call_id names an earlier call of its
    kind (the latest call with that call_id, should unique-call-ids not hold)."""
    if not isinstance(body["input"], list):
        return True
    latest: dict[str, str] = {}  # call_id -> the type of the latest call with it
    for item in body["input"]:
        kind = item.get("type", "message")
        if kind in TOOL_OUTPUTS.values():
            latest[item["call_id"]] = kind
        elif kind in TOOL_OUTPUTS and latest.get(item["call_id"]) != TOOL_OUTPUTS[kind]:
            return False
    return True


def rendered_depth(item: Any) -> int:
    """Levels of arrays/objects one input item takes in the state docs/decision-apis.md renders:
    a message `{"role", "content"}`, a tool call flat, a tool output `{..., "output"}`; content
    or an output of parts is the list of their renderings (one part: itself), a text part its
    string, `input_json` `{"input_json": data}`, a refusal `{"refusal": text}`."""
    kind = item.get("type", "message")
    if kind in ("function_call", "custom_tool_call"):
        return 1
    content = item["content"] if kind == "message" else item["output"]
    if isinstance(content, str):
        return 1
    parts = [
        1 + nesting_depth(part["data"]) if part["type"] == "input_json"
        else 1 if part["type"] == "refusal"
        else 0
        for part in content
    ]  # fmt: skip
    return 1 + (parts[0] if len(parts) == 1 else 1 + max(parts))


def input_depth(body: Body, health: dict[str, Any]) -> bool:
    """input-depth: the state rendered from `input` nests at most 32 levels."""
    if not isinstance(body["input"], list):
        return True
    return 1 + max((rendered_depth(item) for item in body["input"]), default=0) <= INPUT_MAX_DEPTH


INPUT_MAX_DEPTH = 32  # the state's limit (docs/openapi.yaml State x-semif-max-depth)

RULE_FILTERS: dict[str, Callable[[Body, dict[str, Any]], bool]] = {
    "unique-option-ids": unique_option_ids,
    "rows-within-max-decisions": rows_within_max_decisions,
    "unique-decision-ids": unique_decision_ids,
    "integer-literals": integer_literals,
    "choice-name-describes-itself": choice_name_describes_itself,
    "unique-choice-values": unique_choice_values,
    "choice-value-describes-itself": choice_value_describes_itself,
    "unique-level-labels": unique_level_labels,
    "unique-call-ids": unique_call_ids,
    "tool-output-follows-its-call": tool_output_follows_its_call,
    "input-depth": input_depth,
}
# Rules that need no filter against the fake scorer, and why.
RULES_WITHOUT_FILTER = {
    "prompt-within-max-tokens": "the fake scorer has no tokenizer, so no prompt is too long",
    "source-loadable": "the fake server's engine factory loads any source on any device",
}


def nesting_depth(value: Any) -> int:
    """Levels of arrays/objects: a string or number is 0, `{"a": [1]}` is 2 (no recursion)."""
    deepest = 0
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            depth += 1
            deepest = max(deepest, depth)
            pending.extend((child, depth) for child in _children(item))
    return deepest


def _children(item: dict | list) -> list[Any]:
    return list(item.values()) if isinstance(item, dict) else item


def state_depth_filter(limit: int) -> Callable[[Body, dict[str, Any]], bool]:
    def state_depth(body: Body, health: dict[str, Any]) -> bool:
        """state-depth: `state` nests at most `x-semif-max-depth` levels."""
        return nesting_depth(body["state"]) <= limit

    return state_depth


# -- which rules hold for which request body ----------------------------------------------------


def resolve(document: dict[str, Any], node: Any) -> Any:
    if isinstance(node, dict) and "$ref" in node:
        target: Any = document
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return target
    return node


def reachable(document: dict[str, Any], schema: Any) -> Iterator[dict[str, Any]]:
    """Every schema object reachable from `schema`, following `$ref`s, each once."""
    seen: set[int] = set()
    pending = [schema]
    while pending:
        node = resolve(document, pending.pop())
        if isinstance(node, dict):
            if id(node) in seen:
                continue
            seen.add(id(node))
            yield node
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)


def body_rules(
    document: dict[str, Any], body_schema: dict[str, Any]
) -> dict[str, Callable[[Body, dict[str, Any]], bool]]:
    """The filters for every rule a request body schema carries, by rule id.

    A rule id this module does not know fails loudly: the document and the test must not drift.
    """
    filters: dict[str, Callable[[Body, dict[str, Any]], bool]] = {}
    for schema in reachable(document, body_schema):
        for rule in schema.get("x-semif-rules", []):
            rule_id = rule["id"]
            if rule_id in RULE_FILTERS:
                filters[rule_id] = RULE_FILTERS[rule_id]
            elif rule_id not in RULES_WITHOUT_FILTER:
                raise KeyError(f"docs/openapi.yaml rule {rule_id!r} has no filter here")
        if "x-semif-max-depth" in schema:
            filters["state-depth"] = state_depth_filter(schema["x-semif-max-depth"])
    return filters


def request_body_schema(document: dict[str, Any], path: str, method: str) -> dict | None:
    operation = document["paths"][path][method.lower()]
    body = operation.get("requestBody")
    if body is None:
        return None
    return body["content"]["application/json"]["schema"]
