"""The SemIf direct-options-v1 method: rows → prompts → one forward → letter probabilities.

`score` scores one row from scratch; `score_shared` scores rows over one exact state with the
state prefix computed once. Both raise ValueError (naming the field or guard) for a bad row, and
know nothing of HTTP or of the engine's locking and memory policy.

`score`, `score_shared` and `SERVING_CONFIG` are imported on first use: they bring torch (about
2.5 s of CPU), and the HTTP layer, the translators, the CLI's parser and servers over a fake
scorer only need the rows and prompts.
"""

from importlib import import_module
from typing import TYPE_CHECKING

from semif_serve.scoring.model import ModelInfo, ScoringModel
from semif_serve.scoring.prompt import LETTERS, PROMPT_VERSION, PromptRejected
from semif_serve.scoring.rows import InvalidRow, Option, Row, RowError, as_row, parse_row

if TYPE_CHECKING:
    from semif_serve.scoring.direct import score
    from semif_serve.scoring.shared import SERVING_CONFIG, score_shared

_WITH_TORCH = {
    "score": "semif_serve.scoring.direct",
    "score_shared": "semif_serve.scoring.shared",
    "SERVING_CONFIG": "semif_serve.scoring.shared",
}


def __getattr__(name: str):
    if name in _WITH_TORCH:
        return getattr(import_module(_WITH_TORCH[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LETTERS",
    "PROMPT_VERSION",
    "SERVING_CONFIG",
    "InvalidRow",
    "ModelInfo",
    "Option",
    "PromptRejected",
    "Row",
    "RowError",
    "ScoringModel",
    "as_row",
    "parse_row",
    "score",
    "score_shared",
]
