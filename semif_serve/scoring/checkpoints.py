"""Where a stored prefix can be resumed, and where a prefill keeps checkpoints: the prefix
cache's choice of points, on its own (no lock, no tensors).

An attention-only entry resumes anywhere inside the part a call shares with it (its keys and
values cropped there). A hybrid entry's linear-attention states cannot be cropped, so it resumes
at its end or at one of its checkpoints: copies of those states taken during its prefill every
`checkpoint_tokens` tokens, BOUNDARY_TOKENS before its end (where a grown state still agrees),
and at each position a caller marked (an OpenAI Decisions `prompt_cache_breakpoint`).
A hybrid model's stops are each moved back to the start of the delta rule's chunk they fall in
(`chunk_start`), where a continuation sums as one pass does.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

CHECKPOINT_TOKENS = 1024  # a hybrid entry's checkpoint spacing (SEMIF_PREFIX_CHECKPOINT_TOKENS)
# A hybrid entry also keeps a checkpoint this many tokens before its end: a state that grew
# shares its stored prefix up to there. Measured with SmolLM2's and Qwen3.5's tokenizers over
# text, list and nested JSON states with one event appended (docs/operations.md): the common
# start ends 0 (text), 0-1 (lists) or 0-2 (nested objects) tokens before the stored end.
BOUNDARY_TOKENS = 2
# The kinds of point a call resumes from: a stored entry's end, a cut inside an attention-only
# entry, and a hybrid entry's checkpoints (periodic, near its end, and where a caller marked).
END, CROP, CHECKPOINT, BOUNDARY = "end", "crop", "checkpoint", "boundary"
BREAKPOINT = "breakpoint"
# Transformers' chunked delta rule (Qwen3.5's linear attention) sums each chunk of this many
# tokens, counted from position 0, as one block: a prefill that stops inside a chunk and a
# continuation after it sum that chunk's tokens in another order than one pass over them does.
# So a hybrid model's prefills stop, and resume, only where a chunk starts.
LINEAR_CHUNK_TOKENS = 64


def chunk_start(position: int, chunk: int = LINEAR_CHUNK_TOKENS) -> int:
    """The start of the `chunk`-token chunk that `position` falls in (itself at a chunk start)."""
    return position - position % chunk


def resume_point(entry: Any, shared: int) -> tuple[int, str | None, Any]:
    """Where a call whose ids share `shared` tokens with `entry` can resume: (tokens, kind, the
    linear states there). The entry's end when it is all shared; an attention-only entry's cut
    anywhere; a hybrid entry's latest checkpoint inside the shared part, or nowhere (0)."""
    if shared == len(entry.ids):
        return shared, END, None
    if not entry.recurrent:
        return shared, CROP, None
    positions = sorted(entry.checkpoints)
    index = bisect_right(positions, shared)
    if index == 0:
        return 0, None, None
    position = positions[index - 1]
    kind, states = entry.checkpoints[position]
    return position, kind, states


def checkpoint_stops(
    start: int, end: int, every: int, marks: dict[int, str], chunk: int = 1
) -> dict[int, str]:
    """The positions after `start` and before `end` where a prefill takes checkpoints, and their
    kinds: every multiple of `every` (0: none), BOUNDARY_TOKENS before the end, and the marked
    positions, each moved to the start of its `chunk` (of two there, the later kind)."""
    stops = {}
    if every > 0:
        stops = {at: CHECKPOINT for at in range((start // every + 1) * every, end, every)}
    stops[end - BOUNDARY_TOKENS] = BOUNDARY
    chunked = {chunk_start(at, chunk): kind for at, kind in (stops | marks).items()}
    return {at: kind for at, kind in chunked.items() if start < at < end}
