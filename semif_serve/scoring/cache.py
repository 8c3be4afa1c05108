"""Turn a batch-1 prefix cache into one that serves n suffix rows, for the layer kinds Qwen3.5
and Llama use.

`share_prefix` (the default path): attention layers hand their keys/values to ONE `SharedPrefix`
and keep nothing per row; only the linear-attention layers' small conv and recurrent states are
copied per row. `replicate_cache` (the fallback for models not on SDPA attention): every layer is
copied to n rows. `DynamicCache.batch_repeat_interleave` does not handle `LinearAttentionLayer`
(Qwen3.5's Gated DeltaNet states), so the states are repeated here. The repeats are real copies:
the linear-attention layers update their states in place.

`working_copy` gives a call its own cache to consume over a prefix cache that must stay as it is
(a stored state prefix, or one prefill shared by several suffix forwards); `row_prefix` cuts one
row's start out of a batch's cache, to be stored as that row's prefill; `cache_bytes` is what
a cache holds; `move_to_own_mapping` gives a cache about to be kept its own memory mapping, so
that the memory goes back to the system when it is evicted (docs/performance.md, "Memory bounded
by the budget").
"""

from __future__ import annotations

import copy
import mmap
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

from semif_serve.scoring.prefix_attention import SharedPrefix, SuffixOnlyLayer

STATES = ("conv_states", "recurrent_states")  # a linear-attention layer's state dicts


def can_share_prefix(cache: Any) -> bool:
    """True when every layer is plain attention or linear attention (no sliding windows etc.)."""
    return all(_kind(layer) is not None for layer in cache.layers)


def working_copy(cache: Any) -> Any:
    """A cache a forward may consume, equal to `cache`, which stays unchanged: attention layers
    share its tensors (they grow by concatenation, a new tensor each time), linear-attention
    layers get clones of theirs (they update them in place). Only for `can_share_prefix` caches."""
    twin = copy.copy(cache)
    twin.layers = [_layer_copy(layer) for layer in cache.layers]
    return twin


def has_linear_layers(cache: Any) -> bool:
    """Whether the cache holds linear-attention (recurrent) layers, which cannot be cropped."""
    return any(_kind(layer) == "linear" for layer in cache.layers)


def linear_checkpoint(cache: Any) -> list[dict[str, dict]]:
    """Copies of the linear-attention layers' conv and recurrent states as they are now (one
    dict per such layer, in layer order): with the attention layers cut to the same length,
    the cache at this point again (`resumed_at`)."""
    return [
        {name: {key: _clone(t) for key, t in getattr(layer, name).items()} for name in STATES}
        for layer in cache.layers
        if _kind(layer) == "linear"
    ]


def checkpoint_bytes(checkpoint: list[dict[str, dict]]) -> int:
    """The bytes of a `linear_checkpoint`'s tensors."""
    return sum(
        tensor.nbytes
        for states in checkpoint
        for tensors in states.values()
        for tensor in tensors.values()
        if tensor is not None
    )


def resumed_at(cache: Any, length: int, checkpoint: list[dict[str, dict]] | None) -> Any:
    """A working copy of a `can_share_prefix` cache positioned after its first `length`
    tokens: the attention layers' keys and values cut there (views: the stored tensors stay
    as they are), the linear-attention layers' states copied from `checkpoint`, which must have
    been taken after those same `length` tokens (None: the cache has no linear layers, or
    `length` is its whole length)."""
    twin = copy.copy(cache)
    linear = iter(checkpoint or ())
    twin.layers = [
        _layer_copy(layer, next(linear), length)
        if _kind(layer) == "linear" and checkpoint
        else _layer_copy(layer)
        for layer in cache.layers
    ]
    for layer in twin.layers:
        if _kind(layer) == "attention":
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]
    return twin


def cache_bytes(cache: Any) -> int:
    """The bytes of the tensors a cache holds (keys, values, conv and recurrent states)."""
    return sum(home[name].nbytes for home, name in _homes(cache) if home[name] is not None)


MAPPING_ALIGNMENT = 64  # bytes; every tensor starts at a multiple of it in its mapping


def move_to_own_mapping(cache: Any) -> int:
    """Move the CPU tensors of a `can_share_prefix` cache, in place, into one private anonymous
    memory mapping of their own; returns its bytes (0: no CPU tensor, or no mapping to be had,
    and the tensors stay where they are).

    A kept cache left where its prefill allocated it sits in glibc's malloc heaps among the
    calls' short-lived tensors, one heap per thread that served a call, and pins them: the
    space around it, and its own once it is evicted, is seldom handed back to the system. A
    mapping of its own is unmapped when its last tensor goes (the stored entry and any call
    still using it); GPU tensors are not the C heap's and stay where they are."""
    homes = [(home, name) for home, name in _homes(cache) if _on_cpu(home[name])]
    offsets, size = _layout([home[name].nbytes for home, name in homes])
    if not size:
        return 0
    try:
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0))
    except OSError:  # no room for a mapping: the tensors already exist where they are
        return 0
    block = torch.frombuffer(mapping, dtype=torch.uint8)
    for (home, name), offset in zip(homes, offsets):
        tensor = home[name]
        twin = block[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        twin.copy_(tensor)
        home[name] = twin
    return size


def _homes(cache: Any) -> list[tuple[dict, Any]]:
    """(where, name) of every tensor a `can_share_prefix` cache holds: an attention layer's
    attributes `keys` and `values`, a linear-attention layer's state dicts' keys."""
    homes = []
    for layer in cache.layers:
        if _kind(layer) == "attention":
            homes += [(vars(layer), "keys"), (vars(layer), "values")]
        else:
            for states in (layer.conv_states, layer.recurrent_states):
                homes += [(states, key) for key in states]
    return homes


def _on_cpu(tensor: Any) -> bool:
    return tensor is not None and tensor.device.type == "cpu"


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    """Each size's offset in one block, every offset a multiple of MAPPING_ALIGNMENT, and the
    block's size."""
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // MAPPING_ALIGNMENT) * MAPPING_ALIGNMENT
        offsets.append(start)
        end = start + size
    return offsets, end


LINEAR_FLAGS = (
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
    "has_previous_state",
    "conv_kernel_size",
)


# A linear-attention layer's token count (transformers 5.25 on): a tensor it adds to in place,
# and what the cache's get_seq_length() returns when its first layer is one (Qwen3.5's is), so
# the position of every token a prefill then runs. A copy shares it unless given its own.
LINEAR_COUNTER = "cumulative_length_linear"


def _layer_copy(
    layer: Any, states: dict[str, dict] | None = None, length: int | None = None
) -> Any:
    """A copy a forward may consume: a linear-attention layer's states are cloned (from
    `states`, a `linear_checkpoint` entry taken after `length` tokens, when given), the flags
    and the token count it updates copied (the count set to `length` when given)."""
    twin = copy.copy(layer)
    if _kind(layer) == "linear":
        for name in STATES:
            source = getattr(layer, name) if states is None else states[name]
            setattr(twin, name, {key: _clone(tensor) for key, tensor in source.items()})
        for name in LINEAR_FLAGS:  # dicts the layer updates in place
            setattr(twin, name, dict(getattr(layer, name)))
        count = getattr(layer, LINEAR_COUNTER, None)
        if count is not None:  # transformers 5.25 on; 5.24 counts its attention layers' tokens
            own = count.clone() if length is None else count.new_tensor(length)
            setattr(twin, LINEAR_COUNTER, own)
    return twin


def row_prefix(cache: Any, row: int, length: int) -> Any | None:
    """A batch-1 cache of row `row`'s first `length` tokens, cut out of a cache of several rows
    (its own tensors: the batch's may go); None unless every layer is plain attention (a
    linear-attention layer holds the state at the row's end, not at `length`)."""
    if any(_kind(layer) != "attention" for layer in cache.layers):
        return None
    twin = copy.copy(cache)
    twin.layers = []
    for layer in cache.layers:
        cut = copy.copy(layer)
        cut.keys = layer.keys[row : row + 1, :, :length].clone()
        cut.values = layer.values[row : row + 1, :, :length].clone()
        twin.layers.append(cut)
    return twin


def _clone(tensor: Any) -> Any:
    return None if tensor is None else tensor.clone()


def share_prefix(cache: Any, rows: int) -> SharedPrefix:
    """Move the attention layers' prefix keys/values into a `SharedPrefix`, in place, leaving
    suffix-only layers behind; copy the linear-attention states to `rows` rows."""
    shared = SharedPrefix()
    for index, layer in enumerate(cache.layers):
        kind = _kind(layer)
        if kind == "attention":
            shared.keys[index], shared.values[index] = layer.keys, layer.values
            cache.layers[index] = SuffixOnlyLayer()
        elif kind == "linear":
            _repeat_linear_states(layer, rows)
        else:
            raise TypeError(f"cannot share cache layer {index} of type {type(layer).__name__}")
    return shared


def replicate_cache(cache: Any, rows: int) -> None:
    """Turn a cache holding one sequence into one holding `rows` identical sequences, in place."""
    for index, layer in enumerate(cache.layers):
        known = False
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            _repeat_linear_states(layer, rows)
            known = True
        if isinstance(layer, DynamicLayer):
            DynamicLayer.batch_repeat_interleave(layer, rows)
            known = True
        if not known:
            raise TypeError(f"cannot replicate cache layer {index} of type {type(layer).__name__}")


def _kind(layer: Any) -> str | None:
    if type(layer) is DynamicLayer:
        return "attention"
    if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, DynamicLayer):
        return "linear"
    return None


def _repeat_linear_states(layer: Any, rows: int) -> None:
    for states in (layer.conv_states, layer.recurrent_states):
        for key, tensor in states.items():
            if tensor is not None:
                states[key] = tensor.repeat_interleave(rows, dim=0)
