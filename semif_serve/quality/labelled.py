"""Read labelled decisions: a SemIf row plus `gold`, `family`, `group` (and for perturbations
`source_id`, `variant`), checked once, with the clean row kept apart for sending.

The server and the row validator reject unknown keys, so the labels never travel: `row` holds
exactly `{id, state, question, options}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from semif_serve.score_file import json_lines
from semif_serve.scoring.prompt import LETTERS
from semif_serve.scoring.rows import InvalidRow, parse_row

ROW_KEYS = ("id", "state", "question", "options")
VARIANTS = ("reversed", "reworded", "context")


class LabelledDataError(ValueError):
    """A labelled file cannot be used as given; the message names the file and line."""


@dataclass(frozen=True)
class LabelledRow:
    row: dict[str, Any]  # {id, state, question, options}: what a scorer or server receives
    gold: str
    family: str
    group: str
    source_id: str | None = None
    variant: str | None = None

    @property
    def id(self) -> str:
        return self.row["id"]

    @property
    def option_ids(self) -> list[str]:
        return [option["id"] for option in self.row["options"]]

    @property
    def cluster(self) -> tuple[str, str]:
        """The unit the bootstrap and the out-of-fold split keep whole: rows sharing a state."""
        return (self.family, self.group)

    @property
    def gold_position(self) -> str:
        """The gold option's letter in the row's own order (A, B, C, ...)."""
        return self.position_of(self.gold)

    def position_of(self, option_id: str) -> str:
        return LETTERS[self.option_ids.index(option_id)]


def read_labelled(paths: list[Path]) -> list[LabelledRow]:
    """Every labelled row of `paths`, in file order; ids must be unique across all files."""
    rows: list[LabelledRow] = []
    seen: dict[str, str] = {}
    for path in paths:
        for line_number, obj in json_lines(path, LabelledDataError):
            where = f"{path}:{line_number}"
            try:
                labelled = _labelled(obj)
            except (InvalidRow, LabelledDataError) as error:
                raise LabelledDataError(f"{where}: {error}") from None
            if labelled.id in seen:
                raise LabelledDataError(f"{where}: id {labelled.id!r} repeats {seen[labelled.id]}")
            seen[labelled.id] = where
            rows.append(labelled)
    if not rows:
        raise LabelledDataError(f"{', '.join(map(str, paths))}: no rows")
    return rows


def originals(rows: list[LabelledRow]) -> list[LabelledRow]:
    """The rows that are not perturbations of another row."""
    return [labelled for labelled in rows if labelled.source_id is None]


def _labelled(obj: Any) -> LabelledRow:
    if not isinstance(obj, dict):
        raise LabelledDataError("each line must be a JSON object")
    row = {key: obj[key] for key in ROW_KEYS if key in obj}
    parse_row(row)  # the same shape rules as the server
    option_ids = [option["id"] for option in row["options"]]
    gold = _text(obj, "gold")
    if gold not in option_ids:
        raise LabelledDataError(f"gold: {gold!r} is not one of the option ids {option_ids}")
    source_id = obj.get("source_id")
    variant = obj.get("variant")
    if (source_id is None) != (variant is None):
        raise LabelledDataError("source_id and variant come together (a perturbation has both)")
    if source_id is not None:
        source_id = _text(obj, "source_id")
        if variant not in VARIANTS:
            raise LabelledDataError(
                f"variant: must be one of {', '.join(VARIANTS)}, got {variant!r}"
            )
    return LabelledRow(
        row=row,
        gold=gold,
        family=_text(obj, "family"),
        group=str(_required(obj, "group")),
        source_id=source_id,
        variant=variant,
    )


def _required(obj: dict, key: str) -> Any:
    if key not in obj or obj[key] is None:
        raise LabelledDataError(f"{key}: missing")
    return obj[key]


def _text(obj: dict, key: str) -> str:
    value = _required(obj, key)
    if not isinstance(value, str) or not value.strip():
        raise LabelledDataError(f"{key}: must be a nonempty string, got {value!r}")
    return value


def read_plain_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file as `{id, state, question, options}`, any labels dropped."""
    rows = []
    for line_number, obj in json_lines(path, LabelledDataError):
        if not isinstance(obj, dict):
            raise LabelledDataError(f"{path}:{line_number}: each line must be a JSON object")
        row = {key: obj[key] for key in ROW_KEYS if key in obj}
        try:
            parse_row(row)
        except InvalidRow as error:
            raise LabelledDataError(f"{path}:{line_number}: {error}") from None
        rows.append(row)
    if not rows:
        raise LabelledDataError(f"{path}: no rows")
    if len({row["id"] for row in rows}) != len(rows):
        raise LabelledDataError(f"{path}: row ids must be unique")
    return rows
