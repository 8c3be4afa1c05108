"""Batch-invariant numerics on the CPU: a row's numbers never depend on what shares its forward.

A CPU GEMM picks its kernel and blocking from the shape of the call, so one row's product can
depend on how many rows were multiplied with it (MKL float32 on the development EPYC: 1, 2-3
and 4+ rows give three different results; oneDNN bfloat16 on AMX Xeons: 64 rows alone differ
from the same rows inside 1,800), and SDPA's kernels tile the keys by the call's lengths. The
same row then gets different probabilities alone, batched among strangers, inside a shared call
or as a prefix-cache hit. `install` makes every path compute each row the same way:
- every `nn.Linear` multiplies rows in a fixed way: at least `MIN_ROWS` rows per call where a
  probe at install finds the kernel row-invariant from there on for that weight's shape (the
  development EPYC, both dtypes), else in tiles of exactly `TILE_ROWS` rows, the last padded;
- attention (`invariant_attention`, registered with transformers as `ATTENTION_NAME`) runs in
  float32 over key blocks of `KEY_BLOCK` positions aligned to position 0, with an online
  softmax that visits a row's blocks in order and skips only blocks it may not see; every
  matmul has a fixed key width, and the row count goes through the same probe as the linears.
  A skipped block and a block the row may not see both leave its numbers exactly as they were;
- elementwise exponentials run on whole vectors (`_exp`): torch computes the tail of a tensor
  whose size is not a multiple of its vector width with the scalar function, which may round
  differently.
The letter head is float32 for every path (`head.letter_logits`). Attention-only models then
score shared calls through `prefix_attention` (each row's keys laid out as its direct prompt's)
instead of packing suffixes into one row (`shared.forward`). CUDA models keep their kernels.
"""

from __future__ import annotations

from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "semif_invariant"
MIN_ROWS = 4
TILE_ROWS = 256
KEY_BLOCK = 64
QUERY_TILE = 256
# Row counts the probe compares with MIN_ROWS rows (small, odd, around kernel block sizes).
PROBE_ROWS = (5, 6, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 255, 256, 257, 600)
_VECTOR = 64  # elements: a multiple of every CPU vector width torch uses for float32


def installed(model: Any) -> bool:
    """True when `model` runs the invariant numerics (`install`)."""
    return getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME


def install(model: Any) -> bool:
    """Make `model` (a transformers causal LM on the CPU) batch-invariant; False, and the model
    unchanged, on other devices or when it runs another attention kernel than SDPA or eager
    (whose numbers the invariant attention would not reproduce). Idempotent."""
    if installed(model):
        return True
    if model.device.type != "cpu" or model.config._attn_implementation not in ("sdpa", "eager"):
        return False
    # Registers ATTENTION_NAME: the invariant kernel, joining a shared prefix as SDPA's wrapper
    # does (that module builds on this one, so it is imported here, not at the top).
    import semif_serve.scoring.prefix_attention  # noqa: F401

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = partial(invariant_linear, module)
    model.set_attn_implementation(ATTENTION_NAME)
    return installed(model)


def invariant_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` with the rows of `x` multiplied as `row_policy` says for this weight."""
    weight = module.weight
    rows = x.reshape(-1, x.shape[-1])
    tile = row_policy(weight.shape[1], weight.shape[0], weight.dtype, "linear")
    out = _by_rows(lambda part: F.linear(part, weight, module.bias), rows, tile)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _by_rows(multiply, rows: torch.Tensor, tile: int | None) -> torch.Tensor:
    """multiply(rows) computed at least MIN_ROWS at a time (tile None) or in tiles of exactly
    `tile` rows, padding rows being zeros and dropped from the result."""
    count = rows.shape[0]
    size = MIN_ROWS if tile is None else tile
    padded = max(size, -(-count // size) * size) if tile is not None else max(count, MIN_ROWS)
    if padded > count:
        rows = torch.cat([rows, rows.new_zeros((padded - count, *rows.shape[1:]))])
    if tile is None:
        return multiply(rows)[:count]
    return torch.cat([multiply(part) for part in rows.split(tile)])[:count]


@cache
def row_policy(inner: int, outer: int, dtype: torch.dtype, kind: str) -> int | None:
    """None when this CPU's kernel gives the first MIN_ROWS rows of a (rows, inner) x (inner,
    outer) product the same bits for every row count in PROBE_ROWS; else TILE_ROWS. Probed once
    per shape, kind ("linear" or "matmul", the two entry points) and dtype."""
    generator = torch.Generator().manual_seed(inner * 7919 + outer)
    left = torch.randn((max(PROBE_ROWS), inner), generator=generator).to(dtype)
    right = torch.randn((inner, outer), generator=generator).to(dtype)

    def product(count: int) -> torch.Tensor:
        part = left[:count]
        if kind == "linear":
            return F.linear(part, right.t().contiguous())[:MIN_ROWS]
        return torch.matmul(part[None], right[None])[0, :MIN_ROWS]

    with torch.inference_mode():
        reference = product(MIN_ROWS)
        same = all(torch.equal(product(count), reference) for count in PROBE_ROWS)
    return None if same else TILE_ROWS


def _exp(values: torch.Tensor) -> torch.Tensor:
    """exp of every element through torch's vector kernel (see the module docstring)."""
    flat = values.reshape(-1)
    count = flat.shape[0]
    if count % _VECTOR:
        flat = torch.cat([flat, flat.new_zeros(_VECTOR - count % _VECTOR)])
    return flat.exp()[:count].reshape(values.shape)


def _matmul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """Batched left (b, rows, k) @ right (b, k, n), rows through `row_policy`."""
    tile = row_policy(left.shape[2], right.shape[2], left.dtype, "matmul")
    if tile is None and left.shape[1] >= MIN_ROWS:
        return torch.matmul(left, right)
    rows = left.transpose(0, 1)  # (rows, b, k): pad and tile along the rows

    def multiply(part: torch.Tensor) -> torch.Tensor:
        return torch.matmul(part.transpose(0, 1), right).transpose(0, 1)

    return _by_rows(multiply, rows, tile).transpose(0, 1)


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
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scaling = width**-0.5 if scaling is None else scaling
    mask = _boolean_mask(attention_mask, rows, queries, keys, query.device)
    # Blocks start at multiples of KEY_BLOCK in positions, wherever the keys start (a
    # sliding-window cache keeps only the last keys): masked keys fill both ends.
    before = _first_key_position(kwargs.get("position_ids"), queries, keys) % KEY_BLOCK
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
    output = output.reshape(rows, heads, queries, width).to(query.dtype)
    return output.transpose(1, 2).contiguous(), None


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
