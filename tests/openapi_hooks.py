"""schemathesis hooks for tests/test_schemathesis.py, loaded by the schemathesis CLI it starts.

One hook: `filter_case` drops a generated *valid* request body that breaks one of the document's
`x-semif-rules` (or `state`'s `x-semif-max-depth`), each through the filter named after the rule
(openapi_rules.RULE_FILTERS). Invalid (negative) cases always go out: the server must refuse them.
The server's /health reply comes in SEMIF_SCHEMATHESIS_HEALTH (JSON).
"""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis
from openapi_rules import body_rules, request_body_schema

HEALTH = json.loads(os.environ["SEMIF_SCHEMATHESIS_HEALTH"])
_rules_by_operation: dict[tuple[str, str], dict[str, Any]] = {}


def _rules(document: dict[str, Any], path: str, method: str) -> dict[str, Any]:
    key = (path, method)
    if key not in _rules_by_operation:
        schema = request_body_schema(document, path, method)
        _rules_by_operation[key] = body_rules(document, schema) if schema else {}
    return _rules_by_operation[key]


@schemathesis.hook
def filter_case(context, case) -> bool:
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return True
    if not isinstance(case.body, dict):
        return True
    operation = case.operation
    rules = _rules(operation.schema.raw_schema, operation.path, operation.method.lower())
    return all(keep(case.body, HEALTH) for keep in rules.values())
