"""The direct scorer: one row, one forward, the letter logits at the last position.

With a state-prefix cache, a row whose state prefix is long enough runs as a shared call of one
row (`shared.forward`), so that its prefill can be stored and reused.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any

import torch

from semif_serve.scoring import head, shared
from semif_serve.scoring.inputs import DirectInput, direct_input
from semif_serve.scoring.model import ScoringModel
from semif_serve.scoring.prefill import result_reuse
from semif_serve.scoring.prefix_cache import ModelPrefixCache
from semif_serve.scoring.result import build_result
from semif_serve.scoring.rows import Row
from semif_serve.scoring.shapes import AUTO, PAD_TOKEN_ID, Buckets, resolve


def score(
    scoring_model: ScoringModel,
    row: Row | dict | DirectInput,
    *,
    max_tokens: int,
    buckets: Buckets | None | str = AUTO,
    prefix_cache: ModelPrefixCache | None = None,
) -> dict[str, Any]:
    """Score one SemIf row; raises ValueError (naming the field or guard) for a bad row.

    `buckets` (`shapes.AUTO`: on for CUDA models, off on the CPU) right-pads the prompt to its
    length bucket; the result is the same (see `semif_serve.scoring.shapes`). With a
    `prefix_cache` and a state prefix long enough to cache, the row runs as the shared scorer
    runs one row: its state prefix prefilled (or resumed from a stored prefill), then its
    suffix; the result is the same within float rounding (see tests/test_prefix_cache.py).
    A `DirectInput` (encoded beforehand, `inputs.direct_input`) is scored as it is."""
    if not isinstance(row, DirectInput) or row.max_tokens != max_tokens:
        with_prefix = prefix_cache is not None
        row = direct_input(scoring_model.tokenizer, _row(row), max_tokens, with_prefix=with_prefix)
    started = perf_counter() - row.encode_seconds
    parsed, prompt, prefix_ids = row.row, row.prompt, row.prefix_ids
    model = scoring_model.model
    buckets = resolve(buckets, model.device)

    forward_started = perf_counter()
    if prefix_ids is not None and prefix_cache is not None and prefix_cache.caches(len(prefix_ids)):
        cache = prefix_cache.within(parsed.cache_key, row.breakpoints)
        logits, timing = shared.forward(model, prefix_ids, [prompt], buckets, cache)
        letter_logits, reuse = logits[0], result_reuse(timing)
    else:
        with torch.inference_mode():
            hidden = last_hidden(model, prompt.ids, buckets)
            letter_logits = head.letter_logits(model, hidden[None], [prompt])[0]
        reuse = result_reuse(None)
    forward_seconds = perf_counter() - forward_started

    return (
        build_result(
            parsed,
            prompt,
            letter_logits,
            scorer="direct",
            model=scoring_model.info.as_dict(),
            forward_seconds=forward_seconds,
            total_seconds=perf_counter() - started,
        )
        | reuse
        | {"prefix_sha256": shared.state_prefix_sha256(parsed, prompt.text)}
    )


def _row(row: Row | dict | DirectInput) -> Row | dict:
    return row.row if isinstance(row, DirectInput) else row


def last_hidden(model: Any, ids: list[int], buckets: Buckets | None) -> torch.Tensor:
    """The decoder's hidden state (hidden_size,) at the last of `ids`: one uncached forward of
    shape (1, length), `length` = len(ids), or its bucket with right padding (call inside
    inference_mode); `head.letter_logits` reads the letters from it, as on every path."""
    length = len(ids) if buckets is None else buckets.length(len(ids))
    input_ids = torch.full((1, length), PAD_TOKEN_ID, dtype=torch.long)
    input_ids[0, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    decoder = model.get_decoder()
    output = decoder(input_ids=input_ids.to(model.device), use_cache=False)
    return output.last_hidden_state[0, len(ids) - 1]
