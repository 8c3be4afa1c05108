"""`Field`: where in a request a value is, as segments: how a refusal names it.

A refusal's message starts with the field's path (`questions.a: b.criteria.x`), and the error
carries the segments themselves (`InvalidRequest.field`): the HTTP layer builds OpenAI's
`param` and System One's `loc` from them, never by parsing the message back, so a question name
or a choice label holding `:`, `.`, `[` or quotes is one segment, as sent.
"""

from __future__ import annotations

import re

from semif_serve.errors import InvalidRequest

Segment = str | int
PATH_STEP = re.compile(r"\[(\d+)\]|([^.\[\]]+)")  # `.name` or `[index]`


def segments(text: str) -> tuple[Segment, ...]:
    """The segments of a path of plain names (`decisions[3].options[1].description`): for the
    server's own field names only; a name as the caller sent it is never split from text."""
    return tuple(int(index) if index else name for index, name in PATH_STEP.findall(text))


class Field(str):
    """A field's path as text (`questions.tone.criteria[2]`) that keeps its segments (`path`);
    `field / segment` is the field inside it."""

    path: tuple[Segment, ...]

    def __new__(cls, *path: Segment) -> Field:
        text = "".join(
            f"[{segment}]" if isinstance(segment, int) else f".{segment}" if index else segment
            for index, segment in enumerate(path)
        )
        field = super().__new__(cls, text)
        field.path = path
        return field

    def __truediv__(self, segment: Segment) -> Field:
        return Field(*self.path, segment)


def as_field(where: Field | str | tuple[Segment, ...]) -> Field:
    """`where` as a Field: a Field as it is, segments as they are, a text path of plain names
    (the server's own, never a name a caller sent) split at `.` and `[`."""
    if isinstance(where, Field):
        return where
    return Field(*where) if isinstance(where, tuple) else Field(*segments(where))


def refused(where: Field | str, problem: str, kind: type[InvalidRequest] = InvalidRequest):
    """The refusal of field `where`: `<field>: <problem>`, carrying the field's segments."""
    field = as_field(where)
    error = kind(f"{field}: {problem}")
    error.field = field.path
    return error
