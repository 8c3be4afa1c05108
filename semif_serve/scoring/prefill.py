"""The prefix stage both shared forwards build on: prefill a state prefix once (or resume a
stored prefill of it) and continue the decoder after it (`head.letter_logits` reads the rows).

`shared._forward` (models with linear-attention layers: the prefix replicated per row) and
`packed.forward_packed` (attention-only models: suffixes packed into rows after one prefix) use
these; both consume the cache `prefilled` yields.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache

from semif_serve.scoring.cache import has_linear_layers, linear_checkpoint
from semif_serve.scoring.checkpoints import LINEAR_CHUNK_TOKENS, chunk_start
from semif_serve.scoring.prefix_cache import ModelPrefixCache, Reuse
from semif_serve.scoring.shapes import Buckets


@contextmanager
def prefilled(
    base_model: Any,
    config: Any,
    prefix_ids: list[int],
    prefix_cache: ModelPrefixCache | None,
) -> Iterator[tuple[Any, Reuse]]:
    """(the prefix's cache for the block to consume, what of it came from a stored prefill)."""

    def run(base: Any, start: int, stops: list[int]) -> tuple[Any, dict[int, Any]]:
        return prefill(base_model, config, prefix_ids, base_model.device, base, start, stops)

    if prefix_cache is None:
        yield run(None, 0, [])[0], Reuse()
        return
    with prefix_cache.resume(prefix_ids, run, linear_chunk(config)) as resumed:
        yield resumed


def linear_chunk(config: Any) -> int:
    """Where a prefill of a model of `config` may stop, and a continuation resume it, with
    every token getting the bits one pass gives it: at multiples of the delta rule's chunk
    (`checkpoints.LINEAR_CHUNK_TOKENS`) for a model with linear-attention layers, anywhere (1)
    for any other."""
    layer_types = getattr(config, "layer_types", None) or ()
    return LINEAR_CHUNK_TOKENS if "linear_attention" in layer_types else 1


def prefill_length(config: Any, length: int, buckets: Buckets | None = None) -> int:
    """How many of a `length`-token prefix's ids a shared forward prefills (its suffixes go on
    from there): with shape buckets (CUDA), a prefix bucket's worth (`Buckets.prefix`: the
    prefills warm-up ran); otherwise those before the `linear_chunk` the prefix ends in (all of
    them for an attention-only model), where every token gets the bits one pass gives it."""
    if buckets is not None:
        return buckets.prefix(length)
    return chunk_start(length, linear_chunk(config))


def reuse_timing(reuse: Reuse) -> dict[str, Any]:
    """A forward's timing fields for its prefix: whether all of it was stored (`cache_hit`),
    whether this call stored it, how many of its tokens were resumed, and from what point."""
    return {
        "cache_hit": reuse.hit,
        "prefix_stored": reuse.stored,
        "cached_tokens": reuse.tokens,
        "reuse_point": reuse.point,
    }


def result_reuse(timing: dict[str, Any] | None) -> dict[str, Any]:
    """A direct result's reuse fields, from its forward's `timing` (None: it ran no prefix):
    `cache_hit`, `cached_tokens` and `reuse_point` as `reuse_timing` gave them."""
    if timing is None:
        timing = reuse_timing(Reuse())
    return {key: timing[key] for key in ("cache_hit", "cached_tokens", "reuse_point")}


def prefill(
    base_model: Any,
    config: Any,
    prefix_ids: list[int],
    device: torch.device,
    base: Any = None,
    start: int = 0,
    stops: Sequence[int] = (),
) -> tuple[Any, dict[int, Any]]:
    """The prefix's cache, batch 1 (call inside inference_mode), and its linear checkpoints.

    From `base` (a cache positioned after `prefix_ids[:start]`; None: an empty one) the rest is
    prefilled in pieces that end at each of `stops`, where a model with linear-attention layers
    has its states copied (`cache.linear_checkpoint`); attention-only models run in one piece."""
    cache = DynamicCache(config=config) if base is None else base
    recurrent = has_linear_layers(cache)  # DynamicCache(config=...) made its layers
    ends = [stop for stop in stops if start < stop < len(prefix_ids)] if recurrent else []
    checkpoints = {}
    for end in [*ends, len(prefix_ids)]:
        if end > start:
            piece = torch.tensor([prefix_ids[start:end]], dtype=torch.long, device=device)
            base_model(input_ids=piece, cache=cache, use_cache=True)
        if end < len(prefix_ids):
            checkpoints[end] = linear_checkpoint(cache)
        start = end
    synchronize(device)
    return cache, checkpoints


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
