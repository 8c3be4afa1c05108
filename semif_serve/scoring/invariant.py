"""Batch-invariant numerics on the CPU: a row's numbers never depend on what shares its forward.

A CPU GEMM picks its kernel and blocking from the shape of the call, so one row's product can
depend on how many rows were multiplied with it (MKL float32 on the development EPYC: 1, 2-3
and 4+ rows give three different results; oneDNN bfloat16 on AMX Xeons: 64 rows alone differ
from the same rows inside 1,800), and attention kernels split the keys and queries by the
call's lengths. The same row then gets different probabilities alone, batched among strangers,
inside a shared call or as a prefix-cache hit. `install` makes every path compute a row alike:
- every `nn.Linear` multiplies rows in a fixed way: at least `MIN_ROWS` rows per call where a
  probe finds the kernel row-invariant from there on for that weight's shape and dtype (the
  development EPYC, both dtypes), else in tiles of exactly `TILE_ROWS` rows, the last padded;
- attention runs `invariant_attention.invariant_attention` (fixed key blocks aligned to
  position 0, fixed query blocks; see there), registered with transformers as ATTENTION_NAME;
- a linear-attention layer (Qwen3.5's gated delta net) computes softplus, sigmoid and silu over
  whole vectors (`_WholeVectors`): torch rounds a tensor's last partial vector with the scalar
  function, and those tensors' ends move with the batch;
- the letter head is float32 on every path (`head.letter_logits`), and attention-only models
  score shared calls through `prefix_attention` (each row's keys where its direct prompt has
  them) instead of packing every suffix into one row (`shared.forward`).
CUDA models keep their stock kernels.
"""

from __future__ import annotations

from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from semif_serve.scoring.invariant_attention import ATTENTION_NAME

MIN_ROWS = 4
TILE_ROWS = 256
# Row counts the probe compares with MIN_ROWS rows (small, odd, around kernel block sizes).
PROBE_ROWS = (5, 6, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 255, 256, 257, 600)


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
    # does (that module imports the kernel's, so it is imported here, not at the top).
    import semif_serve.scoring.prefix_attention  # noqa: F401

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = partial(invariant_linear, module)
        elif name.endswith("linear_attn"):  # a linear-attention (gated delta net) layer
            module.forward = partial(_in_whole_vectors, module.forward)
    model.set_attn_implementation(ATTENTION_NAME)
    return installed(model)


def _in_whole_vectors(forward, *args: Any, **kwargs: Any) -> Any:
    """`forward` with torch's tail-rounding elementwise functions over whole vectors."""
    with _WholeVectors():
        return forward(*args, **kwargs)


class _WholeVectors(TorchFunctionMode):
    """softplus, sigmoid and silu of any tensor over a copy padded to whole vectors: torch's CPU
    kernels compute a tensor's tail (its elements after the last whole vector) with the scalar
    function, which may round differently, and a linear-attention layer applies them to
    (rows, tokens, heads) tensors whose tail moves with the batch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _TAILED or not args or not isinstance(args[0], torch.Tensor):
            return func(*args, **kwargs)  # (a tensor passed by keyword: as torch computes it)
        inplace = kwargs.pop("inplace", False)
        values = args[0]
        result = whole_vectors(lambda flat: func(flat, *args[1:], **kwargs), values)
        return values.copy_(result) if inplace else result


_TAILED = {F.softplus, F.silu, torch.sigmoid, torch.Tensor.sigmoid}
VECTOR = 64  # elements: a multiple of every CPU vector width torch uses


def whole_vectors(function, values: torch.Tensor) -> torch.Tensor:
    """`function` (elementwise) of `values`, computed over a flat copy padded to whole VECTORs."""
    flat = values.reshape(-1)
    count = flat.shape[0]
    if count % VECTOR:
        flat = torch.cat([flat, flat.new_zeros(VECTOR - count % VECTOR)])
    return function(flat)[:count].reshape(values.shape)


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
    padded = max(count, MIN_ROWS) if tile is None else max(1, -(-count // tile)) * tile
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
