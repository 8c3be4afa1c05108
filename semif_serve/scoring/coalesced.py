"""Several requests coalesced into as few forwards as exactness allows, each getting exactly the
result it gets alone (issue 23).

A model's scheduler (`runtime/scheduler.py`) hands the batch it chose here as one call:
- direct rows that run as a plain prompt (no prefix cache, or a state prefix too short to
  cache) go in ONE right-padded forward: rows × their longest prompt, each row read at its own
  last real token. Right padding is exact for attention (causal) and for linear-attention
  layers (they run left to right), so a row's real tokens never see another row or padding;
- direct rows over one state prefix are grouped by it when the cache takes that prefix or
  another row in the batch has it too: each group is one shared forward (one prefill, or a
  stored one resumed, then every row's suffix), as a shared call over those rows would run, so
  requests over the same state share its prefill, cache or not (rows of different sessions,
  `Row.cache_key`, never share one: each session reuses and stores only its own prefixes);
- a lone row (a direct row alone over its state, a one-row shared call) over a state prefix
  the cache would take but holds nothing of runs with the plain prompts below, and its prefix
  is cut out of that forward and stored as its own prefill would have been, when its model is
  attention-only on the invariant numerics (those keys and values are then a lone prefill's,
  bit for bit); otherwise it runs alone, to prefill and store it;
- a `/decide/shared` call (a `SharedInput`) of several rows runs as a unit, never split; one
  of a single row (each ecosystem request of one question) runs as a direct row does, but for
  its result's shape (the shared scorer's, `shared.shared_outcome`);
- with the model's `TemplatePrefix` (the prompt start every request shares), the rows that run
  as plain prompts go in ONE shared forward over it instead: its prefill kept once per model,
  then every row's own tokens (`shared.forward`: packed without padding for attention-only
  models on the stock kernels), so a batch of distinct states prefills none of the template
  again.
Each input gets a `Batched`: its outcome (direct: a result dict; shared: (results, timing); or
the `RowError` its own row raised: any other failure is the whole call's) and the rows and
padded length of the forward it ran in, and that `Forward` itself as it ran (the metrics).
Results are the scorers' own (nothing added): the server shows the batch figures next to them.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch

from semif_serve.errors import LEFT_BEFORE_FORWARD, ClientGone
from semif_serve.scoring import invariant, shared
from semif_serve.scoring.cache import row_prefix
from semif_serve.scoring.direct import score as score_direct
from semif_serve.scoring.head import letter_logits
from semif_serve.scoring.inputs import Batched, DirectInput, Forward, SharedInput
from semif_serve.scoring.model import ScoringModel
from semif_serve.scoring.padded import last_hidden_states
from semif_serve.scoring.prefill import result_reuse, reuse_timing
from semif_serve.scoring.prefix_cache import ModelPrefixCache, Reuse
from semif_serve.scoring.result import build_result
from semif_serve.scoring.rows import RowError
from semif_serve.scoring.shapes import AUTO, Buckets, resolve
from semif_serve.scoring.shared import score_shared, shared_outcome, state_prefix_sha256
from semif_serve.scoring.template import TemplatePrefix

Input = DirectInput | SharedInput


def score_batch(
    scoring_model: ScoringModel,
    inputs: list[Input],
    *,
    max_tokens: int,
    buckets: Buckets | None | str = AUTO,
    prefix_cache: ModelPrefixCache | None = None,
    template: TemplatePrefix | None = None,
    left: Callable[[Input], bool] | None = None,
) -> list[Any]:
    """Each input's `Batched` outcome, in input order. `left(input)`: True once its caller has
    gone; the inputs of each forward are looked at just before it runs, and one whose caller
    left is not run (its outcome: `ClientGone`, as the engine's batch call hands it on)."""
    outcomes: list[Any] = [None] * len(inputs)
    plain, by_prefix = [], {}
    keep: dict[int, ModelPrefixCache] = {}  # inputs whose batch forward stores their prefix
    for index, item in enumerate(inputs):
        joins = item.max_tokens == max_tokens and _mergeable(item, prefix_cache)
        if not joins and item.max_tokens == max_tokens:  # a one-row shared call over a new state
            if view := _stored_by_batch(scoring_model, item, prefix_cache, template):
                keep[index], joins = view, True  # whose prefix the batch's forward stores
        if not joins:
            if _live([index], inputs, left, outcomes):
                outcomes[index] = _alone(scoring_model, item, max_tokens, buckets, prefix_cache)
        elif isinstance(item, SharedInput) or item.prefix_ids is None:
            plain.append(index)
        else:
            by_prefix.setdefault((tuple(item.prefix_ids), item.row.cache_key), []).append(index)
    for group_key, indices in list(by_prefix.items()):  # (prefix ids, session)
        if len(indices) > 1:
            continue
        if not _cached(inputs[indices[0]], prefix_cache):
            plain += by_prefix.pop(group_key)  # alone over its state, and not worth a lookup
        elif view := _stored_by_batch(scoring_model, inputs[indices[0]], prefix_cache, template):
            plain += by_prefix.pop(group_key)
            keep[indices[0]] = view
    plain.sort()
    items = [inputs[index] for index in plain]
    keeps = [keep.get(index) for index in plain]
    ran = _plain(scoring_model, items, max_tokens, buckets, prefix_cache, template, left, keeps)
    for index, outcome in zip(plain, ran):
        outcomes[index] = outcome
    for (prefix, session), indices in by_prefix.items():
        indices = _live(indices, inputs, left, outcomes)
        if not indices:
            continue
        group = [inputs[i] for i in indices]
        marks = tuple(sorted({at for item in group for at in item.breakpoints}))
        cache = prefix_cache.within(session, marks) if _cached(group[0], prefix_cache) else None
        results, timing = _over_prefix(scoring_model, list(prefix), group, buckets, cache)
        width = max(len(item.prompt.ids) for item in group)
        ran = _shared_forward(timing, [item.prompt for item in group])
        for index, result in zip(indices, results):
            outcomes[index] = Batched(result, len(group), width, ran)
    return outcomes


def _plain(
    scoring_model: ScoringModel,
    items: list[Input],
    max_tokens: int,
    buckets: Buckets | None | str,
    prefix_cache: ModelPrefixCache | None,
    template: TemplatePrefix | None,
    left: Callable[[Input], bool] | None,
    keeps: list[ModelPrefixCache | None],
) -> list[Any]:
    """The outcomes of inputs that run as plain prompts: two or more whose prompts begin with
    the template in one forward over it (storing the state prefix of those with a `keeps`
    view); of the rest, two or more direct rows in one right-padded forward, any other alone
    (a batch of one is the unbatched call, exactly, which looks its prefix up and stores it).
    Before each forward, the inputs whose caller left (`left`) leave it."""
    outcomes: list[Any] = [None] * len(items)
    over = [i for i, item in enumerate(items) if template and template.starts(_ids(item))]
    if len(over) > 1:
        over = _live(over, items, left, outcomes)
    if len(over) > 1:
        merged = _over_template(
            scoring_model, template, [items[i] for i in over], buckets, [keeps[i] for i in over]
        )
        for index, outcome in zip(over, merged):
            outcomes[index] = outcome
    else:
        over = []  # one alone is no batch: it runs as the others do
    padded = [
        i
        for i, item in enumerate(items)
        if outcomes[i] is None and i not in over and isinstance(item, DirectInput)
    ]
    padded = _live(padded, items, left, outcomes) if len(padded) > 1 else padded
    if len(padded) > 1:
        rows = [items[i] for i in padded]
        results, shape = _padded(scoring_model, rows, buckets)
        ran = Forward(shape[0], shape[0] * shape[1], sum(len(row.prompt.ids) for row in rows))
        for index, result in zip(padded, results):
            outcomes[index] = Batched(result, len(padded), shape[1], ran)
    for index, item in enumerate(items):
        if outcomes[index] is None and _live([index], items, left, outcomes):
            outcomes[index] = _alone(scoring_model, item, max_tokens, buckets, prefix_cache)
    return outcomes


def _live(
    indices: list[int], items: list[Input], left: Callable[[Input], bool] | None, outcomes: list
) -> list[int]:
    """Those of `indices` whose caller is still there; each other's outcome says it left."""
    kept = []
    for index in indices:
        if left is not None and left(items[index]):
            outcomes[index] = ClientGone(LEFT_BEFORE_FORWARD)
        else:
            kept.append(index)
    return kept


def _shared_forward(timing: dict[str, Any], prompts: list[Any]) -> Forward:
    """What a shared forward over one state ran: its prefill (the prefix tokens not resumed
    from the prefix cache) and every suffix forward, padding and buckets included, against the
    prompts' own tokens."""
    prefill = timing["prefix_tokens"] - timing["cached_tokens"]
    suffixes = sum(len(prompt.ids) - timing["prefix_tokens"] for prompt in prompts)
    return Forward(len(prompts), prefill + timing["padded_suffix_tokens"], prefill + suffixes)


def _mergeable(item: Input, prefix_cache: ModelPrefixCache | None) -> bool:
    """Whether an input may run with other requests' rows: any direct row; a shared call of one
    row whose state prefix the cache would not take (one it would take runs alone, so that a
    state sent again finds its prefill stored, unless the batch stores it: `_stored_by_batch`)."""
    if isinstance(item, DirectInput):
        return True
    return len(item.prompts) == 1 and not _cached(item, prefix_cache)


def _ids(item: Input) -> list[int]:
    """The prompt ids of a direct row or of a one-row shared call."""
    return item.prompts[0].ids if isinstance(item, SharedInput) else item.prompt.ids


def _over_template(
    scoring_model: ScoringModel,
    template: TemplatePrefix,
    items: list[Input],
    buckets: Buckets | None | str,
    keeps: list[ModelPrefixCache | None],
) -> list[Batched]:
    """Rows of distinct requests (direct rows, single-row shared calls) in one shared forward
    over the model's template prefix; each its own outcome. Requests with the same prompt (a
    caller's retry, an item sent twice) are one row of it: the same tokens give the same
    logits, and each request's result is built from them with its own ids. The results say
    they reused no state prefix: the template holds none of a caller's text. A row with a
    `keeps` view has its state prefix's keys and values cut out of the forward and stored
    there, as its own prefill would have been (`_stored_by_batch`)."""
    started = perf_counter()
    model = scoring_model.model
    prompts = [item.prompts[0] if isinstance(item, SharedInput) else item.prompt for item in items]
    rows: dict[tuple[int, ...], int] = {}  # each distinct prompt's row in the forward
    for prompt in prompts:
        rows.setdefault(tuple(prompt.ids), len(rows))
    distinct = list({tuple(prompt.ids): prompt for prompt in prompts}.values())
    stores = {
        rows[tuple(prompt.ids)]: (view, list(item.prefix_ids))
        for item, prompt, view in zip(items, prompts, keeps)
        if view is not None
    }

    stored: set[int] = set()  # the rows whose prefix was stored

    def store_prefixes(cache: Any, forward_rows: range) -> None:
        for row in forward_rows:
            if row in stores:
                view, prefix_ids = stores[row]
                kept = row_prefix(cache, row - forward_rows.start, len(prefix_ids))
                if kept is not None and view.keep(prefix_ids, kept):
                    stored.add(row)

    logits, timing = shared.forward(
        model,
        template.ids,
        distinct,
        resolve(buckets, model.device),
        template,
        store_prefixes if stores else None,
    )
    forward_seconds = perf_counter() - started
    ran = _shared_forward(timing, distinct)
    timing = {**timing, **reuse_timing(Reuse())}  # the template's reuse is no caller's
    prefix = timing["prefix_tokens"]
    width = max(len(prompt.ids) for prompt in prompts)
    outcomes = []
    for item, prompt in zip(items, prompts):
        row_logits = logits[rows[tuple(prompt.ids)]]
        if isinstance(item, SharedInput):  # its own row's figures: its prefix is the template
            own = {
                **timing,
                "padded_suffix_tokens": len(prompt.ids) - prefix,
                "prefix_stored": rows[tuple(prompt.ids)] in stored,
            }
            item_started = started - item.encode_seconds
            outcome = shared_outcome(scoring_model, item, [row_logits], own, item_started)
        else:
            outcome = _direct_result(
                scoring_model, item, row_logits, forward_seconds, result_reuse(None)
            )
        outcomes.append(Batched(outcome, len(distinct), width, ran))
    return outcomes


def _stored_by_batch(
    scoring_model: ScoringModel,
    item: Input,
    prefix_cache: ModelPrefixCache | None,
    template: TemplatePrefix | None,
) -> ModelPrefixCache | None:
    """The cache view in which the batch forward over the template stores the state prefix of
    a lone row (a direct row alone over its state, a one-row shared call), instead of the row
    running alone to prefill it (None: it runs alone): when its prefix is one the cache takes
    and nothing stored resumes it, and its model is attention-only on the invariant numerics
    (the batch's keys and values for the prefix are then a lone prefill's, bit for bit;
    `invariant.py`; a linear-attention layer's state is the row's end's, not the prefix's)."""
    model = scoring_model.model
    if not _cached(item, prefix_cache) or isinstance(item, SharedInput) and len(item.prompts) > 1:
        return None
    if template is None or not template.starts(_ids(item)):
        return None
    if not (invariant.installed(model) and shared.is_pure_attention(model)):
        return None
    row = item.rows[0] if isinstance(item, SharedInput) else item.row
    view = prefix_cache.within(row.cache_key, item.breakpoints)
    return None if view.finds(list(item.prefix_ids)) else view


def _cached(item: Input, prefix_cache: ModelPrefixCache | None) -> bool:
    """Whether the direct scorer would run this row over its (cacheable) state prefix."""
    return (
        prefix_cache is not None
        and item.prefix_ids is not None
        and prefix_cache.caches(len(item.prefix_ids))
    )


def _alone(scoring_model, item, max_tokens, buckets, prefix_cache) -> Batched:
    """A unit that runs on its own (a shared call, or an input encoded for another limit)."""
    if isinstance(item, SharedInput):
        rows, width = len(item.prompts), max(len(prompt.ids) for prompt in item.prompts)
        score = score_shared
    else:
        rows, width, score = 1, len(item.prompt.ids), score_direct
    try:
        outcome = score(
            scoring_model, item, max_tokens=max_tokens, buckets=buckets, prefix_cache=prefix_cache
        )
    except RowError as error:  # a row refused on its own: only its request fails
        return Batched(error, rows, width)
    if isinstance(item, SharedInput):
        results, timing = outcome
        ran = _shared_forward(timing, item.prompts)
    else:  # one row: its prompt
        ran = Forward(1, outcome["input_tokens"], outcome["input_tokens"])
    return Batched(outcome, rows, width, ran)


def _padded(
    scoring_model: ScoringModel, items: list[DirectInput], buckets: Buckets | None | str
) -> tuple[list[dict[str, Any]], tuple[int, int]]:
    """Plain direct rows in one right-padded forward (`padded.last_hidden_states`; with
    buckets, of `Buckets.batch`'s shape), each read at its own last real token; (their results,
    the forward's shape: rows and width, padding included)."""
    started = perf_counter()
    model = scoring_model.model
    with torch.inference_mode():
        prompts = [item.prompt.ids for item in items]
        rows, shape = last_hidden_states(model, prompts, resolve(buckets, model.device))
        letters = letter_logits(model, rows, [item.prompt for item in items])
    forward_seconds = perf_counter() - started
    results = [
        _direct_result(scoring_model, item, row_letters, forward_seconds, result_reuse(None))
        for item, row_letters in zip(items, letters)
    ]
    return results, shape


def _over_prefix(
    scoring_model: ScoringModel,
    prefix_ids: list[int],
    items: list[DirectInput],
    buckets: Buckets | None | str,
    prefix_cache: ModelPrefixCache | None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Direct rows over one state prefix: one shared forward (prefill, or resume a stored one,
    once); (their results, its timing)."""
    started = perf_counter()
    model = scoring_model.model
    prompts = [item.prompt for item in items]
    logits, timing = shared.forward(
        model, prefix_ids, prompts, resolve(buckets, model.device), prefix_cache
    )
    forward_seconds = perf_counter() - started
    results = [
        _direct_result(scoring_model, item, row_letters, forward_seconds, result_reuse(timing))
        for item, row_letters in zip(items, logits)
    ]
    return results, timing


def _direct_result(
    scoring_model: ScoringModel,
    item: DirectInput,
    letter_logits: torch.Tensor,
    forward_seconds: float,
    reuse: dict[str, Any],
) -> dict[str, Any]:
    """The result the direct scorer gives `item`, from letter logits read in a batch (`reuse`:
    its forward's `prefill.result_reuse`)."""
    return (
        build_result(
            item.row,
            item.prompt,
            letter_logits,
            scorer="direct",
            model=scoring_model.info.as_dict(),
            forward_seconds=forward_seconds,
            total_seconds=item.encode_seconds + forward_seconds,
        )
        | reuse
        | {"prefix_sha256": state_prefix_sha256(item.row, item.prompt.text)}
    )
