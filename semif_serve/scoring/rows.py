"""Validate one SemIf row `{id, state, question, options}` into an immutable `Row`.

Pure Python, no torch: the HTTP layer and the CLI validate rows before any model work. Every
failure is an `InvalidRow` (a ValueError) whose message starts with the field that failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from semif_serve.state_key import state_json

MIN_OPTIONS = 2
MAX_OPTIONS = 16
MAX_STATE_DEPTH = 32  # arrays/objects inside arrays/objects; a string state has depth 0
OPTION_KEYS = frozenset({"id", "description"})


class RowError(ValueError):
    """A row cannot be scored. `row_index` is its position when a batch of rows was given."""

    def __init__(self, message: str, row_index: int | None = None):
        super().__init__(message)
        self.row_index = row_index


class InvalidRow(RowError):
    """A row does not have the SemIf shape; the message names the field."""


@dataclass(frozen=True)
class Option:
    id: str
    description: str


@dataclass(frozen=True)
class Row:
    id: str
    state: Any
    question: str
    options: tuple[Option, ...]
    # The caller's session (X-Semif-Session, or a Decisions request's prompt_cache_key): its
    # stored state prefixes are reused only by calls of the same session. Never in the prompt.
    cache_key: str | None = None
    # Where the caller marked the end of a prefix it will send again (an OpenAI Decisions
    # `prompt_cache_breakpoint`): character offsets into `state_key`. Never in the prompt.
    breakpoints: tuple[int, ...] = ()

    @property
    def option_ids(self) -> list[str]:
        return [option.id for option in self.options]

    @property
    def state_key(self) -> str:
        """The state as the prompt shows it: rows share a prefix iff their keys are equal."""
        return state_json(self.state)


def as_row(row: Row | dict) -> Row:
    """A `Row` as it is, anything else through `parse_row`."""
    return row if isinstance(row, Row) else parse_row(row)


def parse_row(obj: Any, *, empty_state: bool = False) -> Row:
    """Check `obj` against the SemIf row shape and return it as a `Row`; `empty_state`: a
    blank string, `{}` or `[]` state is allowed (the ecosystem formats allow one)."""
    if not isinstance(obj, dict):
        raise InvalidRow(f"row: must be a JSON object, got {_type_name(obj)}")
    row_id = _nonempty_string(obj, "id", "id")
    question = _nonempty_string(obj, "question", "question")
    state = _state(obj, empty_state)
    options = _options(obj.get("options"))
    return Row(id=row_id, state=state, question=question, options=options)


def _nonempty_string(obj: dict, key: str, field: str) -> str:
    if key not in obj:
        raise InvalidRow(f"{field}: missing")
    value = obj[key]
    if not isinstance(value, str):
        raise InvalidRow(f"{field}: must be a string, got {_type_name(value)}")
    if not value.strip():
        raise InvalidRow(f"{field}: must be a nonempty string")
    return value


def _state(obj: dict, empty_state: bool) -> Any:
    if "state" not in obj:
        raise InvalidRow("state: missing")
    return parse_state(obj["state"], empty_state)


def parse_state(state: Any, empty_state: bool = False) -> Any:
    """Check a decision's `state` (a nonempty string, object or array of finite JSON values,
    nested at most MAX_STATE_DEPTH levels; with `empty_state` it may be empty) and return it;
    InvalidRow naming the field if not."""
    if isinstance(state, str):
        if not state.strip() and not empty_state:
            raise InvalidRow("state: must be a nonempty string, object or array")
    elif isinstance(state, (dict, list)):
        if not state and not empty_state:
            raise InvalidRow("state: must be a nonempty string, object or array")
        _require_finite_json(state, "state")
    else:
        raise InvalidRow(f"state: must be a string, object or array, got {_type_name(state)}")
    return state


def _require_finite_json(state: Any, path: str) -> None:
    """Reject NaN/Infinity, anything json.dumps would not write as standard JSON, and nesting
    deeper than MAX_STATE_DEPTH. A loop over an explicit stack, never recursion: a hostile state
    cannot exhaust the interpreter's stack here (and the prompt's json.dumps stays shallow)."""
    pending: list[tuple[Any, str, int]] = [(state, path, 1)]
    while pending:
        value, where, depth = pending.pop()
        if value is None or isinstance(value, (bool, str, int)):
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidRow(f"{where}: numbers must be finite, got {value!r}")
            continue
        if not isinstance(value, (list, dict)):
            raise InvalidRow(f"{where}: not a JSON value ({_type_name(value)})")
        if depth > MAX_STATE_DEPTH:
            raise InvalidRow(f"state: nested deeper than {MAX_STATE_DEPTH} levels (at {where})")
        if isinstance(value, list):
            items = [(item, f"{where}[{index}]") for index, item in enumerate(value)]
        else:
            for key in value:
                if not isinstance(key, str):
                    raise InvalidRow(f"{where}: object keys must be strings, got {_type_name(key)}")
            items = [(item, f"{where}.{key}") for key, item in value.items()]
        # Reversed onto the stack, so values are checked in document order (first error wins).
        pending.extend((item, name, depth + 1) for item, name in reversed(items))


def _options(options: Any) -> tuple[Option, ...]:
    if options is None:
        raise InvalidRow("options: missing")
    if not isinstance(options, list):
        raise InvalidRow(f"options: must be an array, got {_type_name(options)}")
    if not MIN_OPTIONS <= len(options) <= MAX_OPTIONS:
        raise InvalidRow(
            f"options: must hold {MIN_OPTIONS}..{MAX_OPTIONS} items, got {len(options)}"
        )
    parsed = []
    seen: set[str] = set()
    for index, item in enumerate(options):
        field = f"options[{index}]"
        if not isinstance(item, dict):
            raise InvalidRow(
                f"{field}: must be an object {{id, description}}, got {_type_name(item)}"
            )
        unknown = sorted(set(item) - OPTION_KEYS)
        if unknown:
            raise InvalidRow(f"{field}: unknown keys {unknown}; an option is {{id, description}}")
        option_id = _nonempty_string(item, "id", f"{field}.id")
        description = _nonempty_string(item, "description", f"{field}.description")
        if option_id in seen:
            raise InvalidRow(f"{field}.id: duplicate option id {option_id!r}")
        seen.add(option_id)
        parsed.append(Option(id=option_id, description=description))
    return tuple(parsed)


def _type_name(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    for kind, name in names.items():
        if type(value) is kind:
            return name
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__
