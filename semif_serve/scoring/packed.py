"""Attention-only models' shared forward: every suffix packed into rows after ONE prefix cache.

Nothing is replicated per row; a block mask and per-suffix position ids give each suffix token
exactly what its direct prompt would see (see `forward_packed`).
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

import torch

from semif_serve.scoring.head import letter_logits
from semif_serve.scoring.prefill import continue_from, prefilled, reuse_timing
from semif_serve.scoring.prefix_cache import ModelPrefixCache
from semif_serve.scoring.prompt import EncodedPrompt
from semif_serve.scoring.shapes import PAD_TOKEN_ID, Buckets

PACKED_CHUNK_TOKENS = 512


def forward_packed(
    model: Any,
    prefix_ids: list[int],
    prompts: list[EncodedPrompt],
    buckets: Buckets | None,
    prefix_cache: ModelPrefixCache | None,
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Attention-only models: suffixes packed into rows after ONE prefix cache, a chunk at a time.

    A block mask lets each suffix token see the prefix and its own suffix's earlier tokens only,
    and position ids restart at the prefix length for every suffix, so each row computes exactly
    what its direct prompt would. Nothing is replicated, and nothing is padded unless `buckets`
    right-pads each packed row to its length bucket (padding sees only the prefix, and no real
    token sees padding). Rows are packed in
    chunks of about `PACKED_CHUNK_TOKENS`: a packed token also scores (then masks) the other
    suffixes of its chunk, so smaller chunks waste less attention and larger ones make fewer
    forward calls. After each chunk the cache is cut back to the prefix.
    """
    device = model.device
    prefix_length = len(prefix_ids)
    suffixes = [prompt.ids[prefix_length:] for prompt in prompts]
    base_model = model.get_decoder()
    last_hidden = []
    padded_tokens = 0
    prefill_started = perf_counter()
    with (
        torch.inference_mode(),
        prefilled(base_model, model.config, prefix_ids, prefix_cache) as (cache, reuse),
    ):
        prefix_layers = [(layer.keys, layer.values) for layer in cache.layers]
        suffix_started = perf_counter()
        for chunk in chunks(suffixes, PACKED_CHUNK_TOKENS):
            total = sum(len(suffix) for suffix in chunk)
            width = total if buckets is None else buckets.length(total)
            padded_tokens += width
            ids, mask, positions, last = packed_inputs(chunk, prefix_length, model.dtype, width)
            hidden = continue_from(base_model, cache, ids, mask, positions)
            last_hidden.append(hidden[0, last.to(device)])
            for layer, (keys, values) in zip(cache.layers, prefix_layers):
                layer.keys, layer.values = keys, values
        letters = letter_logits(model, torch.cat(last_hidden), prompts)
        suffix_seconds = perf_counter() - suffix_started
    del cache, prefix_layers, hidden, last_hidden
    return letters, {
        **reuse_timing(reuse),
        "prefix_tokens": prefix_length,
        "prefill_seconds": suffix_started - prefill_started,
        "replicate_seconds": 0.0,
        "suffix_forward_seconds": suffix_seconds,
        "padded_suffix_tokens": padded_tokens,  # the real suffix tokens, without buckets
    }


def chunks(suffixes: list[list[int]], tokens: int) -> list[list[list[int]]]:
    """Consecutive runs of suffixes of about `tokens` tokens each (at least one suffix each)."""
    chunks: list[list[list[int]]] = [[]]
    size = 0
    for suffix in suffixes:
        if chunks[-1] and size + len(suffix) > tokens:
            chunks.append([])
            size = 0
        chunks[-1].append(suffix)
        size += len(suffix)
    return chunks


def packed_inputs(
    suffixes: list[list[int]], prefix_length: int, dtype: torch.dtype, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row of `width` tokens (the suffixes, then padding that sees only the prefix):
    token ids, the block mask over prefix + row, position ids, last indices."""
    lengths = [len(suffix) for suffix in suffixes]
    total = sum(lengths)
    tokens = [token for suffix in suffixes for token in suffix]
    ids = torch.tensor([tokens + [PAD_TOKEN_ID] * (width - total)], dtype=torch.long)
    positions = torch.cat([torch.arange(length) for length in lengths + [width - total]])
    positions = positions + prefix_length
    allowed = torch.zeros((width, prefix_length + width), dtype=torch.bool)
    allowed[:, :prefix_length] = True
    start = 0
    for length in lengths:
        block = slice(start, start + length)
        own = slice(prefix_length + start, prefix_length + start + length)
        allowed[block, own] = torch.ones((length, length), dtype=torch.bool).tril()
        start += length
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    last = torch.tensor(lengths).cumsum(0) - 1
    return ids, mask[None, None], positions[None], last
