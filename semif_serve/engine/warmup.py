"""Warm-up of every forward shape traffic can reach, before the service says it is ready.

With shape buckets (`scoring/shapes.py`) each forward the scorers run has one of a finite set
of shapes; this runs each of them once, with synthetic token ids, so Triton's compiles and
autotuning (8-9 s per new batch size with flash-linear-attention on the H200) happen here and
not in live traffic:
- direct: one uncached forward (1, L) per length bucket L up to max_tokens;
- shared, linear-attention models: one prefill (1, P) per prefix bucket P below max_tokens and
  one suffix forward (n, S) per length bucket S and row bucket n up to max_rows that one
  forward may hold (`rows_per_forward(S)`), paired up into shared calls;
- shared, attention-only models: the same prefills, and one packed row (1, S) per S up to
  max_tokens or PACKED_CHUNK_TOKENS;
- batched (SEMIF_MAX_BATCH_ROWS > 1): one uncached forward (R, W) per shape a batch of plain
  direct rows can run as (`Buckets.batch_shapes`: a row bucket R of 2..max_batch_rows rows, a
  length bucket W up to max_tokens, R x W within max_batch_tokens); a batch's rows over one
  state run as a shared call, so the shared suffixes cover up to max_batch_rows rows too.
The count grows with log(max_tokens) and log(max_rows) only. A shape that runs out of memory is
reported and skipped: traffic of that shape would get a 503 too, and the service still starts.
Without buckets (the CPU default) nothing runs here.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from itertools import cycle, islice
from time import perf_counter
from typing import Any

import torch

from semif_serve.engine.oom_policy import ran_out_of_memory
from semif_serve.scoring import direct, shared
from semif_serve.scoring.packed import PACKED_CHUNK_TOKENS
from semif_serve.scoring.prompt import EncodedPrompt
from semif_serve.scoring.shapes import AUTO, PAD_TOKEN_ID, Buckets, resolve

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmUpPlan:
    """The shapes to run: direct lengths, prefill lengths, (rows, length) suffix forwards and
    (rows, width) batch forwards."""

    direct: list[int]
    prefixes: list[int]
    suffixes: list[tuple[int, int]]
    batched: list[tuple[int, int]] = field(default_factory=list)

    def shared_calls(self) -> list[tuple[int, tuple[int, int]]]:
        """(prefix length, (rows, suffix length)) per shared call: every prefix and every suffix
        shape at least once, in as few calls as the longer list."""
        count = max(len(self.prefixes), len(self.suffixes))
        return list(zip(islice(cycle(self.prefixes), count), islice(cycle(self.suffixes), count)))


@dataclass
class WarmUpReport:
    """What warm-up ran: forward shapes, seconds, and the shapes that ran out of memory."""

    shapes: int = 0
    batched_shapes: int = 0  # of `shapes`: the batch forwards that ran
    seconds: float = 0.0
    largest_direct_tokens: int = 0
    largest_batched_tokens: int = 0  # rows x width of the largest batch forward that ran
    out_of_memory: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "shapes": self.shapes,
            "batched_shapes": self.batched_shapes,
            "seconds": round(self.seconds, 3),
            "largest_direct_tokens": self.largest_direct_tokens,
            "largest_batched_tokens": self.largest_batched_tokens,
            "out_of_memory": list(self.out_of_memory),
        }


def plan(
    buckets: Buckets,
    *,
    max_tokens: int,
    max_rows: int,
    packed: bool,
    max_batch_rows: int = 1,
    max_batch_tokens: int = 0,
) -> WarmUpPlan:
    """Every shape a request within max_tokens and max_rows, or a batch within max_batch_rows
    rows and max_batch_tokens bucketed tokens (`shapes.bucketed_tokens`), can give a forward.

    A shared prompt holds at least one prefix and one suffix token, so both stay below
    max_tokens. `packed` (attention-only models): every suffix forward is one packed row.
    max_batch_rows 1 (the default): batching off, no batch forwards."""
    lengths = buckets.lengths(max(1, max_tokens - 1))
    if max_batch_rows > 1:  # a batch's rows over one state are one shared call of up to these
        max_rows = max(max_rows, max_batch_rows)
    if packed:
        # A packed row holds several suffixes up to PACKED_CHUNK_TOKENS, or one longer suffix.
        longest = max_tokens - 1 if max_rows == 1 else max(max_tokens - 1, PACKED_CHUNK_TOKENS)
        suffixes = [(1, length) for length in buckets.lengths(max(1, longest))]
    else:
        suffixes = [
            (rows, length)
            for length in lengths
            for rows in buckets.row_counts(min(max_rows, buckets.rows_per_forward(length)))
        ]
    return WarmUpPlan(
        direct=buckets.lengths(max_tokens),
        prefixes=buckets.prefixes(max(1, max_tokens - 1)),
        suffixes=suffixes,
        batched=buckets.batch_shapes(
            max_rows=max_batch_rows, max_tokens=max_batch_tokens, longest=max_tokens
        ),
    )


def warm_up_shapes(
    scoring_model: Any,
    *,
    max_tokens: int,
    max_rows: int,
    buckets: Buckets | None | str = AUTO,
    lock: Any = None,
    max_batch_rows: int = 1,
    max_batch_tokens: int = 0,
) -> dict[str, Any] | None:
    """Run every planned shape once on `scoring_model` (the buckets its scorer calls use:
    `AUTO` as they default to), each under `lock` if given (so another model's calls interleave
    but never overlap). max_batch_rows and max_batch_tokens: the batcher's limits
    (SEMIF_MAX_BATCH_ROWS, SEMIF_MAX_BATCH_TOKENS; the default 1: batching off). Returns the
    report as a dict, or None without buckets."""
    model = scoring_model.model
    buckets = resolve(buckets, model.device)
    if buckets is None:
        return None
    packed = shared.is_pure_attention(model)
    shapes = plan(
        buckets,
        max_tokens=max_tokens,
        max_rows=max_rows,
        packed=packed,
        max_batch_rows=max_batch_rows,
        max_batch_tokens=max_batch_tokens,
    )
    lock = lock or nullcontext()
    report = WarmUpReport()
    started = perf_counter()
    for length in shapes.direct:
        if _run(report, lock, f"direct (1, {length})", partial(_direct, model, length, buckets)):
            report.largest_direct_tokens = length
    for prefix, (rows, length) in shapes.shared_calls():
        name = f"shared prefill (1, {prefix}) + suffix ({rows}, {length})"
        _run(report, lock, name, partial(_shared, model, prefix, rows, length, buckets))
    for rows, width in shapes.batched:
        if _run(report, lock, f"batched ({rows}, {width})", partial(_batched, model, rows, width)):
            report.batched_shapes += 1
            report.largest_batched_tokens = max(report.largest_batched_tokens, rows * width)
    _synchronize(model.device)
    report.seconds = perf_counter() - started
    log.info(
        "warm-up: %d forward shapes (%d batched) in %.1f s (%d out of memory)",
        report.shapes,
        report.batched_shapes,
        report.seconds,
        len(report.out_of_memory),
    )
    return report.as_dict()


def _run(report: WarmUpReport, lock: Any, name: str, call) -> bool:
    """Run one warm-up call under the engine's out-of-memory policy (`oom_policy`): a shape
    that does not fit is reported (its requests will get 503), anything else raises."""
    with lock:
        failed = ran_out_of_memory(call, torch)
    if failed is None:
        report.shapes += 1
        return True
    report.out_of_memory.append(name)
    log.warning("warm-up: %s ran out of memory; requests of that shape will get 503", name)
    return False


def _direct(model: Any, length: int, buckets: Buckets) -> None:
    with torch.inference_mode():
        direct.last_hidden(model, [PAD_TOKEN_ID] * length, buckets)


def _shared(model: Any, prefix: int, rows: int, length: int, buckets: Buckets) -> None:
    """One shared call whose prefill is (1, prefix) and whose one suffix forward is (rows,
    length): `prefix` and `length` are buckets already, so nothing is cut or padded."""
    prefix_ids = [PAD_TOKEN_ID] * prefix
    prompt = EncodedPrompt("warm-up", prefix_ids + [PAD_TOKEN_ID] * length, [PAD_TOKEN_ID])
    shared.forward(model, prefix_ids, [prompt] * rows, buckets)


def _batched(model: Any, rows: int, width: int) -> None:
    """One batch forward of (rows, width), as `scoring.coalesced` runs plain direct rows: the
    decoder, uncached, unmasked; (rows, width) is a batch shape already, so nothing is padded."""
    input_ids = torch.full((rows, width), PAD_TOKEN_ID, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model.get_decoder()(input_ids=input_ids, use_cache=False)


def _synchronize(device: Any) -> None:
    if getattr(device, "type", None) == "cuda":
        torch.cuda.synchronize(device)
