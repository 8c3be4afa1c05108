"""`semif-serve score`: score a JSONL file of SemIf rows, one JSON result per line, in input order.

With `shared=True` rows are grouped by exact state (first appearance order) and each group is one
shared call. Every row is validated before the model loads; a bad row stops the run with a
`BatchInputError` naming its line, and `--out` files are only written whole.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from semif_serve.scoring.rows import InvalidRow, Row, parse_row

PROGRESS_MIN_ROWS = 8


class BatchInputError(Exception):
    """The input cannot be scored as given; the message names the file and line."""


@dataclass(frozen=True)
class NumberedRow:
    line: int
    row: Row


def read_rows(path: Path) -> list[NumberedRow]:
    """Parse and validate every nonblank line of a JSONL file."""
    rows = []
    for line_number, obj in json_lines(path, BatchInputError):
        try:
            rows.append(NumberedRow(line_number, parse_row(obj)))
        except InvalidRow as error:
            raise BatchInputError(f"{path}:{line_number}: {error}") from None
    if not rows:
        raise BatchInputError(f"{path}: no rows")
    return rows


def json_lines(path: Path, error: type[Exception]) -> Iterator[tuple[int, Any]]:
    """(line number, value) of every nonblank line of a JSONL file. An unreadable file or a line
    that is not JSON (NaN and Infinity included) raises `error` naming the path and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as failure:
        raise error(f"{path}: cannot read: {failure}") from None
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line, parse_constant=_reject_constant)
        except (json.JSONDecodeError, InvalidRow) as failure:
            raise error(f"{path}:{line_number}: {failure}") from None
        yield line_number, value


def _reject_constant(name: str) -> Any:
    raise InvalidRow(f"NaN and Infinity are not JSON ({name})")


def group_by_state(rows: list[NumberedRow], path: Path) -> list[list[int]]:
    """Indices of rows grouped by exact state; ids must be unique within a group."""
    groups: dict[str, list[int]] = {}
    for index, numbered in enumerate(rows):
        groups.setdefault(numbered.row.state_key, []).append(index)
    for indices in groups.values():
        seen: dict[str, int] = {}
        for index in indices:
            numbered = rows[index]
            if numbered.row.id in seen:
                raise BatchInputError(
                    f"{path}:{numbered.line}: id {numbered.row.id!r} repeats line "
                    f"{seen[numbered.row.id]} with the same state; shared rows need unique ids"
                )
            seen[numbered.row.id] = numbered.line
    return list(groups.values())


def score_file(
    path: Path,
    out: IO[str],
    *,
    score_one: Callable[[Row], dict],
    score_group: Callable[[list[Row]], tuple[list[dict], dict]] | None,
    rows: list[NumberedRow],
    progress: IO[str] | None = None,
) -> None:
    """Write one result per row to `out` in input order; `score_group` set means shared mode."""
    from tqdm import tqdm

    bar = tqdm(
        total=len(rows),
        unit="row",
        file=progress or sys.stderr,
        disable=len(rows) < PROGRESS_MIN_ROWS,
    )
    writer = _OrderedWriter(out)
    with bar:
        if score_group is None:
            for index, numbered in enumerate(rows):
                writer.put(index, _scored(path, numbered, score_one))
                bar.update(1)
            return
        for indices in group_by_state(rows, path):
            group = [rows[index] for index in indices]
            results, _timing = _scored_group(path, group, score_group)
            for index, result in zip(indices, results):
                writer.put(index, result)
            bar.update(len(indices))


def _scored(path: Path, numbered: NumberedRow, score_one: Callable[[Row], dict]) -> dict:
    try:
        return score_one(numbered.row)
    except ValueError as error:
        raise BatchInputError(f"{path}:{numbered.line}: {error}") from None


def _scored_group(
    path: Path, group: list[NumberedRow], score_group: Callable
) -> tuple[list[dict], dict]:
    try:
        return score_group([numbered.row for numbered in group])
    except ValueError as error:
        index = getattr(error, "row_index", None)
        line = group[index].line if index is not None else group[0].line
        raise BatchInputError(f"{path}:{line}: {error}") from None


class _OrderedWriter:
    """Writes results as soon as every earlier row's result has been written."""

    def __init__(self, out: IO[str]):
        self._out = out
        self._pending: dict[int, dict] = {}
        self._next = 0

    def put(self, index: int, result: dict) -> None:
        self._pending[index] = result
        while self._next in self._pending:
            self._out.write(json.dumps(self._pending.pop(self._next), ensure_ascii=False) + "\n")
            self._next += 1
        self._out.flush()


@contextmanager
def output_file(path: Path | None) -> Iterator[IO[str]]:
    """stdout, or a file that appears at `path` only once everything was written."""
    if path is None:
        yield sys.stdout
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(
        "w", encoding="utf-8", dir=path.parent, prefix=f".{path.name}.", delete=False
    )
    try:
        with handle:
            yield handle
        os.replace(handle.name, path)
    finally:
        if os.path.exists(handle.name):
            os.unlink(handle.name)
