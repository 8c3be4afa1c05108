"""A request's rows encoded before the model is needed: the scorers' first stage, on its own.

Encoding needs only the tokenizer, and it is where every request limit is checked (`max_tokens`,
the control-token, letter and answer-boundary guards). The server encodes a request before it
takes a slot or the engine lock, so an over-long prompt is refused without delaying anyone
(issue 22), and the scorers take the result (`DirectInput`, `SharedInput`) instead of encoding
again. An input records the `max_tokens` it was checked against: a scorer given one checked
against another limit encodes its rows afresh. `Batched` is what a batched call
(`scoring.coalesced`) gives back for each input.
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter
from typing import Any

from semif_serve.scoring.breakpoints import breakpoint_positions
from semif_serve.scoring.prompt import ChatTokenizer, EncodedPrompt, encode_prompt
from semif_serve.scoring.rows import Row, as_row
from semif_serve.scoring.shared_prompts import encode_shared, encode_with_prefix


@dataclass(frozen=True)
class DirectInput:
    """One row and its prompt, for the direct scorer."""

    row: Row
    prompt: EncodedPrompt
    prefix_ids: list[int] | None  # its state prefix; None: not asked for, or not located
    max_tokens: int
    encode_seconds: float
    breakpoints: tuple[int, ...] = ()  # positions in prefix_ids the caller marked


@dataclass(frozen=True)
class SharedInput:
    """Rows over one exact state, their prompts and the state prefix they all begin with."""

    rows: list[Row]
    prompts: list[EncodedPrompt]
    prefix_ids: list[int]
    max_tokens: int
    encode_seconds: float
    breakpoints: tuple[int, ...] = ()  # positions in prefix_ids the caller marked


def direct_input(
    tokenizer: ChatTokenizer, row: Row | dict, max_tokens: int, *, with_prefix: bool
) -> DirectInput:
    """Encode one row with every guard; `with_prefix` also locates its state prefix (for the
    state-prefix cache), the state tokenized once for both."""
    started = perf_counter()
    parsed = as_row(row)
    marks: tuple[int, ...] = ()
    if with_prefix:
        prompt, prefix_ids = encode_with_prefix(tokenizer, parsed, max_tokens)
        if prefix_ids is not None:
            marks = breakpoint_positions(tokenizer, parsed, prompt.text, prefix_ids)
    else:
        prompt, prefix_ids = encode_prompt(tokenizer, parsed, max_tokens), None
    return DirectInput(parsed, prompt, prefix_ids, max_tokens, perf_counter() - started, marks)


def shared_input(tokenizer: ChatTokenizer, rows: list[Row | dict], max_tokens: int) -> SharedInput:
    """Encode rows over one exact state with every guard (`shared_prompts.encode_shared`)."""
    started = perf_counter()
    parsed, prompts, prefix_ids = encode_shared(tokenizer, rows, max_tokens)
    marks = breakpoint_positions(tokenizer, parsed[0], prompts[0].text, prefix_ids)
    return SharedInput(parsed, prompts, prefix_ids, max_tokens, perf_counter() - started, marks)


@dataclass(frozen=True, eq=False)
class Forward:
    """One forward a batched call ran, as it ran: its rows and tokens (rows x width, padding and
    buckets included) and the prompts' own tokens. Inputs that ran in it share this object."""

    rows: int
    tokens: int
    real_tokens: int


@dataclass(frozen=True)
class Batched:
    """One input's outcome, and the forward it ran in: its rows and padded length (as the reply's
    `batch` shows them), and the `Forward` itself (the metrics; None: not told)."""

    outcome: Any
    rows: int
    padded_length: int
    forward: Forward | None = None
