"""What answers decisions for `evaluate` and `calibrate`: a running server, a local model, or
results saved earlier by `semif-serve score`.

Each gives the `/decide` reply shape for one row and an ordering mode: the native SemIf result
for `none`, else `{id, option_ids, combined, orderings}`. The local backend runs the project's
own scorers and the same order-averaging functions the server uses, with no HTTP in between.
Saved results answer `none` only, by row id.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from semif_serve.client import Client
from semif_serve.decisions import averaged_result, expand
from semif_serve.scoring import ScoringModel, parse_row, score, score_shared


class Backend(Protocol):
    def describe(self) -> dict[str, Any]: ...
    def decide(self, row: dict[str, Any], orderings: str) -> dict[str, Any]: ...


class HttpBackend:
    """POST /decide, one row per request (orderings expand server-side into one shared call)."""

    def __init__(self, client: Client):
        self._client = client

    def describe(self) -> dict[str, Any]:
        return {"url": self._client.base_url, "model": self._client.health().get("model")}

    def decide(self, row: dict[str, Any], orderings: str) -> dict[str, Any]:
        body = row if orderings == "none" else {**row, "orderings": orderings}
        return self._client.decide(body)


class LocalBackend:
    """The direct scorer for `none`; every ordering of a row in one shared call otherwise."""

    def __init__(self, scoring_model: ScoringModel, max_tokens: int):
        self._model = scoring_model
        self._max_tokens = max_tokens

    def describe(self) -> dict[str, Any]:
        return {"model": self._model.info.identity()}

    def decide(self, row: dict[str, Any], orderings: str) -> dict[str, Any]:
        parsed = parse_row(row)
        if orderings == "none":
            return score(self._model, parsed, max_tokens=self._max_tokens)
        rows = expand(parsed, orderings)
        results, _timing = score_shared(self._model, rows, max_tokens=self._max_tokens)
        return averaged_result(parsed.id, parsed.option_ids, results, orderings)


class SavedResults:
    """Native results read back from a `semif-serve score` output file, by row id."""

    def __init__(self, path: Path):
        self._path = path
        self._results = read_results(path)

    def describe(self) -> dict[str, Any]:
        first = next(iter(self._results.values()), {})
        return {"results": str(self._path), "model": first.get("model")}

    def decide(self, row: dict[str, Any], orderings: str) -> dict[str, Any]:
        if orderings != "none":
            raise ValueError(f"{self._path} holds native results only; orderings {orderings!r}")
        if row["id"] not in self._results:
            raise ValueError(f"{self._path} has no result for row {row['id']!r}")
        return self._results[row["id"]]


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """A `semif-serve score` output file (one result per line), by row id."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read: {error}") from None
    results = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            result = json.loads(line)
            results[result["id"]] = result
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{number}: not a `semif-serve score` result") from None
    return results
