"""Driving the state-prefix store without a model: `resume_once` with any prefill, and
`token_prefill`, a fake model's prefill whose caches say which ids they hold (`read_ids`)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from semif_serve.scoring.cache import has_linear_layers, linear_checkpoint

CONV_WIDTH = 3  # a fake linear layer's conv state: the last CONV_WIDTH ids


@contextmanager
def resume_once(store, model, ids, make):
    """Resume after `ids` once on `store` (a `PrefixCache`, or a model's view when `model` is
    None), running `make()` as the prefill of whatever is not stored: (cache, hit, stored)."""

    def prefill(base, start, stops):
        return make(), {}

    resume = store.resume(ids, prefill) if model is None else store.resume(model, ids, prefill)
    with resume as (cache, reuse):
        yield cache, reuse.hit, reuse.stored


def token_cache(linear: bool = False) -> DynamicCache:
    """An empty cache of the fake model: one attention layer, and with `linear` one
    linear-attention layer after it."""
    cache = DynamicCache()
    cache.layers = [DynamicLayer()] + ([_counting(LinearAttentionLayer())] if linear else [])
    return cache


def _counting(layer: LinearAttentionLayer) -> LinearAttentionLayer:
    """The layer with a token count that it adds to in place, as transformers 5.25's layers
    have (5.24's have none: given one all the same, so that every copy's own count is tested)."""
    if not hasattr(layer, "cumulative_length_linear"):
        layer.cumulative_length_linear = torch.tensor(0, dtype=torch.long)
    return layer


def token_prefill(ids, linear: bool = False, calls: list | None = None):
    """A `Prefill` of `ids` that leaves what a model's prefill would, but legible: the
    attention keys and values ARE the ids (one per position); a linear layer's recurrent state
    is the sum of the ids so far and its conv state the last CONV_WIDTH of them, both updated
    in place as real linear layers do. It checks that its `base` holds exactly ids[:start],
    and records each call's (start, stops) in `calls`."""
    ids = list(ids)

    def prefill(base, start, stops):
        cache = token_cache(linear) if base is None else base
        assert read_ids(cache) == ids[:start], "resumed from the wrong place"
        if calls is not None:
            calls.append((start, list(stops)))
        checkpoints = {}
        for end in [*stops, len(ids)]:
            _extend(cache, ids[start:end])
            if end < len(ids) and has_linear_layers(cache):
                checkpoints[end] = linear_checkpoint(cache)
            start = end
        return cache, checkpoints

    return prefill


def _extend(cache, new: list[int]) -> None:
    if not new:
        return
    states = torch.tensor(new, dtype=torch.float64).view(1, 1, len(new), 1)
    cache.layers[0].update(states, states.clone())
    for layer in cache.layers[1:]:
        if layer.recurrent_states[0] is None:
            layer.recurrent_states[0] = torch.zeros(1, dtype=torch.float64)
            layer.conv_states[0] = torch.zeros(CONV_WIDTH, dtype=torch.float64)
        layer.recurrent_states[0].add_(sum(new))  # in place, as the real layers update
        layer.cumulative_length_linear.add_(len(new))  # the token count: what positions follow
        window = torch.cat([layer.conv_states[0], torch.tensor(new, dtype=torch.float64)])
        layer.conv_states[0].copy_(window[-CONV_WIDTH:])


def read_ids(cache) -> list[int]:
    """The ids a fake model's cache holds (its linear layer checked to agree with them)."""
    keys = cache.layers[0].keys
    ids = [] if keys is None else [int(key) for key in keys[0, 0, :, 0]]
    for layer in cache.layers[1:]:
        recurrent, conv = layer.recurrent_states[0], layer.conv_states[0]
        assert (0 if recurrent is None else int(recurrent)) == sum(ids)
        window = ([0] * CONV_WIDTH + ids)[-CONV_WIDTH:]
        assert (conv is None and not ids) or [int(x) for x in conv] == window
        assert int(layer.cumulative_length_linear) == len(ids), "the linear layer's token count"
    return ids
