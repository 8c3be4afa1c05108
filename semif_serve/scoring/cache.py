"""Replicate a batch-1 prefix cache to n rows, for every layer kind Qwen3.5 and Llama use.

`DynamicCache.batch_repeat_interleave` does not handle `LinearAttentionLayer` (Qwen3.5's Gated
DeltaNet conv and recurrent states), so each layer's tensors are repeated along dim 0 here. The
repeats are real copies: the linear-attention layers update their states in place.
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin


def replicate_cache(cache: Any, rows: int) -> None:
    """Turn a cache holding one sequence into one holding `rows` identical sequences, in place."""
    for index, layer in enumerate(cache.layers):
        known = False
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            _repeat_states(layer.conv_states, rows)
            _repeat_states(layer.recurrent_states, rows)
            known = True
        if isinstance(layer, DynamicLayer):
            DynamicLayer.batch_repeat_interleave(layer, rows)
            known = True
        if not known:
            raise TypeError(f"cannot replicate cache layer {index} of type {type(layer).__name__}")


def _repeat_states(states: dict[int, Any], rows: int) -> None:
    for key, tensor in states.items():
        if tensor is not None:
            states[key] = tensor.repeat_interleave(rows, dim=0)
