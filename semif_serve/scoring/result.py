"""Turn the letter logits of one row into the SemIf result dict (every upstream key)."""

from __future__ import annotations

from typing import Any

import torch

from semif_serve.scoring.prompt import LETTERS, PROMPT_VERSION, EncodedPrompt
from semif_serve.scoring.rows import Row

PROBABILITY_STATUS = "conditional option score; uncalibrated as decision confidence"


def letter_probabilities(letter_logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the option letters' float32 logits only (no other token counts)."""
    return torch.softmax(letter_logits.float(), dim=-1)


def readout(row: Row, probabilities: list[float]) -> str:
    """A one-line human reading of the scores: the top letter, its option id and probability."""
    top = max(range(len(probabilities)), key=probabilities.__getitem__)
    return (
        f"{LETTERS[top]} ({row.options[top].id}) p={probabilities[top]:.3f} "
        f"over {len(probabilities)} option letters, one forward pass"
    )


def build_result(
    row: Row,
    prompt: EncodedPrompt,
    letter_logits: torch.Tensor,
    *,
    model: dict[str, Any],
    forward_seconds: float,
    total_seconds: float,
) -> dict[str, Any]:
    """The result dict of one decision; `letter_logits` is 1-D in option order."""
    logits = letter_logits.float()
    probabilities = letter_probabilities(logits).tolist()
    return {
        "id": row.id,
        "option_ids": row.option_ids,
        "probabilities": probabilities,
        "option_logits": logits.tolist(),
        "input_tokens": len(prompt.ids),
        "forward_seconds": forward_seconds,
        "total_seconds": total_seconds,
        "prompt_sha256": prompt.sha256,
        "prompt_version": PROMPT_VERSION,
        "model": model,
        "readout": readout(row, probabilities),
        "probability_status": PROBABILITY_STATUS,
    }
