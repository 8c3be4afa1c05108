"""Issue 44: `scoring.invariant` alone. Its attention computes what SDPA computes (within float
rounding) and gives each query row the same bits whatever else is in the call: other rows,
other queries, more keys, keys cut at the front by a sliding-window cache. Its linear gives a
row the same bits for every row count, tiled or not; its exponential, for every tensor size.
The whole-model consequences (every scoring path bit-identical to the direct one) are in
tests/test_exact_paths.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import byte_tokenizer, tiny_llama, tiny_qwen35

from semif_serve.scoring import ModelInfo, ScoringModel
from semif_serve.scoring import invariant_attention as module
from semif_serve.scoring.invariant import (
    MIN_ROWS,
    TILE_ROWS,
    _by_rows,
    install,
    installed,
    invariant_linear,
    row_policy,
)
from semif_serve.scoring.invariant_attention import (
    ATTENTION_NAME,
    KEY_BLOCK,
    SDPA_BLOCK,
    SDPA_QUERIES,
    _exp,
    invariant_attention,
)

DTYPES = [torch.float32, torch.bfloat16]
HEAD = 16


def tensors(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def attend(query, key, value, mask=None, **kwargs):
    return invariant_attention(None, query, key, value, mask, **kwargs)[0]


def causal(queries: int, keys: int, rows: int = 1) -> torch.Tensor:
    positions = torch.arange(queries)[:, None] + keys - queries
    return (torch.arange(keys)[None, :] <= positions)[None, None].expand(rows, 1, -1, -1)


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("keys", [1, 63, 64, 65, 200])
def test_the_attention_computes_what_sdpa_computes(keys, softcap):
    """Causal, grouped-query (4 heads over 2), queries the last of the keys; soft-capped as
    eager attention does it."""
    queries = min(keys, 37)
    query, key, value = (
        tensors(2, heads, n, HEAD, seed=s)
        for s, heads, n in [(1, 4, queries), (2, 2, keys), (3, 2, keys)]
    )
    mask = causal(queries, keys, rows=2)
    expected_key = key.repeat_interleave(2, dim=1)
    expected_value = value.repeat_interleave(2, dim=1)
    scores = query @ expected_key.transpose(-1, -2) * HEAD**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    expected = (scores.softmax(-1) @ expected_value).transpose(1, 2)
    got = attend(query, key, value, mask, softcap=softcap)
    assert got.shape == (2, queries, 4, HEAD)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        attend(query, key, value, None, softcap=softcap), got, rtol=0, atol=0
    )


@pytest.mark.parametrize(
    ("softcap", "sdpa_probe"),
    [(None, None), (30.0, None), (None, False)],
    ids=["sdpa", "blocked-softcap", "blocked-where-sdpa-varies"],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_row_gets_the_same_bits_alone_or_among_others(
    dtype, softcap, sdpa_probe, monkeypatch
):
    """The last query of a 300-key prompt: in a full causal forward, as the only query over the
    same keys, among 3 other rows whose keys run 500 long (padding masked), and over keys cut
    at position 137 by a sliding-window cache (positions given, as the models pass them)."""
    keys = 300
    query, key, value = (tensors(1, 4, keys, HEAD, seed=s, dtype=dtype) for s in (1, 2, 3))

    if sdpa_probe is not None:  # a CPU whose SDPA the probe found varying: the blocked kernel
        monkeypatch.setattr(module, "sdpa_is_invariant", lambda *shape: sdpa_probe)

    def capped(*args, **kwargs):
        return attend(*args, softcap=softcap, **kwargs)

    full = capped(query, key, value)[:, -1]
    alone = capped(query[:, :, -1:], key, value)[:, -1]
    strangers_k, strangers_v = (tensors(4, 4, 500, HEAD, seed=s, dtype=dtype) for s in (4, 5))
    strangers_q = tensors(4, 4, 500, HEAD, seed=6, dtype=dtype)
    strangers_k[2, :, :keys], strangers_v[2, :, :keys], strangers_q[2, :, :keys] = (
        key[0],
        value[0],
        query[0],
    )
    mask = causal(500, 500, rows=4).clone()
    mask[2, :, :, keys:] = False  # row 2 is right-padded after its 300 real tokens
    among = capped(strangers_q, strangers_k, strangers_v, mask)[2, keys - 1]
    cut = 137
    positions = torch.arange(keys - 1, keys)[None]
    window = capped(
        query[:, :, -1:],
        key[:, :, cut:],
        value[:, :, cut:],
        causal(1, keys - cut),
        position_ids=positions,
    )[:, -1]
    window_reference = capped(
        query, key, value, causal(keys, keys) & (torch.arange(keys)[None, None, None, :] >= cut)
    )[:, -1]
    assert torch.equal(alone, full)
    assert torch.equal(among, full[0])
    assert torch.equal(window, window_reference)


def test_every_sdpa_call_is_one_query_block_over_the_keys_its_positions_fix(monkeypatch):
    """700 queries at positions 500..1199 over 900 keys starting at position 300 (a cut cache):
    one call per 32-query block aligned to positions (500 is 20 into its block: 20 padding
    queries lead, 4 trail), over the keys from position 0 (the block holding the first key)
    through the block's last position; the first real key at its position in the block."""
    calls = []
    real = F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        calls.append(
            (query.shape[2], key.shape[2], (attn_mask[0, 0, -1] == 0).nonzero().min().item())
        )
        return real(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(module.F, "scaled_dot_product_attention", recording)
    query, key, value = (tensors(1, 2, n, HEAD, seed=s) for s, n in ((1, 700), (2, 900), (3, 900)))
    out = module._sdpa_tiles(query, key, value, causal(700, 900), HEAD**-0.5, 300)
    assert out.shape == (1, 2, 700, HEAD)
    assert [queries for queries, _, _ in calls] == [SDPA_QUERIES] * 23  # 20 + 700 + 16 = 736
    assert [keys for _, keys, _ in calls] == [480 + 32 * block + 32 for block in range(23)]
    assert all(first == 300 for _, _, first in calls)
    reference = module._blocked(query, key, value, causal(700, 900), HEAD**-0.5, None, 300)
    torch.testing.assert_close(out, reference)


def test_a_call_starts_at_the_first_key_block_its_queries_may_see(monkeypatch):
    """A sliding window: the queries of the last blocks see none of the first 512-key block,
    so their calls leave it out (a whole block: their sums do not change)."""
    keys_seen = []
    real = F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        keys_seen.append(key.shape[2])
        return real(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(module.F, "scaled_dot_product_attention", recording)
    query, key, value = (tensors(1, 2, 800, HEAD, seed=s) for s in (1, 2, 3))
    positions = torch.arange(800)
    window = causal(800, 800) & (positions[None, :] > positions[:, None] - 100)[None, None]
    out = module._sdpa_tiles(query, key, value, window, HEAD**-0.5, 0)
    assert keys_seen[:16] == [32 * (block + 1) for block in range(16)]  # through position 511
    assert keys_seen[19] == 640  # its first query (608) sees key 509: from the first block
    assert keys_seen[-1] == 800 - 512  # the last (768..799) sees from 669: from the second
    reference = module._blocked(query, key, value, window, HEAD**-0.5, None, 0)
    torch.testing.assert_close(out, reference)


def test_a_row_that_may_see_no_key_gets_zeros_not_nan():
    query, key, value = (tensors(1, 2, 5, HEAD, seed=s) for s in (1, 2, 3))
    mask = torch.zeros((1, 1, 5, 5), dtype=torch.bool)
    mask[0, 0, 1:, 0] = True
    out = attend(query, key, value, mask)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    assert not out.isnan().any()


def test_a_mask_that_is_not_boolean_is_refused():
    query = tensors(1, 2, 3, HEAD)
    with pytest.raises(TypeError, match="boolean mask, not torch.float32"):
        attend(query, query, query, torch.zeros((1, 1, 3, 3)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_linear_gives_a_row_the_same_bits_for_every_row_count(dtype):
    layer = torch.nn.Linear(96, 80).to(dtype)
    rows = tensors(700, 96, dtype=dtype)
    with torch.inference_mode():
        reference = invariant_linear(layer, rows[:1])
        for count in (2, 3, 4, 17, 64, 255, 256, 257, 700):
            assert torch.equal(invariant_linear(layer, rows[:count])[:1], reference)
        batched = invariant_linear(layer, rows[:600].reshape(3, 200, 96))
    assert batched.shape == (3, 200, 80)
    assert torch.equal(batched[0, :1], reference)
    torch.testing.assert_close(reference, F.linear(rows[:1], layer.weight, layer.bias))


def test_tiles_are_whole_tiles_of_exactly_that_many_rows_padded_with_zeros():
    seen = []

    def multiply(part):
        seen.append(part.shape[0])
        return part * 2

    rows = tensors(130, 3)
    out = _by_rows(multiply, rows, 64)
    assert seen == [64, 64, 64] and torch.equal(out, rows * 2)
    seen.clear()
    assert torch.equal(_by_rows(multiply, rows[:2], None), rows[:2] * 2)
    assert seen == [MIN_ROWS]  # fewer rows than MIN_ROWS are padded up to it
    seen.clear()
    _by_rows(multiply, rows[:9], None)
    assert seen == [9]


def test_the_probe_answers_untiled_or_the_tile():
    policy = row_policy(96, 80, torch.float32, "linear")
    assert policy in (None, TILE_ROWS)
    assert row_policy(96, 80, torch.float32, "linear") is policy  # probed once


def test_exp_of_an_element_does_not_depend_on_the_tensor_around_it():
    values = tensors(1000) * 5
    whole = _exp(values)
    for count in (1, 7, 63, 65, 999):
        assert torch.equal(_exp(values[:count]), whole[:count])
    torch.testing.assert_close(whole, values.exp(), rtol=2e-7, atol=0)


def test_install_switches_the_attention_and_every_linear_once():
    model = tiny_llama()
    assert not installed(model)
    ScoringModel(model, byte_tokenizer(), ModelInfo("test", "seed-0", "float32", "cpu"))
    assert installed(model) and model.config._attn_implementation == ATTENTION_NAME
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.forward.func is invariant_linear for m in linears)
    assert install(model)  # idempotent


def test_a_model_on_another_attention_kernel_is_left_as_it_is():
    model = tiny_llama()
    model.config._attn_implementation = "flex_attention"
    assert not install(model)
    assert not any("forward" in vars(m) for m in model.modules())


def test_the_sdpa_calls_keep_torchs_blocks_fixed():
    """torch's CPU flash attention: 32-query blocks below 192 queries; its key block is 512."""
    assert SDPA_QUERIES == 32 and SDPA_BLOCK == 512 and KEY_BLOCK % 16 == 0


def test_a_forwards_layers_share_one_layout_dropped_with_its_mask():
    """The model passes one mask object to all its layers: its layout (padding, bias, calls) is
    made once; a new mask object, or the same one at another position, gets a new layout; and
    none outlives its mask (a server's threads would otherwise each hold their last one)."""
    import gc

    from semif_serve.scoring.invariant_attention import _LAYOUTS, _layout

    mask = causal(40, 40).clone()
    first = _layout(mask, mask, 0, torch.float32)
    assert _layout(mask, mask, 0, torch.float32) is first
    assert _layout(mask, mask, 7, torch.float32) is not first
    other = mask.clone()
    assert _layout(other, other, 0, torch.float32) is not first
    assert _layout(None, mask, 0, torch.float32) is not _layout(None, mask, 0, torch.float32)
    assert first.bias.shape == (1, 1, 64, 64) and (first.lead, first.extra) == (0, 24)
    assert _layout(None, mask[:, :, 30:], 0, torch.float32).lead == 30
    assert torch.equal(first.bias[0, 0, :40, :40] == 0, mask[0, 0])
    kept = {id(mask), id(other)}
    assert kept <= set(_LAYOUTS)
    del mask, other
    gc.collect()
    assert not kept & set(_LAYOUTS)


def test_the_probe_finds_an_sdpa_whose_rows_depend_on_the_call(monkeypatch):
    """A kernel that rounds a row by how many rows share its call (as a kernel that packs its
    work by the batch would) fails the probe, which then sends attention to the
    blocked kernel; this machine's real SDPA is what the probe answered for it."""
    real = F.scaled_dot_product_attention

    def varying(query, key, value, **kwargs):
        return real(query, key, value, **kwargs) * (1 + query.shape[0] * 1e-3)

    module.sdpa_is_invariant.cache_clear()
    monkeypatch.setattr(module.F, "scaled_dot_product_attention", varying)
    try:
        assert module.sdpa_is_invariant(torch.float32, 4, 2, HEAD) is False
    finally:
        module.sdpa_is_invariant.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
def test_tail_rounding_functions_give_an_element_the_same_bits_wherever_the_tensor_ends(dtype):
    """torch's CPU softplus, sigmoid and silu round a tensor's last partial vector with the
    scalar function; inside a linear-attention layer they run over whole vectors."""
    from semif_serve.scoring.invariant import _WholeVectors

    values = (tensors(560) * 4).to(dtype)
    functions = [F.softplus, torch.sigmoid, F.silu, lambda t: t.sigmoid()]
    with _WholeVectors():
        for function in functions:
            whole = function(values)
            for count in (7, 90, 100, 180):
                assert torch.equal(function(values[:count]), whole[:count])
        inplace = values.clone()
        assert F.silu(inplace, inplace=True) is inplace and torch.equal(inplace, F.silu(values))
    torch.testing.assert_close(whole, values.sigmoid())  # the same function, bits aside


def test_install_runs_a_linear_attention_layer_over_whole_vectors():
    model = tiny_qwen35()
    ScoringModel(model, byte_tokenizer(), ModelInfo("test", "seed-0", "float32", "cpu"))
    wrapped = [
        name
        for name, m in model.named_modules()
        if "forward" in vars(m) and not isinstance(m, torch.nn.Linear)
    ]
    assert wrapped and all(name.endswith("linear_attn") for name in wrapped)
