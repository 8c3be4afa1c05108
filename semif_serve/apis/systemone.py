"""TypeSafe's System One (`POST /v1/systemone`, what `typesafe-sdk` sends) onto shared scoring.

A request `{model, state, questions: {name: question}}` is one state and its named questions,
mapped as upstream SemIf maps them (`mapping`): `noul` → options `true`, `false` (a side
without a description gets the fixed default); `choice` → its criteria in the order sent (a null
or empty description is the name itself); `score` → its levels, ids "0".."n-1". `box` questions
and image assets need a vision model: a 422 naming them. A `noul` with no instructions but a
described side asks `NOUL_WITHOUT_INSTRUCTIONS` over its two sides. The reply keys each answer by
its question's name, with `usage` (the state counted once, `output_tokens` 0) and an `x_semif`
block per answer that the SDK ignores. Every float is written as a JSON float (`1.0`, never
`1`): the SDK validates strictly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from semif_serve.apis.fields import Field, refused
from semif_serve.apis.mapping import (
    EXTENSION,
    FORMAT_OPTION_LIMIT,
    NO,
    YES,
    Mapped,
    Scored,
    check_keys,
    check_option_count,
    check_question_count,
    confidence,
    content_text,
    described,
    expected_score,
    instructions_text,
    readout,
    refuse_image,
    top,
    type_name,
    yes_no,
)
from semif_serve.runtime.specs import requested_model

REQUEST_KEYS = frozenset({"model", "state", "questions", "assets", "timeout_s"})
QUESTION_KEYS = {
    "noul": frozenset({"type", "instructions", "criteria"}),
    "choice": frozenset({"type", "instructions", "criteria"}),
    "score": frozenset({"type", "instructions", "criteria"}),
}
NOUL_SIDES = frozenset({"true", "false"})
# What the model is asked for a noul that describes a side but gives no instructions: which of
# the two descriptions holds (the hosted service accepts such a noul).
NOUL_WITHOUT_INSTRUCTIONS = "Which of the two options is true?"


@dataclass(frozen=True)
class Question:
    name: str
    kind: str  # noul, choice, score
    labels: tuple[str, ...]  # choice: the names; score: the legend (each level's text)
    mapped: Mapped


@dataclass(frozen=True)
class Request:
    model: str | None
    state: Any
    questions: list[Question]
    routing: dict[str, Any]  # passed to the service as it is (`timeout_s`)
    session: str | None = None  # System One names none: X-Semif-Session only
    breakpoints: tuple[int, ...] = ()  # nor marks any prefix


def parse(body: dict[str, Any], max_options: int = FORMAT_OPTION_LIMIT) -> Request:
    """The request as questions over one state, each of at most `max_options` options;
    InvalidRequest naming the field otherwise."""
    if body.get("assets") is not None:
        raise refuse_image(Field("assets"))
    if "state" not in body:
        raise refused(Field("state"), "missing")
    model = requested_model(body.get("model"))
    questions = body.get("questions")
    if not isinstance(questions, dict):
        raise refused(Field("questions"), "must be an object {name: question}")
    check_question_count(len(questions))
    parsed = [_question(name, question, max_options) for name, question in questions.items()]
    routing = {"timeout_s": body["timeout_s"]} if "timeout_s" in body else {}
    return Request(model, body["state"], parsed, routing)


def _question(name: str, question: Any, max_options: int) -> Question:
    where = Field("questions", name)  # the name as sent: one segment, whatever it holds
    if not isinstance(question, dict):
        raise refused(where, "must be an object with a type")
    kind = question.get("type")
    if not isinstance(kind, str | None):
        raise refused(where / "type", f"must be a string, got {type_name(kind)}")
    if kind == "box":
        raise refused(
            where,
            "box questions locate things in images, which needs a vision model; this server "
            "runs a text-only model",
        )
    if kind not in QUESTION_KEYS:
        shown = "missing" if kind is None else f"unknown question type {kind!r}"
        raise refused(where / "type", f"{shown}; this server answers noul, choice and score")
    check_keys(question, QUESTION_KEYS[kind], where)
    criteria = question.get("criteria")
    if kind == "noul":
        return Question(name, kind, (), _noul(where, question.get("instructions"), criteria))
    text = instructions_text(question.get("instructions"), where / "instructions")
    if kind == "choice":
        if not isinstance(criteria, dict):
            raise refused(where / "criteria", "must be an object {name: description}")
        check_option_count(len(criteria), where / "criteria", "choices", max_options)
        labels = tuple(criteria)
        descriptions = tuple(
            described(text, label, where / "criteria" / label) for label, text in criteria.items()
        )
        fields = tuple(("criteria", label) for label in labels)
        return Question(name, kind, labels, Mapped(where, text, descriptions, fields))
    if not isinstance(criteria, list):
        raise refused(where / "criteria", "must be an array of levels, from score 0 up")
    check_option_count(len(criteria), where / "criteria", "levels", max_options)
    legend = tuple(
        content_text(level, where / "criteria" / index) for index, level in enumerate(criteria)
    )
    fields = tuple(("criteria", index) for index in range(len(criteria)))
    return Question(name, kind, legend, Mapped(where, text, legend, fields))


def _noul(where: Field, instructions: Any, criteria: Any) -> Mapped:
    """Options `true`, `false`; without instructions, a described side is the question."""
    if criteria is not None:
        check_keys(criteria, NOUL_SIDES, where / "criteria")
    sides = {} if criteria is None else criteria
    yes, no = (sides.get(side) for side in ("true", "false"))
    if _blank(instructions) and not (_blank(yes) and _blank(no)):
        text = NOUL_WITHOUT_INSTRUCTIONS
    else:
        text = instructions_text(instructions, where / "instructions")
    return yes_no(
        where,
        text,
        described(yes, YES, where / "criteria" / "true"),
        described(no, NO, where / "criteria" / "false"),
    )


def _blank(content: Any) -> bool:
    return content is None or (isinstance(content, str) and not content.strip())


def reply(request: Request, scored: Scored, model: str) -> dict[str, Any]:
    """The System One reply: answers by question name, `model` the name the caller asked for."""
    answers = {
        question.name: _answer(question, result)
        for question, result in zip(request.questions, scored.results, strict=True)
    }
    return {
        "model": model,
        "answers": answers,
        "usage": {"input_tokens": scored.input_tokens, "output_tokens": 0},
    }


def _answer(question: Question, result: dict[str, Any]) -> dict[str, Any]:
    probabilities = [float(p) for p in result["probabilities"]]
    if question.kind == "noul":
        answer: dict[str, Any] = {"type": "noul", "noul": probabilities[0]}
    elif question.kind == "choice":
        answer = {
            "type": "choice",
            "choice": question.labels[top(probabilities)],
            "confidence": confidence(probabilities),
            "probabilities": dict(zip(question.labels, probabilities, strict=True)),
        }
    else:
        levels = [str(level) for level in range(len(probabilities))]
        answer = {
            "type": "score",
            "score": expected_score(probabilities),
            "confidence": confidence(probabilities),
            "legend": dict(zip(levels, question.labels, strict=True)),
            "probabilities": dict(zip(levels, probabilities, strict=True)),
        }
    answer[EXTENSION] = readout(result, with_confidence=question.kind != "noul")
    return answer
