"""One uncached forward over whole prompts, right-padded to the longest: each row's hidden
state at its last real token (what `head.letter_logits` reads).

Right padding is exact: a causal model's real positions never see the padding after them, and a
linear-attention layer runs left to right; no attention mask, so the kernel is the one a single
row runs (as `direct.last_hidden` pads a bucket). The coalesced scorer runs plain rows this
way, and the shared forward runs its rows this way when no prefix is left to prefill.
"""

from __future__ import annotations

from typing import Any

import torch

from semif_serve.scoring.shapes import PAD_TOKEN_ID, Buckets


def padded_ids(prompts: list[list[int]], buckets: Buckets | None) -> torch.Tensor:
    """The (rows, width) token ids of one batch forward over `prompts`, right-padded to the
    longest; with buckets, `buckets.batch`'s shape: the width bucketed and rows of padding
    tokens added after the real ones (separate rows: no real row sees them; their outputs are
    never read)."""
    rows, width = len(prompts), max(len(ids) for ids in prompts)
    if buckets is not None:
        rows, width = buckets.batch(rows, width)
    input_ids = torch.full((rows, width), PAD_TOKEN_ID, dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return input_ids


def last_hidden_states(
    model: Any, prompts: list[list[int]], buckets: Buckets | None
) -> tuple[torch.Tensor, tuple[int, int]]:
    """(each prompt's last real hidden state, (prompts, hidden_size); the forward's shape: rows
    and width, padding included). Call inside inference_mode."""
    device = model.device
    input_ids = padded_ids(prompts, buckets)
    last = torch.tensor([len(ids) for ids in prompts]) - 1
    hidden = model.get_decoder()(input_ids=input_ids.to(device), use_cache=False)
    rows = hidden.last_hidden_state[torch.arange(len(prompts), device=device), last.to(device)]
    return rows, tuple(input_ids.shape)
