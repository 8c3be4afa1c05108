"""The shared scorer: many rows over one exact state, the state prefix computed once.

1. Encode every row's full prompt and the shared state prefix (`shared_prompts.encode_shared`):
   each row is scored on exactly the token ids the direct scorer would see.
2. Prefill the prefix once (batch 1).
3. Attention-only models (`_forward_packed`): all suffixes in ONE row after that one prefix
   cache, with a block mask and per-suffix position ids. Models with linear-attention layers
   (`_forward`): copy the cache to n rows (`replicate_cache`) and feed the suffixes right-padded,
   with position ids continuing from the prefix and a mask over prefix + real suffix tokens;
   right padding keeps the recurrent layers exact (a row's real tokens never see its padding).
4. Read each row's logits at its own last real token.
"""

from __future__ import annotations

from contextlib import nullcontext
from time import perf_counter
from typing import Any

import torch
from transformers import DynamicCache

from semif_serve.scoring.cache import can_share_prefix, replicate_cache, share_prefix
from semif_serve.scoring.model import ScoringModel
from semif_serve.scoring.prefix_attention import attending_to, enable_prefix_attention
from semif_serve.scoring.prompt import EncodedPrompt
from semif_serve.scoring.result import build_result
from semif_serve.scoring.rows import Row
from semif_serve.scoring.shared_prompts import encode_shared

SERVING_CONFIG = "native-state-prefix-parallel-v1"
PACKED_CHUNK_TOKENS = 512


def score_shared(
    scoring_model: ScoringModel, rows: list[Row | dict], *, max_tokens: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Score rows that share one exact state; returns (results in row order, timing)."""
    started = perf_counter()
    parsed, prompts, prefix_ids = encode_shared(scoring_model.tokenizer, rows, max_tokens)
    encode_seconds = perf_counter() - started

    forward = _forward_packed if is_pure_attention(scoring_model.model) else _forward
    letter_logits, forward_timing = forward(scoring_model.model, prefix_ids, prompts)

    model_block = {**scoring_model.info.as_dict(), "serving_config": SERVING_CONFIG}
    forward_seconds = forward_timing["prefill_seconds"] + forward_timing["suffix_forward_seconds"]
    total_seconds = perf_counter() - started
    results = [
        build_result(
            row,
            prompt,
            logits,
            model=model_block,
            forward_seconds=forward_seconds,
            total_seconds=total_seconds,
        )
        for row, prompt, logits in zip(parsed, prompts, letter_logits)
    ]
    padded_suffix_tokens = forward_timing.pop("padded_suffix_tokens")
    timing = {
        "total_seconds": total_seconds,
        "encode_seconds": encode_seconds,
        "prefix_tokens": len(prefix_ids),
        **forward_timing,
        "batch_size": len(parsed),
        "true_suffix_tokens": sum(len(prompt.ids) - len(prefix_ids) for prompt in prompts),
        "padded_suffix_tokens": padded_suffix_tokens,
    }
    return results, timing


def _forward(
    model: Any, prefix_ids: list[int], prompts: list[EncodedPrompt]
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Prefill once; the suffixes as one right-padded batch over it; letter logits per row (CPU).

    Right padding keeps every row exact: a row's real tokens never see its padding (attention is
    causal and the recurrent layers run left to right), and each row is read at its last real
    token. Position ids continue from the prefix in every row.
    """
    device = model.device
    rows = len(prompts)
    prefix_length = len(prefix_ids)
    suffixes = [prompt.ids[prefix_length:] for prompt in prompts]
    lengths = torch.tensor([len(suffix) for suffix in suffixes], dtype=torch.long)
    longest = int(lengths.max())
    suffix_ids = torch.zeros((rows, longest), dtype=torch.long)
    for index, suffix in enumerate(suffixes):
        suffix_ids[index, : len(suffix)] = torch.tensor(suffix, dtype=torch.long)
    position_ids = (torch.arange(longest, dtype=torch.long) + prefix_length).expand(rows, -1)
    real = torch.arange(longest)[None, :] < lengths[:, None]  # (rows, longest): not padding

    base_model = model.get_decoder()
    output_embeddings = model.get_output_embeddings()
    sharing = enable_prefix_attention(model)
    with torch.inference_mode():
        prefill_started = perf_counter()
        cache = _prefill(base_model, model.config, prefix_ids, device)
        layout_started = perf_counter()
        if sharing and can_share_prefix(cache):
            # One prefix copy for every row; the mask covers each row's own suffix keys only.
            attending = attending_to(share_prefix(cache, rows))
            causal = torch.ones((longest, longest), dtype=torch.bool).tril()
            attention_mask = (causal[None] & real[:, None, :])[:, None]
        else:
            attending = nullcontext()
            replicate_cache(cache, rows)
            prefix_mask = torch.ones((rows, prefix_length), dtype=torch.long)
            attention_mask = torch.cat([prefix_mask, real.long()], dim=1)
        _synchronize(device)
        suffix_started = perf_counter()
        with attending:
            hidden = _continue(base_model, cache, suffix_ids, attention_mask, position_ids)
        last_hidden = hidden[torch.arange(rows, device=device), (lengths - 1).to(device)]
        logits = output_embeddings(last_hidden).float()
        letter_logits = _letter_logits(logits, prompts, device)
        suffix_seconds = perf_counter() - suffix_started
    del cache, hidden, logits
    return letter_logits, {
        "prefill_seconds": layout_started - prefill_started,
        "replicate_seconds": suffix_started - layout_started,
        "suffix_forward_seconds": suffix_seconds,
        "padded_suffix_tokens": rows * longest,
    }


def _prefill(base_model: Any, config: Any, prefix_ids: list[int], device: torch.device) -> Any:
    """The prefix's cache, batch 1 (call inside inference_mode)."""
    cache = DynamicCache(config=config)
    base_model(
        input_ids=torch.tensor([prefix_ids], dtype=torch.long, device=device),
        cache=cache,
        use_cache=True,
    )
    _synchronize(device)
    return cache


def _continue(
    base_model: Any,
    cache: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """The decoder's last hidden states for tokens that continue the cached prefix."""
    device = base_model.device
    return base_model(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device),
        cache=cache,
        use_cache=True,
    ).last_hidden_state


def is_pure_attention(model: Any) -> bool:
    """True when every layer is plain attention, so suffixes can share ONE copy of the prefix."""
    layer_types = getattr(model.config, "layer_types", None)
    return not layer_types or all(kind == "full_attention" for kind in layer_types)


def _forward_packed(
    model: Any, prefix_ids: list[int], prompts: list[EncodedPrompt]
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Attention-only models: suffixes packed into rows after ONE prefix cache, a chunk at a time.

    A block mask lets each suffix token see the prefix and its own suffix's earlier tokens only,
    and position ids restart at the prefix length for every suffix, so each row computes exactly
    what its direct prompt would. Nothing is replicated and nothing is padded. Rows are packed in
    chunks of about `PACKED_CHUNK_TOKENS`: a packed token also scores (then masks) the other
    suffixes of its chunk, so smaller chunks waste less attention and larger ones make fewer
    forward calls. After each chunk the cache is cut back to the prefix.
    """
    device = model.device
    prefix_length = len(prefix_ids)
    suffixes = [prompt.ids[prefix_length:] for prompt in prompts]
    base_model = model.get_decoder()
    output_embeddings = model.get_output_embeddings()
    last_hidden = []
    with torch.inference_mode():
        prefill_started = perf_counter()
        cache = _prefill(base_model, model.config, prefix_ids, device)
        prefix_layers = [(layer.keys, layer.values) for layer in cache.layers]
        suffix_started = perf_counter()
        for chunk in _chunks(suffixes, PACKED_CHUNK_TOKENS):
            ids, mask, positions, last = _packed_inputs(chunk, prefix_length, model.dtype)
            hidden = _continue(base_model, cache, ids, mask, positions)
            last_hidden.append(hidden[0, last.to(device)])
            for layer, (keys, values) in zip(cache.layers, prefix_layers):
                layer.keys, layer.values = keys, values
        logits = output_embeddings(torch.cat(last_hidden)).float()
        letter_logits = _letter_logits(logits, prompts, device)
        suffix_seconds = perf_counter() - suffix_started
    del cache, prefix_layers, hidden, logits
    return letter_logits, {
        "prefill_seconds": suffix_started - prefill_started,
        "replicate_seconds": 0.0,
        "suffix_forward_seconds": suffix_seconds,
        "padded_suffix_tokens": sum(len(suffix) for suffix in suffixes),  # nothing is padded
    }


def _chunks(suffixes: list[list[int]], tokens: int) -> list[list[list[int]]]:
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


def _packed_inputs(
    suffixes: list[list[int]], prefix_length: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed row: token ids, the block mask over prefix + row, position ids, last indices."""
    lengths = [len(suffix) for suffix in suffixes]
    total = sum(lengths)
    ids = torch.tensor([[token for suffix in suffixes for token in suffix]], dtype=torch.long)
    positions = torch.cat([torch.arange(length) for length in lengths]) + prefix_length
    allowed = torch.zeros((total, prefix_length + total), dtype=torch.bool)
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


def _letter_logits(
    logits: torch.Tensor, prompts: list[EncodedPrompt], device
) -> list[torch.Tensor]:
    """Each row's option-letter logits, in option order, on the CPU: one gather and one copy to
    the CPU for all rows (a per-row read would wait on the device once per row)."""
    counts = [len(prompt.letter_token_ids) for prompt in prompts]
    widest = max(counts)
    padded = [ids + [0] * (widest - len(ids)) for ids in (p.letter_token_ids for p in prompts)]
    letters = torch.tensor(padded, dtype=torch.long, device=device)
    gathered = logits.gather(1, letters).cpu()
    return [gathered[row, :count] for row, count in enumerate(counts)]


def _synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so the phase timings measure the phase, not the launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
