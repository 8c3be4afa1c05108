"""One copy of the prefix for every row: shared-prefix attention (hybrid models), packed chunks
(attention-only models), the replicating fallback, and prompts encoded in batches."""

import threading

import pytest
import torch
from rows_factory import make_rows
from test_cache import prefilled_cache
from test_shared import assert_shared_matches_direct
from tiny_models import byte_tokenizer, tiny_llama, tiny_qwen35

import semif_serve.scoring.packed as packed_module
import semif_serve.scoring.prefix_attention as prefix_attention
import semif_serve.scoring.shared as shared_module
from semif_serve.scoring import ModelInfo, PromptRejected, ScoringModel, parse_row, score
from semif_serve.scoring.cache import can_share_prefix, share_prefix
from semif_serve.scoring.prefix_attention import (
    ATTENTION_NAME,
    SharedPrefix,
    SuffixOnlyLayer,
    attending_to,
    enable_prefix_attention,
)
from semif_serve.scoring.prompt import encode_prompt, encode_prompts

INFO = ModelInfo(source="test:tiny", revision="seed-0", dtype="float32", device="cpu")


def fresh_qwen(qwen_tokenizer, **config) -> ScoringModel:
    model = tiny_qwen35(seed=3)
    for key, value in config.items():
        setattr(model.config, key, value)
    return ScoringModel(model=model, tokenizer=qwen_tokenizer, info=INFO, invariant=False)


def direct_logits(scoring_model, row):
    return score(scoring_model, row, max_tokens=4096)["option_logits"]


def test_outside_a_shared_call_the_attention_is_the_stock_sdpa(qwen_tokenizer):
    model = fresh_qwen(qwen_tokenizer)
    row = make_rows(1, [5])[0]
    before = direct_logits(model, row)
    assert model.model.config._attn_implementation == "sdpa"
    assert enable_prefix_attention(model.model)
    assert model.model.config._attn_implementation == ATTENTION_NAME
    assert enable_prefix_attention(model.model)  # idempotent
    assert direct_logits(model, row) == before  # bit for bit


def test_a_shared_prefix_is_seen_only_by_the_context_that_set_it(qwen_tokenizer):
    model = fresh_qwen(qwen_tokenizer)
    enable_prefix_attention(model.model)
    row = make_rows(1, [3])[0]
    expected = direct_logits(model, row)
    seen = {}

    def other_thread():
        seen["logits"] = direct_logits(model, row)

    # An empty prefix would break any attention that consulted it (KeyError on the layer).
    with attending_to(SharedPrefix()):
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join(timeout=60)
    assert not worker.is_alive()
    assert seen["logits"] == expected
    with pytest.raises(RuntimeError, match="boom"), attending_to(SharedPrefix()):
        raise RuntimeError("boom")
    assert direct_logits(model, row) == expected  # the context was reset after the error


def test_sharing_keeps_one_prefix_copy_and_copies_only_the_linear_states(tiny_qwen):
    cache = prefilled_cache(tiny_qwen.model)
    attention_before = {
        index: (layer.keys.data_ptr(), layer.keys.shape)
        for index, layer in enumerate(cache.layers)
        if not hasattr(layer, "conv_states")
    }
    assert attention_before and can_share_prefix(cache)
    shared = share_prefix(cache, 4)
    assert set(shared.keys) == set(attention_before) == set(shared.values)
    for index, (pointer, shape) in attention_before.items():
        assert isinstance(cache.layers[index], SuffixOnlyLayer)
        assert shared.keys[index].data_ptr() == pointer  # moved, not copied
        assert shared.keys[index].shape == shape and shape[0] == 1
    for layer in cache.layers:
        if hasattr(layer, "conv_states"):
            for tensor in (*layer.conv_states.values(), *layer.recurrent_states.values()):
                assert tensor.shape[0] == 4
                tensor[0].zero_()
                assert tensor[1].abs().sum() > 0  # real per-row copies


def test_a_suffix_only_layer_stores_nothing():
    layer = SuffixOnlyLayer()
    keys, values = torch.ones(2, 1, 3, 4), torch.zeros(2, 1, 3, 4)
    assert layer.update(keys, values, 0) == (keys, values)
    assert layer.get_seq_length() == 0


def test_an_unknown_layer_kind_cannot_be_shared():
    class Sliding:
        pass

    class FakeCache:
        layers = [Sliding()]

    assert not can_share_prefix(FakeCache())
    with pytest.raises(TypeError, match="cannot share cache layer 0 of type Sliding"):
        share_prefix(FakeCache(), 2)


@pytest.mark.parametrize("rows_per_call", [1, 3])
def test_hybrid_rows_split_over_several_attention_calls_stay_exact(
    qwen_tokenizer, monkeypatch, rows_per_call
):
    monkeypatch.setattr(prefix_attention, "ROWS_PER_CALL", rows_per_call)
    model = fresh_qwen(qwen_tokenizer)
    calls = []
    real = shared_module.replicate_cache
    monkeypatch.setattr(shared_module, "replicate_cache", lambda *a: calls.append(a) or real(*a))
    assert_shared_matches_direct(model, make_rows(7, [2, 9, 4]), tolerance=1e-5)
    assert calls == []  # the prefix was shared, not replicated


def test_a_model_on_another_attention_kernel_replicates_and_stays_exact(
    qwen_tokenizer, monkeypatch
):
    model = fresh_qwen(qwen_tokenizer, _attn_implementation="eager")
    assert not enable_prefix_attention(model.model)
    assert model.model.config._attn_implementation == "eager"
    calls = []
    real = shared_module.replicate_cache
    monkeypatch.setattr(shared_module, "replicate_cache", lambda *a: calls.append(a) or real(*a))
    assert_shared_matches_direct(model, make_rows(5, [2, 6]), tolerance=1e-5)
    assert len(calls) == 1 and calls[0][1] == 5


@pytest.mark.parametrize("chunk_tokens", [1, 40, 10**6])
def test_packed_chunks_of_any_size_stay_exact(monkeypatch, chunk_tokens):
    monkeypatch.setattr(packed_module, "PACKED_CHUNK_TOKENS", chunk_tokens)
    model = ScoringModel(tiny_llama(), byte_tokenizer(), INFO, invariant=False)  # packs, as CUDA
    _, _, timing = assert_shared_matches_direct(model, make_rows(6, [2, 7, 3]), tolerance=1e-5)
    assert timing["padded_suffix_tokens"] == timing["true_suffix_tokens"]


def test_chunks_keep_order_and_size_and_never_split_a_suffix():
    suffixes = [[1] * 5, [2] * 3, [3] * 9, [4] * 2, [5] * 2]
    chunks = packed_module.chunks(suffixes, 8)
    assert [suffix for chunk in chunks for suffix in chunk] == suffixes
    assert [[len(suffix) for suffix in chunk] for chunk in chunks] == [[5, 3], [9], [2, 2]]
    assert packed_module.chunks(suffixes, 10**6) == [suffixes]


class PlainTokenizer:
    """The qwen tokenizer behind the minimal protocol (not callable): one encode per text."""

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def apply_chat_template(self, conversation, **kwargs):
        return self.inner.apply_chat_template(conversation, **kwargs)

    def encode(self, text, add_special_tokens=False):
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids):
        return self.inner.decode(token_ids)


@pytest.mark.parametrize("callable_tokenizer", [True, False])
def test_batch_encoding_gives_each_row_its_direct_prompt(qwen_tokenizer, callable_tokenizer):
    tokenizer = qwen_tokenizer if callable_tokenizer else PlainTokenizer(qwen_tokenizer)
    assert callable(tokenizer) is callable_tokenizer
    rows = [parse_row(row) for row in make_rows(5, [2, 16, 3])]
    batched = encode_prompts(tokenizer, rows, max_tokens=4096)
    assert batched == [encode_prompt(qwen_tokenizer, row, max_tokens=4096) for row in rows]


def test_a_rejected_row_in_a_batch_is_named_by_its_position(qwen_tokenizer):
    rows = [parse_row(row) for row in make_rows(4, [2])]
    lengths = [len(encode_prompt(qwen_tokenizer, row, 4096).ids) for row in rows]
    limit = max(lengths) - 1
    first_over = next(index for index, length in enumerate(lengths) if length > limit)
    assert first_over > 0  # the rows before it pass, so the position is really searched
    with pytest.raises(PromptRejected, match="max_tokens") as caught:
        encode_prompts(qwen_tokenizer, rows, max_tokens=limit)
    assert caught.value.row_index == first_over
    with pytest.raises(PromptRejected) as single:
        encode_prompt(qwen_tokenizer, rows[first_over], max_tokens=limit)
    assert single.value.row_index is None  # a lone row has no position


def test_the_joined_mask_is_made_once_per_forward_mask_and_chunk():
    """Every layer of a suffix forward gets the same [all prefix ; own] mask object for its rows
    (so the invariant kernel lays it out once), and another forward's mask gets its own."""
    from semif_serve.scoring.prefix_attention import SharedPrefix, _joined_mask

    shared = SharedPrefix()
    mask = torch.ones((10, 1, 3, 3), dtype=torch.bool).tril()
    first = _joined_mask(shared, mask, slice(0, 8), 5)
    assert _joined_mask(shared, mask, slice(0, 8), 5) is first
    assert first.shape == (8, 1, 3, 8) and first[..., :5].all()
    assert torch.equal(first[..., 5:], mask[:8])
    rest = _joined_mask(shared, mask, slice(8, 16), 5)
    assert rest.shape == (2, 1, 3, 8) and torch.equal(rest[..., 5:], mask[8:])
    other = mask.clone()
    assert _joined_mask(shared, other, slice(0, 8), 5) is not first
