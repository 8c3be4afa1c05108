"""Batch-invariant attention on the CPU: a query row's output has the same bits whatever else
the call holds (other rows, other queries, more keys, keys a sliding-window cache cut).

torch's CPU flash attention splits the keys into blocks of `min(512, keys)` and the queries into
blocks of 32, 64 or 256 by the call's query count, and a row's sums follow those blocks. So
`_sdpa_tiles` gives every query position the same call wherever it runs: the queries are cut
into SDPA_QUERIES blocks aligned to positions (padding queries fill the first and the last), one
call a block (under 192 queries, so torch keeps 32-query blocks), over the keys aligned to
SDPA_BLOCK positions from the first block any of its queries may see through the block's last
position (masked keys fill what a cache does not hold: before a sliding window's first key,
after a prefill's last). A query's keys, but for whole blocks it may not see, are then a
function of its position alone, its blocks fall where they always do, and a block a row may
not see changes nothing in its online softmax (its weights are exact zeros and its running
maximum stays). The calls skip what causal masking hides, but for one query block: about the
work of torch's own causal call. SDPA has no soft-capping: for Gemma2's `_blocked` runs the
same online softmax itself in float32 over KEY_BLOCK-key blocks, with fixed-width matmuls
(`invariant.row_policy` for the row count) and exponentials over whole vectors (`_exp`: torch
computes a tensor's tail elements with the scalar function, which may round differently).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "semif_invariant"
SDPA_BLOCK = 512  # torch's CPU flash attention's key block (fewer keys: one block of them all)
SDPA_QUERIES = 32  # queries per call: its query block for calls of fewer than 192 queries
KEY_BLOCK = 64  # `_blocked`'s key block
QUERY_TILE = 256  # `_blocked`'s queries per pass


def invariant_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention as transformers calls it: query (n, heads, Lq, d), key/value (n, kv_heads, Lk,
    d), a boolean mask (n or 1, 1, Lq, Lk; True = may attend) or None (causal, the queries being
    the last Lq positions). Returns (n, Lq, heads, d) in the query's dtype."""
    rows, heads, queries, width = query.shape
    keys = key.shape[2]
    scaling = width**-0.5 if scaling is None else scaling
    mask = _boolean_mask(attention_mask, rows, queries, keys, query.device)
    start = _first_key_position(kwargs.get("position_ids"), queries, keys)
    kv_heads = key.shape[1]
    if softcap is None and sdpa_is_invariant(query.dtype, heads, kv_heads, width):
        output = _sdpa_tiles(query, key, value, mask, scaling, start, attention_mask)
    else:
        output = _blocked(query, key, value, mask, scaling, softcap, start)
    return output.transpose(1, 2).contiguous(), None


@cache
def sdpa_is_invariant(dtype: torch.dtype, heads: int, kv_heads: int, width: int) -> bool:
    """Whether `_sdpa_tiles` gives a query row the same bits on this CPU whatever the call holds,
    probed once per dtype and head shape: the last 100 of 700 causal queries alone, inside all
    700, and as the second row of a batch whose other row runs 900 keys (its own padded). torch's
    kernels differ by CPU (oneDNN packs keys on AMX); where the probe fails, `_blocked` runs
    instead, whose invariance rests on `invariant.row_policy`'s own probe."""
    generator = torch.Generator().manual_seed(heads * 131 + width)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(dtype)

    query, key, value = (
        draw(1, heads, 700, width),
        draw(1, kv_heads, 700, width),
        draw(1, kv_heads, 700, width),
    )
    scale = width**-0.5
    with torch.inference_mode():
        whole = _sdpa_tiles(query, key, value, _boolean_mask(None, 1, 700, 700, "cpu"), scale, 0)
        tail = _sdpa_tiles(
            query[:, :, 600:], key, value, _boolean_mask(None, 1, 100, 700, "cpu"), scale, 0
        )
        others = (
            draw(2, heads, 900, width),
            draw(2, kv_heads, 900, width),
            draw(2, kv_heads, 900, width),
        )
        for batch, mine in zip(others, (query, key, value)):
            batch[1, :, :700] = mine[0]
        mask = _boolean_mask(None, 2, 900, 900, "cpu").clone()
        mask[1, :, :, 700:] = False  # the second row is padding after its 700 tokens
        batched = _sdpa_tiles(*others, mask, scale, 0)
    return torch.equal(whole[:, :, 600:], tail) and torch.equal(batched[1:, :, :700], whole)


def _blocked(query, key, value, mask, scaling, softcap, start) -> torch.Tensor:
    """The online softmax in float32 over KEY_BLOCK-key blocks; (n, heads, Lq, d)."""
    rows, heads, queries, width = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    # Blocks start at multiples of KEY_BLOCK in positions, wherever the keys start (a
    # sliding-window cache keeps only the last keys): masked keys fill both ends.
    before = start % KEY_BLOCK
    after = -(before + keys) % KEY_BLOCK
    key = F.pad(key.float(), (0, 0, before, after))
    value = F.pad(value.float(), (0, 0, before, after))
    mask = F.pad(mask, (before, after), value=False)
    # (rows, kv_heads, groups, Lq, d): each key/value head with the query heads that read it.
    grouped = query.float().reshape(rows, kv_heads, groups, queries, width)
    output = torch.empty_like(grouped)
    for start in range(0, queries, QUERY_TILE):
        stop = min(start + QUERY_TILE, queries)
        output[:, :, :, start:stop] = _attend_tile(
            grouped[:, :, :, start:stop], key, value, mask[:, :, start:stop], scaling, softcap
        )
    return output.reshape(rows, heads, queries, width).to(query.dtype)


@dataclass(frozen=True)
class _Layout:
    """How `_sdpa_tiles` lays out one forward's attention: the same for each of its layers."""

    before: int  # masked keys before the first, to align it to its position in a block
    after: int  # masked keys after the last, through the last query block's position
    lead: int  # padding queries before the first, to align it to its position in a block
    extra: int  # padding queries after the last, to end on a whole SDPA_QUERIES block
    bias: torch.Tensor  # (rows, 1, queries padded, keys padded): 0 may attend, -inf not
    calls: tuple[tuple[slice, slice], ...]  # (queries, keys) of each SDPA call


# id(mask object) -> (a weak reference to it, what the layout was made from, the layout): a
# forward's layers share one layout, which is dropped when the forward drops its mask.
_LAYOUTS: dict[int, tuple[weakref.ref, tuple, _Layout]] = {}


def _layout(source, mask, start, dtype) -> _Layout:
    """The layout of `mask` (rows, 1, Lq, Lk) whose first key sits at `start` and whose queries
    are the last Lq positions; the one made before when the model passes the same mask object
    (`source`) again, for its next layer."""
    made_from = (start, tuple(mask.shape), dtype)
    kept = None if source is None else _LAYOUTS.get(id(source))
    if kept is not None and kept[0]() is source and kept[1] == made_from:
        return kept[2]
    rows, _, queries, keys = mask.shape
    first = start + keys - queries  # the first query's position
    before, lead = start % SDPA_BLOCK, first % SDPA_QUERIES
    extra = -(lead + queries) % SDPA_QUERIES
    blocks = (lead + queries + extra) // SDPA_QUERIES
    after = (first - lead + blocks * SDPA_QUERIES) - (start + keys)
    mask = F.pad(mask, (before, after), value=False)
    padding = mask.new_zeros((rows, 1, 1, mask.shape[3]))
    padding[..., before] = True  # a padding query sees the first real key: no empty row
    mask = torch.cat([padding.expand(-1, -1, lead, -1), mask, padding.expand(-1, -1, extra, -1)], 2)
    # The keys each query block's last query may see, from the first whole SDPA_BLOCK block
    # any of its queries sees (the blocks before it are masked for all of them).
    seen = mask.reshape(rows, blocks, SDPA_QUERIES, -1).any(dim=2).any(dim=0)  # (blocks, keys)
    from_block = (seen.int().argmax(dim=1) // SDPA_BLOCK * SDPA_BLOCK).tolist()
    ends = [before + first - start - lead + (block + 1) * SDPA_QUERIES for block in range(blocks)]
    calls = tuple(
        (slice(block * SDPA_QUERIES, (block + 1) * SDPA_QUERIES), slice(from_block[block], end))
        for block, end in enumerate(ends)
    )
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)
    layout = _Layout(before, after, lead, extra, bias, calls)
    if source is not None:
        _LAYOUTS[id(source)] = (weakref.ref(source), made_from, layout)
        weakref.finalize(source, _LAYOUTS.pop, id(source), None)
    return layout


def _sdpa_tiles(query, key, value, mask, scaling, start, source=None) -> torch.Tensor:
    """SDPA one SDPA_QUERIES block of query positions a call, over the keys from a whole
    SDPA_BLOCK through the block's last position (`_layout`; `source`: the mask object the model
    passed, None when there was none); (n, heads, Lq, d)."""
    heads, queries = query.shape[1], query.shape[2]
    layout = _layout(source, mask, start, query.dtype)
    key = F.pad(key, (0, 0, layout.before, layout.after))
    value = F.pad(value, (0, 0, layout.before, layout.after))
    query = F.pad(query, (0, 0, layout.lead, layout.extra))
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, queries_in],
            key[:, :, keys_in],
            value[:, :, keys_in],
            attn_mask=layout.bias[:, :, queries_in, keys_in],
            scale=scaling,
            enable_gqa=heads != key.shape[1],
        )
        for queries_in, keys_in in layout.calls
    ]
    return torch.cat(outputs, dim=2)[:, :, layout.lead : layout.lead + queries]


def _attend_tile(query, key, value, mask, scaling, softcap) -> torch.Tensor:
    """One tile of queries (rows, kv_heads, groups, T, d) against the padded keys, block by block
    in order, skipping the blocks no query of the tile may see."""
    rows, kv_heads, groups, tile, width = query.shape
    flat_query = query.reshape(rows * kv_heads, groups * tile, width)
    visible = mask.reshape(mask.shape[0], tile, -1, KEY_BLOCK).any(dim=-1).any(dim=1).any(dim=0)
    best = query.new_full((rows, kv_heads, groups, tile), float("-inf"))
    total = query.new_zeros((rows, kv_heads, groups, tile))
    acc = query.new_zeros((rows, kv_heads, groups, tile, width))
    for block in visible.nonzero().flatten().tolist():
        keys = slice(block * KEY_BLOCK, (block + 1) * KEY_BLOCK)
        block_keys = key[:, :, keys].reshape(rows * kv_heads, KEY_BLOCK, width)
        scores = _matmul(flat_query, block_keys.transpose(1, 2)) * scaling
        scores = scores.reshape(rows, kv_heads, groups, tile, KEY_BLOCK)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask[:, :, None, :, keys], float("-inf"))
        new_best = torch.maximum(best, scores.amax(dim=-1))
        finite = torch.where(new_best == float("-inf"), 0.0, new_best)
        weights = _exp(scores - finite[..., None])
        rescale = _exp(best - finite)
        total = total * rescale + weights.sum(dim=-1)
        block_values = value[:, :, keys].reshape(rows * kv_heads, KEY_BLOCK, width)
        flat_weights = weights.reshape(rows * kv_heads, groups * tile, KEY_BLOCK)
        weighted = _matmul(flat_weights, block_values).reshape(acc.shape)
        acc = acc * rescale[..., None] + weighted
        best = new_best
    return acc / torch.where(total == 0, 1.0, total)[..., None]


def _exp(values: torch.Tensor) -> torch.Tensor:
    """exp of every element through torch's vector kernel (see the module docstring)."""
    from semif_serve.scoring.invariant import whole_vectors  # (imports this module)

    return whole_vectors(torch.exp, values)


def _matmul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """Batched left (b, rows, k) @ right (b, k, n), rows through `invariant.row_policy`."""
    from semif_serve.scoring.invariant import MIN_ROWS, _by_rows, row_policy  # (imports this)

    tile = row_policy(left.shape[2], right.shape[2], left.dtype, "matmul")
    if tile is None and left.shape[1] >= MIN_ROWS:
        return torch.matmul(left, right)
    rows = left.transpose(0, 1)  # (rows, b, k): pad and tile along the rows

    def multiply(part: torch.Tensor) -> torch.Tensor:
        return torch.matmul(part.transpose(0, 1), right).transpose(0, 1)

    return _by_rows(multiply, rows, tile).transpose(0, 1)


def _first_key_position(position_ids: torch.Tensor | None, queries: int, keys: int) -> int:
    """The position of the first key: the queries are the last `queries` of the `keys` (after
    a cache's keys or a shared prefix's); 0 when the model passes no position ids."""
    if position_ids is None:
        return 0
    return int(position_ids[0, 0]) + queries - keys


def _boolean_mask(mask, rows: int, queries: int, keys: int, device) -> torch.Tensor:
    """(rows, 1, Lq, Lk) booleans, True where a query may attend a key."""
    if mask is None:
        positions = torch.arange(queries, device=device)[:, None] + (keys - queries)
        allowed = torch.arange(keys, device=device)[None, :] <= positions
        return allowed[None, None].expand(rows, 1, queries, keys)
    if mask.dtype != torch.bool:
        raise TypeError(f"invariant attention takes a boolean mask, not {mask.dtype}")
    return mask.expand(rows, 1, queries, keys)


def invariant_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """SDPA's boolean mask, always materialised (never "None: causal") for `invariant_attention`."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionMaskInterface.register(ATTENTION_NAME, invariant_mask)
