"""What both ecosystem formats share: questions as direct-options-v1 rows over one state, the
shared calls that score them, and what a reply reads back from the results.

The rules are upstream SemIf's for its own System One layer (../shared/spec/decision-apis.md §3):
each question is one row over the request's state; its instructions are the criterion (a string
as it is, an object or array as JSON in insertion order with non-ASCII kept); empty or missing
instructions are refused; a yes/no question gets the options `true`, `false` with fixed default
descriptions. Unlike upstream, a question may have up to SEMIF_MAX_OPTIONS options (255, the
formats' own limit): more than the 16 letters A..P are scored as option groups (`grouped`); more
than the limit is `option_count_unsupported`, never truncated. Row and option ids are positional
(`q3`, `o1`): the model never sees them, and a name the format allows (empty, or a boolean
choice value) needs no id rules of its own. Top-level fields a format does not name are ignored
(as the hosted services ignore them) and reported back (`ignored_keys`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from semif_serve.apis import grouped
from semif_serve.apis.fields import Field, Segment, as_field, refused, segments
from semif_serve.errors import InvalidRequest, OptionCountUnsupported
from semif_serve.scoring.rows import MIN_OPTIONS

YES = "The answer to the question is yes."
NO = "The answer to the question is no."
CONFIDENCE_FORMULA = "normalized-peak-v1"
FORMAT_OPTION_LIMIT = 255  # what both formats allow per question (SEMIF_MAX_OPTIONS' default)
EXTENSION = "x_semif"  # the per-answer extension block: vendor fields are prefixed x_
LEGACY_EXTENSION = "semif"  # its name until 0.x; SEMIF_LEGACY_EXTENSION_BLOCK=1 adds it
# How a question of more than 16 options is read back: one softmax over its groups' logits, one
# shared call (docs/quality.md measured tournament-16 too: no better, and a second call).
METHOD = grouped.SHARED_NORMALISER
MAX_QUESTIONS = 400  # per request, both formats (OpenAI Decisions' own limit)
TEMPERATURE = 1.0  # the native softmax: uncalibrated
# How the service names a decision in its messages: `decisions[3]`, `decisions[3] (row 'q3')`,
# then the field (`.options[1].description`, `.question`) and the message.
SERVICE_FIELD = re.compile(r"decisions\[(\d+)\](?: \(row '[^']*'\))?(?:\.([^:]*))?: ")
OPTION_FIELD = re.compile(r"options\[(\d+)\](?:\.\w+)?")


@dataclass(frozen=True)
class Mapped:
    """One question as one row over the request's state."""

    where: Field  # how messages name the question: `questions.urgency`, `questions[3]`
    question: str  # the criterion the prompt shows
    descriptions: tuple[str, ...]  # each option's description, in letter order
    # where each came from in the question, as segments: ("criteria", "calm")
    option_fields: tuple[tuple[Segment, ...], ...]


def content_text(content: Any, where: Field) -> str:
    """Instructions or a description as the prompt shows it: a string as it is, an object or an
    array as JSON (keys in the order sent, non-ASCII as it is)."""
    if isinstance(content, str):
        return content
    if isinstance(content, (dict, list)):
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=False)
        except RecursionError:
            raise refused(where, "nested too deeply") from None
    raise refused(where, f"must be a string, object or array, got {type_name(content)}")


def described(content: Any, fallback: str, where: Field) -> str:
    """An option's description: `fallback` when it is null or empty, else `content_text`."""
    return fallback if content is None or content == "" else content_text(content, where)


def instructions_text(content: Any, where: Field) -> str:
    """A question's criterion; missing, null or blank is refused."""
    if content is None:
        raise refused(where, "missing; every question needs instructions")
    text = content_text(content, where)
    if not text.strip():
        raise refused(where, "must not be empty")
    return text


def check_option_count(count: int, where: Field, noun: str, limit: int) -> None:
    """2..`limit` (SEMIF_MAX_OPTIONS) options; more is `option_count_unsupported`."""
    if count > limit:
        raise refused(
            where,
            f"{count} {noun}, over the {limit} this server scores (SEMIF_MAX_OPTIONS; the "
            f"format allows {FORMAT_OPTION_LIMIT}). Nothing is truncated: split the question",
            OptionCountUnsupported,
        )
    if count < MIN_OPTIONS:
        raise refused(where, f"needs at least {MIN_OPTIONS} {noun}, got {count}")


def check_question_count(count: int, where: Field | str = "questions") -> None:
    if not 1 <= count <= MAX_QUESTIONS:
        raise refused(where, f"must hold 1..{MAX_QUESTIONS} questions, got {count}")


YES_NO_FIELDS = (("criteria", "true"), ("criteria", "false"))


def yes_no(where: Field, question: str, yes: str = YES, no: str = NO, fields=None) -> Mapped:
    """A yes/no question: options `true` then `false` (answer = p(true))."""
    return Mapped(where, question, (yes, no), fields or YES_NO_FIELDS)


def shared_bodies(
    state: Any, questions: list[Mapped], routing: dict[str, Any], per_call: int
) -> list[dict[str, Any]]:
    """The `/decide/shared` bodies that score `questions` over `state`: one call, or as many as
    SEMIF_MAX_DECISIONS (`per_call`) needs, in question order."""
    decisions = [
        {
            "id": f"q{index}",
            "question": mapped.question,
            "options": [
                {"id": f"o{k}", "description": text} for k, text in enumerate(mapped.descriptions)
            ],
        }
        for index, mapped in enumerate(questions)
    ]
    return [
        {"state": state, "decisions": decisions[start : start + per_call], **routing}
        for start in range(0, len(decisions), per_call)
    ]


@dataclass(frozen=True)
class Scored:
    """The shared calls' results, one per question in order, and the request's token counts."""

    results: list[dict[str, Any]]
    input_tokens: int  # the state once, plus every question's own tokens
    cached_tokens: int  # of those, the state prefix served from the state-prefix cache
    written_tokens: int  # the state prefix this request stored in the cache


def scored(replies: Iterable[dict[str, Any]]) -> Scored:
    """What the `/decide/shared` replies to `shared_bodies` say, read as one request. The later
    calls resume the prefix the first one prefilled or stored: the state counts once."""
    replies = list(replies)
    results = [result for reply in replies for result in reply["results"]]
    first = replies[0]["timing"]
    prefix = first["prefix_tokens"]
    suffixes = sum(reply["timing"]["true_suffix_tokens"] for reply in replies)
    return Scored(
        results=results,
        input_tokens=prefix + suffixes,
        cached_tokens=first.get("cached_tokens", 0),
        written_tokens=prefix if first.get("prefix_stored") else 0,
    )


def answered(
    state: Any,
    questions: list[Mapped],
    routing: dict[str, Any],
    per_call: int,
    decide_shared: Callable[[dict[str, Any]], dict[str, Any]],
    state_field: str = "state",
) -> Scored:
    """Score `questions` over `state` through `decide_shared` (the service's, one call per
    `shared_bodies` body): a question of more than 16 options as its option groups, read back
    by one softmax (`grouped`, METHOD); a refusal names the question's own fields (`located`)."""
    check_descriptions(questions)
    layout = grouped.plan(questions)
    scored = _rows_scored(state, layout.rows, routing, per_call, decide_shared, state_field)
    return replace(scored, results=grouped.read_back(questions, layout, scored.results, METHOD))


def check_descriptions(questions: list[Mapped]) -> None:
    """Every option described, checked before any call: a request of several calls is refused
    whole, never after its first calls were scored."""
    for question in questions:
        for position, text in enumerate(question.descriptions):
            if not text.strip():
                option = as_field(question.option_fields[position])
                raise refused(
                    Field(*as_field(question.where).path, *option.path), "must be a nonempty string"
                )


def _rows_scored(
    state: Any,
    questions: list[Mapped],
    routing: dict[str, Any],
    per_call: int,
    decide_shared: Callable[[dict[str, Any]], dict[str, Any]],
    state_field: str,
) -> Scored:
    replies = []
    for start, body in zip(
        range(0, len(questions), per_call),
        shared_bodies(state, questions, routing, per_call),
        strict=True,
    ):
        try:
            replies.append(decide_shared(body))
        except InvalidRequest as error:
            raise located(error, questions[start : start + per_call], state_field) from None
    return scored(replies)


def confidence(probabilities: list[float]) -> float:
    """normalized-peak-v1: clamp((n · max p − 1) / (n − 1), 0, 1); 0 for uniform, 1 for certain."""
    n = len(probabilities)
    return min(1.0, max(0.0, (n * max(probabilities) - 1.0) / (n - 1)))


def expected_score(probabilities: list[float]) -> float:
    """Σ i · p_i over the levels 0..n-1."""
    return float(sum(level * p for level, p in enumerate(probabilities)))


def top(probabilities: list[float]) -> int:
    """The first most probable option's position."""
    return max(range(len(probabilities)), key=probabilities.__getitem__)


def readout(result: dict[str, Any], *, with_confidence: bool) -> dict[str, Any]:
    """The per-answer extension block (`x_semif`, which the SDKs ignore): how the answer was
    read, by which method, and by which model."""
    block = {
        "method": result.get("method", grouped.DIRECT),
        "option_logits": result["option_logits"],
        "probabilities": result["probabilities"],
        "prompt_sha256": result["prompt_sha256"],
        "prompt_version": result["prompt_version"],
        "input_tokens": result["input_tokens"],
        "temperature": TEMPERATURE,
        "probability_status": result["probability_status"],
        "cache_hit": result.get("cache_hit"),
        "prefix_sha256": result.get("prefix_sha256"),
        "model": result["model"],
    }
    if "group_prompt_sha256" in result:
        block["group_prompt_sha256"] = result["group_prompt_sha256"]
    if with_confidence:
        block["confidence_formula"] = CONFIDENCE_FORMULA
    return block


def located(error: InvalidRequest, questions: list[Mapped], state_field: str) -> InvalidRequest:
    """The service's refusal of a shared call, naming the question's own fields instead of the
    rows it became (`decisions[3].options[1].description` → `questions.tone.criteria.calm`)."""
    message = str(error)
    if state_field != "state" and message.startswith("state"):
        return type(error)(state_field + message[len("state") :])
    found = SERVICE_FIELD.match(message)
    if found is None or int(found.group(1)) >= len(questions):
        return error
    mapped = questions[int(found.group(1))]
    tail = found.group(2) or ""  # the service's own field names: plain, safe to split
    inside = segments(tail)
    option = OPTION_FIELD.match(tail)
    if option is not None and int(option.group(1)) < len(mapped.option_fields):
        own = as_field(mapped.option_fields[int(option.group(1))]).path
        inside = (*own, *segments(tail[option.end() :]))
    elif tail == "question":
        inside = ("instructions",)
    field = Field(*as_field(mapped.where).path, *inside)
    return refused(field, message[found.end() :], type(error))


def type_name(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number" if isinstance(value, (int, float)) else "value")


def ignored_keys(body: dict[str, Any], known: frozenset[str]) -> tuple[str, ...]:
    """The top-level fields a format does not name, in the order sent: ignored, never refused
    (the SDKs pass extra fields through, e.g. `extra_body={"seed": 7}`)."""
    return tuple(key for key in body if key not in known)


def check_keys(value: Any, allowed: frozenset[str], where: Field) -> dict[str, Any]:
    """`value` as an object with no keys but `allowed`."""
    if not isinstance(value, dict):
        raise refused(where, f"must be an object, got {type_name(value)}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        known = ", ".join(sorted(allowed))
        raise refused(where, f"unknown keys {unknown}; allowed: {known}")
    return value


def refuse_image(where: Field) -> InvalidRequest:
    return refused(where, "images are not supported: this server runs a text-only model")
