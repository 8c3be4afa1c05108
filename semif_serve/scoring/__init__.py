"""The SemIf direct-options-v1 method: rows → prompts → one forward → letter probabilities.

`score` scores one row from scratch; `score_shared` scores rows over one exact state with the
state prefix computed once. Both raise ValueError (naming the field or guard) for a bad row, and
know nothing of HTTP or of the engine's locking and memory policy.
"""

from semif_serve.scoring.direct import score
from semif_serve.scoring.model import ModelInfo, ScoringModel
from semif_serve.scoring.prompt import LETTERS, PROMPT_VERSION, PromptRejected
from semif_serve.scoring.rows import InvalidRow, Option, Row, RowError, as_row, parse_row
from semif_serve.scoring.shared import SERVING_CONFIG, score_shared

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
