"""Turn the letter logits of one row into the SemIf result dict (every upstream key)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from semif_serve.scoring.prompt import LETTERS, PROMPT_VERSION, EncodedPrompt
from semif_serve.scoring.rows import Row

if TYPE_CHECKING:
    import torch

PROBABILITY_STATUS = "conditional option score; uncalibrated as decision confidence"
# SemIf's fixed description of how each scorer reads its logits (the `readout` field).
READOUTS = {
    "direct": "native full-vocabulary last-position logits restricted to declared answer slots",
    "shared": "native selected suffix-position logits",
}


def letter_probabilities(letter_logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the option letters' float32 logits only, computed in float64."""
    import torch  # here, not at the top: the result's constants are read where torch is not

    # float64 as upstream: a float32 softmax misses SemIf's check |sum(p) - 1| < 1e-9 for most
    # logit vectors; float32 → float64 is exact, so only the arithmetic gains precision.
    return torch.softmax(letter_logits.float().double(), dim=-1)


def summary(row: Row, probabilities: list[float]) -> str:
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
    scorer: Literal["direct", "shared"],
    model: dict[str, Any],
    forward_seconds: float,
    total_seconds: float,
) -> dict[str, Any]:
    """The result dict of one decision; `letter_logits` is 1-D in option order, `scorer` the
    path that read them (it picks the `readout`)."""
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
        "readout": READOUTS[scorer],
        "summary": summary(row, probabilities),
        "probability_status": PROBABILITY_STATUS,
    }
