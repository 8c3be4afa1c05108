"""Shared-prefix attention: every suffix row attends to ONE copy of the prefix's keys and values.

The shared scorer prefills the state prefix once (batch 1), then runs n suffix rows. A plain
cache would keep the prefix's keys/values copied to every row for the whole forward; here the
attention layers keep them once in a `SharedPrefix`, made visible to `prefix_attention` for one
suffix forward by `attending_to` (a context variable: concurrent calls in other threads are
unaffected, and nothing extra travels through the model's keyword arguments into other layers'
kernels). Inside an attention layer, a few rows at a time get [prefix keys ; own suffix keys]
joined for one stock SDPA call under [all prefix ; the model's own causal/padding mask], so each
row computes what its direct prompt computes, with the same kernel. The joined copy lives for
one SDPA call over at most `ROWS_PER_CALL` rows: memory per extra row does not grow with the
prefix.

Outside `attending_to` the function IS the stock SDPA attention, so registering it as the
model's attention implementation leaves every other forward (direct scoring, the prefill)
unchanged; its masks come from the same SDPA mask function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from semif_serve.scoring.invariant_attention import ATTENTION_NAME as INVARIANT_ATTENTION
from semif_serve.scoring.invariant_attention import invariant_attention

ATTENTION_NAME = "semif_prefix_sdpa"
# Rows whose keys are joined to the prefix in one SDPA call: bounds the transient copy of one
# layer's prefix keys/values to this many rows, however many rows the call scores.
ROWS_PER_CALL = 8


@dataclass
class SharedPrefix:
    """The prefix's keys and values per attention layer index, shape (1, kv_heads, P, head_dim)."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    # (id of the model's mask, first row) -> (that mask, the rows' [all prefix ; own] mask): the
    # forward passes one mask object to every layer, so each layer gets the same joined one (and
    # the invariant kernel its one layout); the mask is held so that its id stays its own.
    masks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


_ACTIVE: ContextVar[SharedPrefix | None] = ContextVar("semif_shared_prefix", default=None)


@contextmanager
def attending_to(shared: SharedPrefix) -> Iterator[None]:
    """Within the block, attention in this thread/context joins `shared`'s prefix."""
    token = _ACTIVE.set(shared)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class SuffixOnlyLayer(DynamicLayer):
    """An attention cache layer for the suffix pass: it stores nothing and returns the suffix's own
    keys and values, which `prefix_attention` joins to the shared prefix's."""

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states


def joining(kernel: Callable[..., tuple[torch.Tensor, None]]) -> Callable[..., Any]:
    """An attention function: `kernel` (transformers' signature) as it is; inside
    `attending_to`, over the shared prefix plus each row's own keys.

    query (n, heads, L, d); key/value: the rows' own (n, kv_heads, L, d); attention_mask: a
    boolean (n, 1, L, L) mask over the own keys (True = may attend). Returns (n, L, heads, d).
    """

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        return _joined(kernel, module, query, key, value, attention_mask, dropout, scaling, kwargs)

    return attention


prefix_attention = joining(sdpa_attention_forward)  # stock SDPA, with the prefix when shared


def _joined(kernel, module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """`kernel` over the rows' own keys; inside `attending_to`, over [prefix ; own keys]."""
    shared_prefix = _ACTIVE.get()
    if shared_prefix is None:
        return kernel(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    prefix_keys = shared_prefix.keys[module.layer_idx]
    prefix_values = shared_prefix.values[module.layer_idx]
    prefix_length = prefix_keys.shape[2]
    outputs = []
    for start in range(0, query.shape[0], ROWS_PER_CALL):
        chunk = slice(start, start + ROWS_PER_CALL)
        rows = query[chunk].shape[0]
        # Only this chunk's view of the prefix is materialised, and only for this layer.
        keys = torch.cat([prefix_keys.expand(rows, -1, -1, -1), key[chunk]], dim=2)
        values = torch.cat([prefix_values.expand(rows, -1, -1, -1), value[chunk]], dim=2)
        output, _ = kernel(
            module,
            query[chunk],
            keys,
            values,
            _joined_mask(shared_prefix, attention_mask, chunk, prefix_length),
            dropout=dropout,
            scaling=scaling,
            softcap=kwargs.get("softcap"),
        )
        outputs.append(output)
    return torch.cat(outputs), None


def _joined_mask(shared_prefix: SharedPrefix, mask: torch.Tensor, chunk: slice, prefix: int):
    """[all `prefix` keys ; the model's own mask] for the rows of `chunk`: made once per mask."""
    key = (id(mask), chunk.start)
    kept = shared_prefix.masks.get(key)
    if kept is None or kept[0] is not mask:
        own = mask[chunk]
        joined = torch.cat([own.new_ones((own.shape[0], 1, own.shape[2], prefix)), own], dim=3)
        kept = shared_prefix.masks[key] = (mask, joined)
    return kept[1]


AttentionInterface.register(ATTENTION_NAME, prefix_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
# The invariant numerics' attention joins a shared prefix the same way (`invariant.install`).
AttentionInterface.register(INVARIANT_ATTENTION, joining(invariant_attention))


def enable_prefix_attention(model: Any) -> bool:
    """Route the model's attention through `prefix_attention` (idempotent). False when the model
    runs another attention kernel than SDPA, whose numerics the fallback would not reproduce."""
    current = model.config._attn_implementation
    if current in (ATTENTION_NAME, INVARIANT_ATTENTION):
        return True
    if current != "sdpa":
        return False
    model.set_attn_implementation(ATTENTION_NAME)
    return model.config._attn_implementation == ATTENTION_NAME
