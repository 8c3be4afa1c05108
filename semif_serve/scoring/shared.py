"""The shared scorer: many rows over one exact state, the state prefix computed once.

1. Encode every row's full prompt and the shared state prefix (`shared_prompts.encode_shared`):
   each row is scored on exactly the token ids the direct scorer would see.
2. Prefill the prefix once (batch 1; `prefill.py`).
3. Attention-only models on the stock kernels (`packed.forward_packed`): all suffixes in ONE row
   after that one prefix cache, with a block mask and per-suffix position ids. Models with
   linear-attention layers, and every model on the CPU's invariant numerics (whose attention
   needs each suffix's keys where its direct prompt has them; `invariant.py`) (`_forward`):
   one prefix copy joined per row (`prefix_attention`) or the cache copied to n rows
   (`replicate_cache`), the suffixes right-padded,
   with position ids continuing from the prefix and a mask over prefix + real suffix tokens;
   right padding keeps the recurrent layers exact (a row's real tokens never see its padding).
4. Read each row's logits at its own last real token.
With a `ModelPrefixCache` (`prefix_cache.py`), step 2 resumes from a stored prefill of the same
prefix when there is one (`cache_hit`), and stores its own otherwise.
With shape buckets (`shapes.py`; on for CUDA models by default) the prefill is cut down to a
prefix bucket, suffixes and rows are padded to buckets, and big calls run in several suffix
forwards, so that every forward has one of the shapes warm-up ran; the results are the same.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from time import perf_counter
from typing import Any

import torch

from semif_serve.scoring import invariant
from semif_serve.scoring.cache import (
    can_share_prefix,
    replicate_cache,
    share_prefix,
    working_copy,
)
from semif_serve.scoring.head import letter_logits
from semif_serve.scoring.inputs import SharedInput, shared_input
from semif_serve.scoring.model import ScoringModel
from semif_serve.scoring.packed import forward_packed
from semif_serve.scoring.padded import last_hidden_states
from semif_serve.scoring.prefill import (
    continue_from,
    prefill_length,
    prefilled,
    reuse_timing,
    synchronize,
)
from semif_serve.scoring.prefix_attention import attending_to, enable_prefix_attention
from semif_serve.scoring.prefix_cache import ModelPrefixCache, Reuse
from semif_serve.scoring.prompt import EncodedPrompt, prompt_sha256
from semif_serve.scoring.result import build_result
from semif_serve.scoring.rows import Row
from semif_serve.scoring.shapes import AUTO, PAD_TOKEN_ID, Buckets, resolve
from semif_serve.scoring.shared_prompts import state_head_end

SERVING_CONFIG = "native-state-prefix-parallel-v1"


def score_shared(
    scoring_model: ScoringModel,
    rows: list[Row | dict] | SharedInput,
    *,
    max_tokens: int,
    buckets: Buckets | None | str = AUTO,
    prefix_cache: ModelPrefixCache | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Score rows that share one exact state; returns (results in row order, timing).

    `buckets` (`shapes.AUTO`: on for CUDA models, off on the CPU) gives every forward a
    bucketed shape; the results are the same (see `semif_serve.scoring.shapes`). With
    `prefix_cache`, a stored prefill of the state prefix is reused (same results). A
    `SharedInput` (encoded beforehand, `inputs.shared_input`) is scored as it is."""
    if not isinstance(rows, SharedInput) or rows.max_tokens != max_tokens:
        plain = rows.rows if isinstance(rows, SharedInput) else rows
        rows = shared_input(scoring_model.tokenizer, plain, max_tokens)
    started = perf_counter() - rows.encode_seconds
    parsed, prompts, prefix_ids = rows.rows, rows.prompts, rows.prefix_ids

    model = scoring_model.model
    cache = None
    if prefix_cache is not None:
        cache = prefix_cache.within(parsed[0].cache_key, rows.breakpoints)
    row_logits, forward_timing = forward(
        model, prefix_ids, prompts, resolve(buckets, model.device), cache
    )
    return shared_outcome(scoring_model, rows, row_logits, forward_timing, started)


def shared_outcome(
    scoring_model: ScoringModel,
    rows: SharedInput,
    row_logits: list[torch.Tensor],
    forward_timing: dict[str, Any],
    started: float,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A shared call's (results, timing), from its rows' letter logits and its forward's
    timing (`forward`'s, with `cache_hit`); `started`: when the call began (perf_counter)."""
    parsed, prompts = rows.rows, rows.prompts
    forward_timing = dict(forward_timing)
    cache_fields = {
        "cache_hit": forward_timing.pop("cache_hit"),
        "prefix_sha256": state_prefix_sha256(parsed[0], prompts[0].text),
    }

    model_block = {**scoring_model.info.as_dict(), "serving_config": SERVING_CONFIG}
    forward_seconds = forward_timing["prefill_seconds"] + forward_timing["suffix_forward_seconds"]
    total_seconds = perf_counter() - started
    results = [
        build_result(
            row,
            prompt,
            logits,
            scorer="shared",
            model=model_block,
            forward_seconds=forward_seconds,
            total_seconds=total_seconds,
        )
        | cache_fields
        for row, prompt, logits in zip(parsed, prompts, row_logits)
    ]
    padded_suffix_tokens = forward_timing.pop("padded_suffix_tokens")
    prefix_tokens = forward_timing.pop("prefix_tokens")
    timing = {
        "total_seconds": total_seconds,
        "encode_seconds": rows.encode_seconds,
        "prefix_tokens": prefix_tokens,
        **forward_timing,
        "batch_size": len(parsed),
        "true_suffix_tokens": sum(len(prompt.ids) - prefix_tokens for prompt in prompts),
        "padded_suffix_tokens": padded_suffix_tokens,
    }
    return results, timing


def state_prefix_sha256(row: Row, text: str) -> str | None:
    """sha256 of the rendered prompt through the state (`{"evidence": <state>`), as SemIf's
    serial prefix scorer reports it; None when the chat template changed the user message."""
    end = state_head_end(row, text)
    return None if end is None else prompt_sha256(text[:end])


def forward(
    model: Any,
    prefix_ids: list[int],
    prompts: list[EncodedPrompt],
    buckets: Buckets | None,
    prefix_cache: ModelPrefixCache | None = None,
    rows_cache: Callable[[Any, range], None] | None = None,
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The forward stage: each prompt's letter logits (CPU) and the phase timings (with
    `cache_hit`). Every prompt's ids begin with `prefix_ids`, of which
    `prefill.prefill_length` are prefilled (the rest start every suffix): with `buckets` a
    prefix bucket's worth, and every forward has a bucketed shape; without, a model with
    linear-attention layers stops at the start of a delta-rule chunk. With no prefix left, each
    prompt runs whole (`padded`). With `prefix_cache`, the prefill may be a stored one.
    `rows_cache(cache, rows)`: called after each suffix forward with its cache, which then holds
    every row's own keys and values, prefix included (rows: those prompts' indices)."""
    prefix_ids = prefix_ids[: prefill_length(model.config, len(prefix_ids), buckets)]
    if not prefix_ids:
        return _unshared(model, prompts, buckets)
    if is_pure_attention(model) and not invariant.installed(model) and rows_cache is None:
        return forward_packed(model, prefix_ids, prompts, buckets, prefix_cache)
    return _forward(model, prefix_ids, prompts, buckets, prefix_cache, rows_cache)


def _forward(
    model: Any,
    prefix_ids: list[int],
    prompts: list[EncodedPrompt],
    buckets: Buckets | None,
    prefix_cache: ModelPrefixCache | None,
    rows_cache: Callable[[Any, range], None] | None = None,
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Prefill once; the suffixes as right-padded batches over it; letter logits per row (CPU).

    Right padding keeps every row exact: a row's real tokens never see its padding (attention is
    causal and the recurrent layers run left to right), and each row is read at its last real
    token. Position ids continue from the prefix in every row. Without buckets all rows go in
    one batch; with them, in groups of at most `rows_per_forward` rows, each over its own copy
    of the prefilled cache (the recurrent layers update their states in place).
    """
    prefix_length = len(prefix_ids)
    suffixes = [prompt.ids[prefix_length:] for prompt in prompts]
    groups = _row_groups(suffixes, buckets)
    base_model = model.get_decoder()
    sharing = enable_prefix_attention(model) and rows_cache is None
    last_hidden = []
    layout_seconds = suffix_seconds = 0.0
    padded_tokens = 0
    started = perf_counter()
    with (
        torch.inference_mode(),
        prefilled(base_model, model.config, prefix_ids, prefix_cache) as (cache, reuse),
    ):
        prefill_seconds = perf_counter() - started
        first_row = 0
        for group in groups:
            group_cache = _group_copy(cache) if len(groups) > 1 else cache
            hidden, timing = _suffix_forward(
                base_model, group_cache, group, prefix_length, sharing, buckets
            )
            if rows_cache is not None:
                rows_cache(group_cache, range(first_row, first_row + len(group)))
            first_row += len(group)
            last_hidden.append(hidden)
            layout_seconds += timing[0]
            suffix_seconds += timing[1]
            padded_tokens += timing[2]
            del group_cache
        letters_started = perf_counter()
        letters = letter_logits(model, torch.cat(last_hidden), prompts)
        suffix_seconds += perf_counter() - letters_started
    del cache, last_hidden
    return letters, {
        **reuse_timing(reuse),
        "prefix_tokens": prefix_length,
        "prefill_seconds": prefill_seconds,
        "replicate_seconds": layout_seconds,
        "suffix_forward_seconds": suffix_seconds,
        "padded_suffix_tokens": padded_tokens,
    }


def _unshared(
    model: Any, prompts: list[EncodedPrompt], buckets: Buckets | None
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """`forward` with no prefix to prefill: the prompts whole, in one right-padded forward."""
    started = perf_counter()
    with torch.inference_mode():
        rows, shape = last_hidden_states(model, [prompt.ids for prompt in prompts], buckets)
        letters = letter_logits(model, rows, prompts)
    return letters, {
        **reuse_timing(Reuse()),
        "prefix_tokens": 0,
        "prefill_seconds": 0.0,
        "replicate_seconds": 0.0,
        "suffix_forward_seconds": perf_counter() - started,
        "padded_suffix_tokens": shape[0] * shape[1],
    }


def _group_copy(cache: Any) -> Any:
    """A copy of the prefilled cache for one group of rows to consume."""
    return working_copy(cache) if can_share_prefix(cache) else copy.deepcopy(cache)


def _row_groups(suffixes: list[list[int]], buckets: Buckets | None) -> list[list[list[int]]]:
    """Consecutive runs of suffixes, one suffix forward each: all of them without buckets."""
    if buckets is None:
        return [suffixes]
    per_forward = buckets.rows_per_forward(buckets.length(max(map(len, suffixes))))
    return [suffixes[start : start + per_forward] for start in range(0, len(suffixes), per_forward)]


def _suffix_forward(
    base_model: Any,
    cache: Any,
    suffixes: list[list[int]],
    prefix_length: int,
    sharing: bool,
    buckets: Buckets | None,
) -> tuple[torch.Tensor, tuple[float, float, int]]:
    """One right-padded batch of suffixes over `cache` (consumed): each row's last real hidden
    state, and (layout seconds, forward seconds, padded tokens). With buckets the batch has
    `buckets.rows(n)` rows (copies of the last row fill it) of `buckets.length(longest)`."""
    device = base_model.device
    rows = len(suffixes)
    lengths = [len(suffix) for suffix in suffixes]
    width = max(lengths)
    if buckets is not None:
        suffixes = suffixes + [suffixes[-1]] * (buckets.rows(rows) - rows)
        lengths = [len(suffix) for suffix in suffixes]
        width = buckets.length(width)
    padded_rows = len(suffixes)
    suffix_ids = torch.full((padded_rows, width), PAD_TOKEN_ID, dtype=torch.long)
    for index, suffix in enumerate(suffixes):
        suffix_ids[index, : len(suffix)] = torch.tensor(suffix, dtype=torch.long)
    position_ids = (torch.arange(width, dtype=torch.long) + prefix_length).expand(padded_rows, -1)
    real_lengths = torch.tensor(lengths, dtype=torch.long)
    real = torch.arange(width)[None, :] < real_lengths[:, None]  # (rows, width): not padding

    layout_started = perf_counter()
    if sharing and can_share_prefix(cache):
        # One prefix copy for every row; the mask covers each row's own suffix keys only.
        attending = attending_to(share_prefix(cache, padded_rows))
        causal = torch.ones((width, width), dtype=torch.bool).tril()
        attention_mask = (causal[None] & real[:, None, :])[:, None]
    else:
        attending = nullcontext()
        replicate_cache(cache, padded_rows)
        prefix_mask = torch.ones((padded_rows, prefix_length), dtype=torch.long)
        attention_mask = torch.cat([prefix_mask, real.long()], dim=1)
    synchronize(device)
    suffix_started = perf_counter()
    with attending:
        hidden = continue_from(base_model, cache, suffix_ids, attention_mask, position_ids)
    last = (real_lengths[:rows] - 1).to(device)
    last_hidden = hidden[torch.arange(rows, device=device), last]
    return last_hidden, (
        suffix_started - layout_started,
        perf_counter() - suffix_started,
        padded_rows * width,
    )


def is_pure_attention(model: Any) -> bool:
    """True when every layer is plain attention, so suffixes can share ONE copy of the prefix."""
    layer_types = getattr(model.config, "layer_types", None)
    return not layer_types or all(kind == "full_attention" for kind in layer_types)
