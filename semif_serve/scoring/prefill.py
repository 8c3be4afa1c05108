"""The prefix stage both shared forwards build on: prefill a state prefix once (or resume a
stored prefill of it) and continue the decoder after it (`head.letter_logits` reads the rows).

`shared._forward` (models with linear-attention layers: the prefix replicated per row) and
`packed.forward_packed` (attention-only models: suffixes packed into rows after one prefix) use
these; both consume the cache `prefilled` yields.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache

from semif_serve.scoring.prefix_cache import ModelPrefixCache


@contextmanager
def prefilled(
    base_model: Any,
    config: Any,
    prefix_ids: list[int],
    prefix_cache: ModelPrefixCache | None,
) -> Iterator[tuple[Any, bool]]:
    """(the prefix's cache for the block to consume, whether it was stored before, whether
    this call stored it)."""

    def run() -> Any:
        return prefill(base_model, config, prefix_ids, base_model.device)

    if prefix_cache is None:
        yield run(), False, False
        return
    with prefix_cache.resume(prefix_ids, run) as resumed:
        yield resumed


def prefill(base_model: Any, config: Any, prefix_ids: list[int], device: torch.device) -> Any:
    """The prefix's cache, batch 1 (call inside inference_mode)."""
    cache = DynamicCache(config=config)
    base_model(
        input_ids=torch.tensor([prefix_ids], dtype=torch.long, device=device),
        cache=cache,
        use_cache=True,
    )
    synchronize(device)
    return cache


def continue_from(
    base_model: Any,
    cache: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """The decoder's last hidden states for tokens that continue the cached prefix."""
    device = base_model.device
    return base_model(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        cache=cache,
        use_cache=True,
    ).last_hidden_state


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so the phase timings measure the phase, not the launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
