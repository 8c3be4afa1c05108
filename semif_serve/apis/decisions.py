"""OpenAI Decisions (`POST /v1/decisions`, the `openai` SDK's `client.decisions.create`) onto
shared scoring.

The state is the request's `input`: a string as it is, or an array of items rendered as a JSON
array, one object per item in order (docs/decision-apis.md): a message is `{"role", "content"}`
(content a string, or its parts: text as a string, `input_json` as its data, a refusal as
`{"refusal": text}`; one part stands for itself), a tool call `{"type", "call_id", "name",
"arguments"|"input"}`, a tool output `{"type", "call_id", "output"}`. Item ids and statuses are
not evidence and are left out; every output must follow the call it answers. Images are refused.
Questions map as System One's (`mapping`): `predicate` is a yes/no question (options `true`,
`false` with the default descriptions); `choice` scores its choices in order, each described by
its description or else its value's text, string and boolean values kept apart; `score` scores
its levels, each described by `label: description` (or the label). Answers come back in question
order with their `name`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from semif_serve.apis.fields import Field, refused
from semif_serve.apis.mapping import (
    EXTENSION,
    FORMAT_OPTION_LIMIT,
    Mapped,
    Scored,
    check_keys,
    check_option_count,
    check_question_count,
    confidence,
    content_text,
    expected_score,
    instructions_text,
    readout,
    refuse_image,
    top,
    type_name,
    yes_no,
)
from semif_serve.runtime.specs import requested_model
from semif_serve.session import parse_session
from semif_serve.state_key import state_json

REQUEST_KEYS = frozenset(
    {
        "model",
        "input",
        "questions",
        "prompt_cache_key",
        "prompt_cache_options",
        "safety_identifier",
        "timeout_s",
    }
)
QUESTION_KEYS = {
    "predicate": frozenset({"type", "name", "instructions"}),
    "choice": frozenset({"type", "name", "instructions", "choices"}),
    "score": frozenset({"type", "name", "instructions", "levels"}),
}
CHOICE_KEYS = frozenset({"value", "description"})
LEVEL_KEYS = frozenset({"label", "description"})
ROLES = {  # each role's content parts
    "user": frozenset({"input_text", "input_image", "input_json"}),
    "developer": frozenset({"input_text"}),
    "system": frozenset({"input_text"}),
    "assistant": frozenset({"output_text", "refusal"}),
}
MESSAGE_KEYS = frozenset({"type", "role", "content", "phase", "id", "status"})
TOOL_CALLS = {  # item type: (its field besides call_id and name, the output item's type)
    "function_call": ("arguments", "function_call_output"),
    "custom_tool_call": ("input", "custom_tool_call_output"),
}
TOOL_OUTPUTS = {output: call for call, (_, output) in TOOL_CALLS.items()}
ITEM_METADATA = frozenset({"id", "status", "namespace"})
BREAKPOINT = {"mode": "explicit"}
# An input_json part renders as {"input_json": data}: never the same as a text (a string), a
# refusal ({"refusal": ...}) or several parts (an array), so no two inputs render alike.
JSON_PART = "input_json"


@dataclass(frozen=True)
class Question:
    name: str | None
    kind: str  # predicate, choice, score
    values: tuple[Any, ...]  # choice: the typed values; score: the labels
    mapped: Mapped


@dataclass(frozen=True)
class Request:
    model: str | None
    state: Any
    questions: list[Question]
    routing: dict[str, Any]
    session: str | None = None  # prompt_cache_key: the partition its state prefixes are kept in
    breakpoints: tuple[int, ...] = ()  # where marked input parts end in state_json(state)


def parse(body: dict[str, Any], max_options: int = FORMAT_OPTION_LIMIT) -> Request:
    """The request as questions over one state, each of at most `max_options` choices or
    levels; InvalidRequest naming the field otherwise."""
    model = requested_model(body.get("model"))
    if body.get("safety_identifier") is not None and not isinstance(body["safety_identifier"], str):
        raise refused(Field("safety_identifier"), "must be a string")
    session = parse_session(body.get("prompt_cache_key"), "prompt_cache_key", header=False)
    _cache_options(body.get("prompt_cache_options"))
    if "input" not in body:
        raise refused(Field("input"), "missing")
    questions = body.get("questions")
    if not isinstance(questions, list):
        raise refused(Field("questions"), "must be an array of questions")
    check_question_count(len(questions))
    parsed = [_question(index, question, max_options) for index, question in enumerate(questions)]
    routing = {"timeout_s": body["timeout_s"]} if "timeout_s" in body else {}
    state, breakpoints = marked_ends(rendered_input(body["input"]))
    return Request(model, state, parsed, routing, session, breakpoints)


def _cache_options(options: Any) -> None:
    if options is None:
        return
    check_keys(options, frozenset({"mode", "ttl"}), Field("prompt_cache_options"))
    if options.get("mode") not in (None, "implicit", "explicit"):
        raise refused(Field("prompt_cache_options", "mode"), "must be implicit or explicit")
    if options.get("ttl") not in (None, "30m"):
        raise refused(Field("prompt_cache_options", "ttl"), "must be 30m")


def rendered_input(value: Any) -> Any:
    """The state the prompt shows for `input`: a string as it is, items as a JSON array."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise refused(Field("input"), "must be a string or an array of items")
    calls: dict[str, str] = {}  # call_id -> its call's item type
    return [_item(item, Field("input", index), calls) for index, item in enumerate(value)]


class _Marked(str):
    """An input part's text that carries `prompt_cache_breakpoint` (until `marked_ends`)."""


def marked_ends(state: Any) -> tuple[Any, tuple[int, ...]]:
    """(the rendered state with its marked texts as plain strings, where each marked text ends
    in `state_json(state)`, in order). Each marked text is followed by a sentinel the caller
    cannot know; the sentinels' places in that text, less the sentinels before them, are the
    ends in the state's own."""
    if not isinstance(state, list):
        return state, ()
    sentinel = f"\x00{secrets.token_hex(8)}\x00"
    plain = [_texts(item, str) for item in state]
    found = state_json([_texts(item, lambda text: _sentinel(text, sentinel)) for item in state])
    escaped = state_json(sentinel)[1:-1]
    ends, at = [], found.find(escaped)
    while at >= 0:
        ends.append(at - len(ends) * len(escaped))
        at = found.find(escaped, at + len(escaped))
    return plain, tuple(ends)


def _sentinel(text: Any, sentinel: str) -> Any:
    return text + sentinel if isinstance(text, _Marked) else text


def _texts(item: dict[str, Any], text: Any) -> dict[str, Any]:
    """`item` with `text` applied to each of its content's or output's parts."""
    mapped = dict(item)
    for key in ("content", "output"):
        value = mapped.get(key)
        if isinstance(value, list):
            mapped[key] = [text(part) if isinstance(part, str) else part for part in value]
        elif isinstance(value, str):
            mapped[key] = text(value)
    return mapped


def _item(item: Any, where: Field, calls: dict[str, str]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise refused(where, f"must be an object, got {type_name(item)}")
    kind = item.get("type", "message")
    if not isinstance(kind, str):
        raise refused(where / "type", f"must be a string, got {type_name(kind)}")
    if kind == "message":
        return _message(item, where)
    if kind in TOOL_CALLS:
        field, _ = TOOL_CALLS[kind]
        check_keys(item, frozenset({"type", "call_id", "name", field}) | ITEM_METADATA, where)
        call_id = _string(item, "call_id", where)
        if call_id in calls:
            raise refused(where / "call_id", f"{call_id!r} is already an earlier call's id")
        calls[call_id] = kind
        rendered = {"type": kind, "call_id": call_id, "name": _string(item, "name", where)}
        if isinstance(item.get("namespace"), str):
            rendered["namespace"] = item["namespace"]
        rendered[field] = _string(item, field, where, nonempty=False)
        return rendered
    if kind in TOOL_OUTPUTS:
        check_keys(item, frozenset({"type", "call_id", "output", "id", "status"}), where)
        call_id = _string(item, "call_id", where)
        if calls.get(call_id) != TOOL_OUTPUTS[kind]:
            raise refused(
                where / "call_id", f"{call_id!r} matches no earlier {TOOL_OUTPUTS[kind]} item"
            )
        output = _content(item.get("output"), where / "output", {"input_text", "input_image"})
        return {"type": kind, "call_id": call_id, "output": output}
    raise refused(where / "type", f"unknown input item type {kind!r}")


def _message(item: dict[str, Any], where: Field) -> dict[str, Any]:
    check_keys(item, MESSAGE_KEYS, where)
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise refused(where / "role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    return {"role": role, "content": _content(item.get("content"), where / "content", ROLES[role])}


def _content(content: Any, where: Field, allowed: frozenset[str]) -> Any:
    """A string as it is; parts as a list of their renderings (one part: itself)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise refused(where, "must be a string or a nonempty array of parts")
    parts = [_part(part, where / index, allowed) for index, part in enumerate(content)]
    return parts[0] if len(parts) == 1 else parts


def _part(part: Any, where: Field, allowed: frozenset[str]) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str) or kind not in allowed:
        raise refused(where, f"must be a part of type {', '.join(sorted(allowed))}, got {kind!r}")
    if kind == "input_image":
        raise refuse_image(where)
    if kind == "input_json":
        check_keys(part, frozenset({"type", "data"}), where)
        data = part.get("data")
        if not isinstance(data, (dict, list)):
            raise refused(where / "data", "must be an object or an array of objects")
        for index, entry in enumerate(data if isinstance(data, list) else ()):
            if not isinstance(entry, dict):
                raise refused(where / "data" / index, "must be an object")
        return {JSON_PART: data}
    field = "refusal" if kind == "refusal" else "text"
    # Only an input_text part may mark the end of a reusable prefix (the format's own rule).
    marks = frozenset({"prompt_cache_breakpoint"}) if kind == "input_text" else frozenset()
    check_keys(part, frozenset({"type", field}) | marks, where)
    breakpoint_ = part.get("prompt_cache_breakpoint")
    if breakpoint_ is not None and breakpoint_ != BREAKPOINT:
        raise refused(where / "prompt_cache_breakpoint", 'must be {"mode": "explicit"}')
    text = _string(part, field, where, nonempty=False)
    if kind == "refusal":
        return {"refusal": text}
    return text if breakpoint_ is None else _Marked(text)


def _string(item: dict[str, Any], key: str, where: Field, nonempty: bool = True) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (nonempty and not value.strip()):
        need = "a nonempty string" if nonempty else "a string"
        raise refused(where / key, f"must be {need}")
    return value


def _question(index: int, question: Any, max_options: int) -> Question:
    where = Field("questions", index)
    if not isinstance(question, dict):
        raise refused(where, "must be an object with a type")
    kind = question.get("type")
    if not isinstance(kind, str | None):
        raise refused(where / "type", f"must be a string, got {type_name(kind)}")
    if kind not in QUESTION_KEYS:
        shown = "missing" if kind is None else f"unknown question type {kind!r}"
        raise refused(where / "type", f"{shown}; this server answers predicate, choice and score")
    check_keys(question, QUESTION_KEYS[kind], where)
    name = question.get("name")
    if name is not None and not isinstance(name, str):
        raise refused(where / "name", "must be a string")
    text = _instructions(question.get("instructions"), where / "instructions")
    if kind == "predicate":
        fields = (("instructions",), ("instructions",))
        return Question(name, kind, (), yes_no(where, text, fields=fields))
    if kind == "choice":
        values, descriptions = _choices(question.get("choices"), where / "choices", max_options)
        fields = tuple(("choices", k) for k in range(len(values)))
        return Question(name, kind, values, Mapped(where, text, descriptions, fields))
    labels, descriptions = _levels(question.get("levels"), where / "levels", max_options)
    fields = tuple(("levels", k) for k in range(len(labels)))
    return Question(name, kind, labels, Mapped(where, text, descriptions, fields))


def _instructions(value: Any, where: Field) -> str:
    """A string, or parts: each text as it is and each `input_json` as JSON, one per line."""
    if not isinstance(value, list):
        return instructions_text(value, where)
    if not value:
        raise refused(where, "must not be empty")
    allowed = frozenset({"input_text", "input_image", "input_json"})
    parts = [_part(part, where / index, allowed) for index, part in enumerate(value)]
    # Each input_json part as its data's JSON (a criterion is text: no wrapper needed).
    data = [part[JSON_PART] if isinstance(part, dict) else part for part in parts]
    return instructions_text("\n".join(content_text(part, where) for part in data), where)


def _choices(choices: Any, where: Field, limit: int) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    if not isinstance(choices, list):
        raise refused(where, "must be an array of {value, description}")
    check_option_count(len(choices), where, "choices", limit)
    values, descriptions, seen = [], [], {}
    for index, choice in enumerate(choices):
        at = where / index
        check_keys(choice, CHOICE_KEYS, at)
        value = choice.get("value")
        if not isinstance(value, (str, bool)):
            raise refused(at / "value", "must be a string or a boolean")
        typed = (type(value), value)  # "true" and true are different choices
        if typed in seen:
            raise refused(at / "value", f"{value!r} is already the value of {where}[{seen[typed]}]")
        seen[typed] = index
        description = choice.get("description")
        if description is not None and not isinstance(description, str):
            raise refused(at / "description", "must be a string")
        values.append(value)
        descriptions.append(description or _value_text(value))
    return tuple(values), tuple(descriptions)


def _value_text(value: str | bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


def _levels(levels: Any, where: Field, limit: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if not isinstance(levels, list):
        raise refused(where, "must be an array of {label, description}, lowest first")
    check_option_count(len(levels), where, "levels", limit)
    labels, descriptions, seen = [], [], {}
    for index, level in enumerate(levels):
        at = where / index
        check_keys(level, LEVEL_KEYS, at)
        label = _string(level, "label", at)
        if label in seen:
            raise refused(at / "label", f"{label!r} is already the label of {where}[{seen[label]}]")
        seen[label] = index
        description = level.get("description")
        if description is not None and not isinstance(description, str):
            raise refused(at / "description", "must be a string")
        labels.append(label)
        descriptions.append(f"{label}: {description}" if description else label)
    return tuple(labels), tuple(descriptions)


def reply(request: Request, scored: Scored, model: str) -> dict[str, Any]:
    """The Decision: answers in question order, `model` the name the caller asked for, usage with
    the state-prefix cache's share (`cached_tokens` read from it, `cache_write_tokens` stored)."""
    answers = [
        _answer(question, result)
        for question, result in zip(request.questions, scored.results, strict=True)
    ]
    return {
        "object": "decision",
        "model": model,
        "answers": answers,
        "usage": {
            "input_tokens": scored.input_tokens,
            "input_tokens_details": {
                "cached_tokens": scored.cached_tokens,
                "cache_write_tokens": scored.written_tokens,
            },
            "output_tokens": 0,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": scored.input_tokens,
        },
    }


def _answer(question: Question, result: dict[str, Any]) -> dict[str, Any]:
    probabilities = [float(p) for p in result["probabilities"]]
    answer: dict[str, Any] = {"type": question.kind, "name": question.name}
    if question.kind == "predicate":
        answer["probability"] = probabilities[0]
    elif question.kind == "choice":
        answer["choice"] = question.values[top(probabilities)]
        answer["confidence"] = confidence(probabilities)
        answer["probabilities"] = [
            {"value": value, "probability": p}
            for value, p in zip(question.values, probabilities, strict=True)
        ]
    else:
        answer["score"] = expected_score(probabilities)
        answer["confidence"] = confidence(probabilities)
        answer["probabilities"] = [
            {"label": label, "value": level, "probability": p}
            for level, (label, p) in enumerate(zip(question.values, probabilities, strict=True))
        ]
    answer[EXTENSION] = readout(result, with_confidence=question.kind != "predicate")
    return answer
