"""Cache replication covers Qwen3.5's linear-attention states, which transformers' own does not."""

import pytest
import torch
from transformers import DynamicCache

from semif_serve.scoring.cache import replicate_cache


def prefilled_cache(model, length=9):
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model.get_decoder()(
            input_ids=torch.arange(3, 3 + length)[None], cache=cache, use_cache=True
        )
    return cache


def test_transformers_cannot_repeat_linear_attention_layers(tiny_qwen):
    # Why replicate_cache exists; if transformers learns this, the workaround can go.
    with pytest.raises(AttributeError):
        prefilled_cache(tiny_qwen.model).batch_repeat_interleave(3)


def test_every_layer_is_repeated_as_independent_copies(tiny_qwen):
    cache = prefilled_cache(tiny_qwen.model)
    before = [
        [t.clone() for t in (*layer.conv_states.values(), *layer.recurrent_states.values())]
        if hasattr(layer, "conv_states")
        else [layer.keys.clone(), layer.values.clone()]
        for layer in cache.layers
    ]
    replicate_cache(cache, 3)
    for layer, originals in zip(cache.layers, before):
        tensors = (
            [*layer.conv_states.values(), *layer.recurrent_states.values()]
            if hasattr(layer, "conv_states")
            else [layer.keys, layer.values]
        )
        for tensor, original in zip(tensors, originals):
            assert tensor.shape[0] == 3
            for row in range(3):
                assert torch.equal(tensor[row], original[0])
        # In-place updates to one row must not touch another (no expanded views).
        tensors[0][0].zero_()
        assert torch.equal(tensors[0][1], originals[0][0])
    assert cache.get_seq_length() == 9


def test_an_unknown_layer_kind_is_refused():
    class Odd:
        pass

    class FakeCache:
        layers = [Odd()]

    with pytest.raises(TypeError, match="cannot replicate cache layer 0 of type Odd"):
        replicate_cache(FakeCache(), 2)
