"""Hold replies to docs/openapi.yaml: validate a body against the documented schema."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator

SPEC_PATH = Path(__file__).parent.parent / "docs" / "openapi.yaml"


@cache
def spec() -> dict:
    return yaml.safe_load(SPEC_PATH.read_text())


def schema_for(path: str, method: str, status: int) -> dict:
    """The documented response schema; errors without their own entry use the envelope."""
    responses = spec()["paths"][path][method.lower()]["responses"]
    entry = responses.get(str(status), {"$ref": "#/components/responses/Error"})
    if "$ref" in entry:
        entry = spec()["components"]["responses"][entry["$ref"].rsplit("/", 1)[-1]]
    return entry["content"]["application/json"]["schema"]


def validate(schema: dict, instance) -> None:
    # The whole document is the root, so "#/components/..." references resolve.
    Draft202012Validator({**spec(), **schema}).validate(instance)


def validate_reply(path: str, method: str, status: int, body) -> None:
    validate(schema_for(path, method, status), body)


def validate_request(path: str, body, method: str = "post") -> None:
    request = spec()["paths"][path][method]["requestBody"]["content"]["application/json"]
    validate(request["schema"], body)
