"""The shared scorer: many rows over one exact state, the state prefix computed once.

1. Encode every row's full prompt (every direct guard applies) and the state prefix: the rendered
   text up to and including `{"evidence": <state>`, minus its last token, since JSON punctuation
   can merge with the token after it. Upstream SemIf raises when a prompt's tokens do not start
   with that prefix; here the prefix backs off to the tokens every prompt does share (a state
   ending in `}]}` merges further back than one token on common BPE vocabularies). Either way
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

from time import perf_counter
from typing import Any

import torch
from transformers import DynamicCache

from semif_serve.scoring.cache import replicate_cache
from semif_serve.scoring.model import ScoringModel
from semif_serve.scoring.prompt import (
    ChatTokenizer,
    EncodedPrompt,
    PromptRejected,
    encode,
    encode_prompt,
    state_head,
    user_message,
)
from semif_serve.scoring.result import build_result
from semif_serve.scoring.rows import InvalidRow, Row, as_row

SERVING_CONFIG = "native-state-prefix-parallel-v1"


def score_shared(
    scoring_model: ScoringModel, rows: list[Row | dict], *, max_tokens: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Score rows that share one exact state; returns (results in row order, timing)."""
    started = perf_counter()
    parsed = check_shared_rows(_parse_rows(rows))
    tokenizer = scoring_model.tokenizer
    prompts = [_encode_row(tokenizer, index, row, max_tokens) for index, row in enumerate(parsed)]
    prefix_ids = shared_prefix(state_prefix_ids(tokenizer, parsed[0], prompts[0].text), prompts)
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


def _parse_rows(rows: list[Row | dict]) -> list[Row]:
    parsed = []
    for index, row in enumerate(rows):
        try:
            parsed.append(as_row(row))
        except InvalidRow as error:
            raise InvalidRow(f"rows[{index}]: {error}", row_index=index) from None
    return parsed


def check_shared_rows(rows: list[Row]) -> list[Row]:
    """At least one row, all with the exact same state, and unique ids."""
    if not rows:
        raise InvalidRow("rows: the shared scorer needs at least one row")
    state_key = rows[0].state_key
    seen: set[str] = set()
    for index, row in enumerate(rows):
        if row.state_key != state_key:
            raise InvalidRow(
                f"rows[{index}].state: differs from rows[0].state; shared rows need the exact "
                "same state",
                row_index=index,
            )
        if row.id in seen:
            raise InvalidRow(f"rows[{index}].id: duplicate id {row.id!r}", row_index=index)
        seen.add(row.id)
    return rows


def _encode_row(tokenizer: ChatTokenizer, index: int, row: Row, max_tokens: int) -> EncodedPrompt:
    try:
        return encode_prompt(tokenizer, row, max_tokens)
    except PromptRejected as error:
        raise PromptRejected(f"rows[{index}]: {error}", row_index=index) from None


def state_prefix_ids(tokenizer: ChatTokenizer, row: Row, text: str) -> list[int]:
    """Tokens of the rendered text through the evidence, minus the last (it may merge onward)."""
    content = user_message(row)
    position = text.find(content)
    if position < 0:
        raise PromptRejected(
            "shared prefix guard: the chat template changed the user message, so the state "
            "prefix cannot be located"
        )
    prefix_ids = encode(tokenizer, text[: position + len(state_head(row))])[:-1]
    if not prefix_ids:
        raise PromptRejected("shared prefix guard: the state prefix encodes to no tokens")
    return prefix_ids


def shared_prefix(prefix_ids: list[int], prompts: list[EncodedPrompt]) -> list[int]:
    """The longest start of `prefix_ids` that every prompt's token ids begin with."""
    length = len(prefix_ids)
    for prompt in prompts:
        length = min(length, _common_length(prefix_ids, prompt.ids))
    if length == 0:
        raise PromptRejected("shared prefix guard: the prompts share no leading tokens")
    return prefix_ids[:length]


def _common_length(left: list[int], right: list[int]) -> int:
    for index, (a, b) in enumerate(zip(left, right)):
        if a != b:
            return index
    return min(len(left), len(right))


def _forward(
    model: Any, prefix_ids: list[int], prompts: list[EncodedPrompt]
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Prefill once, replicate, one right-padded suffix batch; letter logits per row (CPU)."""
    device = model.device
    rows = len(prompts)
    prefix_length = len(prefix_ids)
    suffixes = [prompt.ids[prefix_length:] for prompt in prompts]
    longest = max(len(suffix) for suffix in suffixes)

    suffix_ids = torch.zeros((rows, longest), dtype=torch.long)
    attention_mask = torch.zeros((rows, prefix_length + longest), dtype=torch.long)
    attention_mask[:, :prefix_length] = 1
    for index, suffix in enumerate(suffixes):
        suffix_ids[index, : len(suffix)] = torch.tensor(suffix, dtype=torch.long)
        attention_mask[index, prefix_length : prefix_length + len(suffix)] = 1
    position_ids = (torch.arange(longest, dtype=torch.long) + prefix_length).expand(rows, -1)
    last_real = torch.tensor([len(suffix) - 1 for suffix in suffixes], dtype=torch.long)

    base_model = model.get_decoder()
    output_embeddings = model.get_output_embeddings()
    with torch.inference_mode():
        prefill_started = perf_counter()
        cache = _prefill(base_model, model.config, prefix_ids, device)
        replicate_started = perf_counter()
        replicate_cache(cache, rows)
        _synchronize(device)
        suffix_started = perf_counter()
        hidden = base_model(
            input_ids=suffix_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            cache=cache,
            use_cache=True,
        ).last_hidden_state
        last_hidden = hidden[torch.arange(rows, device=device), last_real.to(device)]
        logits = output_embeddings(last_hidden).float()
        letter_logits = _letter_logits(logits, prompts, device)
        suffix_seconds = perf_counter() - suffix_started
    del cache, hidden, logits
    return letter_logits, {
        "prefill_seconds": replicate_started - prefill_started,
        "replicate_seconds": suffix_started - replicate_started,
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


def is_pure_attention(model: Any) -> bool:
    """True when every layer is plain attention, so suffixes can share ONE copy of the prefix."""
    layer_types = getattr(model.config, "layer_types", None)
    return not layer_types or all(kind == "full_attention" for kind in layer_types)


def _forward_packed(
    model: Any, prefix_ids: list[int], prompts: list[EncodedPrompt]
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Attention-only models: all suffixes packed into ONE row after ONE prefix cache.

    A block mask lets each suffix token see the prefix and its own suffix's earlier tokens only,
    and position ids restart at the prefix length for every suffix, so each row computes exactly
    what its direct prompt would. Nothing is replicated and nothing is padded: memory per extra
    row no longer grows with the prefix length.
    """
    device = model.device
    prefix_length = len(prefix_ids)
    suffixes = [prompt.ids[prefix_length:] for prompt in prompts]
    lengths = [len(suffix) for suffix in suffixes]
    total = sum(lengths)
    positions = torch.cat([torch.arange(length) for length in lengths]) + prefix_length
    allowed = torch.zeros((total, prefix_length + total), dtype=torch.bool)
    allowed[:, :prefix_length] = True
    start = 0
    for length in lengths:
        block = slice(start, start + length)
        own = slice(prefix_length + start, prefix_length + start + length)
        allowed[block, own] = torch.ones((length, length), dtype=torch.bool).tril()
        start += length
    dtype = model.dtype
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    last_real = torch.tensor(lengths).cumsum(0) - 1

    base_model = model.get_decoder()
    output_embeddings = model.get_output_embeddings()
    with torch.inference_mode():
        prefill_started = perf_counter()
        cache = _prefill(base_model, model.config, prefix_ids, device)
        suffix_started = perf_counter()
        hidden = base_model(
            input_ids=torch.tensor(
                [[token for suffix in suffixes for token in suffix]], device=device
            ),
            attention_mask=mask[None, None].to(device),
            position_ids=positions[None].to(device),
            cache=cache,
            use_cache=True,
        ).last_hidden_state
        logits = output_embeddings(hidden[0, last_real.to(device)]).float()
        letter_logits = _letter_logits(logits, prompts, device)
        suffix_seconds = perf_counter() - suffix_started
    del cache, hidden, logits
    return letter_logits, {
        "prefill_seconds": suffix_started - prefill_started,
        "replicate_seconds": 0.0,
        "suffix_forward_seconds": suffix_seconds,
        "padded_suffix_tokens": total,  # packed: nothing is padded
    }


def _letter_logits(
    logits: torch.Tensor, prompts: list[EncodedPrompt], device
) -> list[torch.Tensor]:
    """Each row's option-letter logits, in option order, on the CPU."""
    return [
        logits[index]
        .index_select(0, torch.tensor(prompt.letter_token_ids, dtype=torch.long, device=device))
        .cpu()
        for index, prompt in enumerate(prompts)
    ]


def _synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so the phase timings measure the phase, not the launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
