"""`Engine`: the one object that runs scorer calls, one at a time, and maps their failures.

The engine owns the process-wide lock (INV-2: scorer calls never overlap) and the failure
policy: a ValueError is the caller's fault and passes through; `OutOfMemory` passes through;
anything else is logged with its traceback and re-raised unchained as `ScoringFailed`, so the
failed call's frames (and tensors) are not kept alive by the exception.

`TorchScorer` adapts the scoring functions to the engine; `load_engine` builds one from
settings and proves it with a warm-up decision (INV-3).
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from semif_serve.errors import OutOfMemory, ScoringFailed
from semif_serve.scoring.rows import Row, parse_row

log = logging.getLogger(__name__)

WARM_UP_ROW = {
    "id": "warm-up",
    "state": "The service is starting.",
    "question": "Is the service starting?",
    "options": [{"id": "yes", "description": "Yes"}, {"id": "no", "description": "No"}],
}


class Scorer(Protocol):
    """What the engine drives: the torch scorer in production, fakes in tests."""

    def model_info(self) -> dict[str, Any]: ...
    def score(self, row: Row) -> dict[str, Any]: ...
    def score_shared(self, rows: list[Row]) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...


class Engine:
    def __init__(self, scorer: Scorer):
        self._scorer = scorer
        self._lock = threading.Lock()

    def model_info(self) -> dict[str, Any]:
        return self._scorer.model_info()

    def score(self, row: Row) -> dict[str, Any]:
        return self._call(self._scorer.score, row)

    def score_shared(self, rows: list[Row]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return self._call(self._scorer.score_shared, rows)

    def _call(self, method: Callable, argument: Any) -> Any:
        with self._lock:
            try:
                return method(argument)
            except (ValueError, OutOfMemory):
                raise
            except Exception as error:
                log.exception("scorer call failed")
                message = f"scoring failed: {type(error).__name__}: {error}"
            # Outside the except block: the traceback and its frames are gone before we collect.
            gc.collect()
            raise ScoringFailed(message)


class TorchScorer:
    """The direct and shared scorers over one loaded model, with the server's max_tokens."""

    def __init__(self, scoring_model: Any, max_tokens: int):
        self._model = scoring_model
        self._max_tokens = max_tokens

    def model_info(self) -> dict[str, Any]:
        info = self._model.info
        return {
            "source": info.source,
            "revision": info.revision,
            "dtype": info.dtype,
            "device": info.device,
        }

    def score(self, row: Row) -> dict[str, Any]:
        from semif_serve.scoring import score

        return score(self._model, row, max_tokens=self._max_tokens)

    def score_shared(self, rows: list[Row]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        from semif_serve.scoring import score_shared

        return score_shared(self._model, rows, max_tokens=self._max_tokens)


def load_engine(settings: Any) -> Engine:
    """Load the configured model and score one warm-up decision; any failure stops startup."""
    from semif_serve.loading import load_model

    scoring_model = load_model(
        settings.model,
        settings.revision,
        dtype=settings.dtype,
        device=settings.device,
        cache_dir=settings.cache_dir,
    )
    engine = Engine(TorchScorer(scoring_model, settings.max_tokens))
    engine.score(parse_row(WARM_UP_ROW))
    return engine
