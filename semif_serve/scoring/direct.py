"""The direct scorer: one row, one uncached forward, the letter logits at the last position."""

from __future__ import annotations

from time import perf_counter
from typing import Any

import torch

from semif_serve.scoring.model import ScoringModel
from semif_serve.scoring.prompt import encode_prompt
from semif_serve.scoring.result import build_result
from semif_serve.scoring.rows import Row, as_row


def score(scoring_model: ScoringModel, row: Row | dict, *, max_tokens: int) -> dict[str, Any]:
    """Score one SemIf row; raises ValueError (naming the field or guard) for a bad row."""
    started = perf_counter()
    parsed = as_row(row)
    prompt = encode_prompt(scoring_model.tokenizer, parsed, max_tokens)
    model = scoring_model.model
    input_ids = torch.tensor([prompt.ids], dtype=torch.long, device=model.device)
    letter_ids = torch.tensor(prompt.letter_token_ids, dtype=torch.long, device=model.device)

    forward_started = perf_counter()
    with torch.inference_mode():
        output = model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        letter_logits = output.logits[0, -1].float().index_select(0, letter_ids).cpu()
    forward_seconds = perf_counter() - forward_started

    return build_result(
        parsed,
        prompt,
        letter_logits,
        model=scoring_model.info.as_dict(),
        forward_seconds=forward_seconds,
        total_seconds=perf_counter() - started,
    )
