"""Shape buckets: every forward the scorers run has one of a small, fixed set of shapes.

On a GPU each new input shape costs in live traffic: flash-linear-attention's Triton kernels
autotune for each new `NB = ceil(rows * length / 2048)` (8-9 s each on the H200) and compile
for each new flattened token count (~60 ms). With buckets, a fixed set of shapes reachable up
to max_tokens and the largest request can all be run once at start-up (`semif_serve.engine.warmup`).

Every bucket is exact, because real tokens never see what is added after them (attention is
causal, the recurrent layers run left to right) and rows never see each other:
- a direct prompt is right-padded to `length(n)` and read at its real last position;
- a shared call's state prefix is cut DOWN to `prefix(n)` tokens, and the cut tokens start
  every row's suffix instead (any common leading run of tokens is a valid shared prefix);
- the suffixes are right-padded to `length(longest suffix)`;
- rows are padded up to `rows(n)` with copies of a real row, whose outputs are discarded.
  Padding (not fixed-size chunks) is the simpler exact option: one forward as today, one
  replicated cache, nothing to stitch; a copy of a real row is a valid sequence (an empty or
  all-padding row could give SDPA a fully masked row, i.e. NaN). Its cost: up to 2x the rows
  of the suffix forward, and the replicated per-row prefix state is for the padded count.
- a suffix forward holds at most `rows_per_forward(length)` rows (so about `token_budget`
  tokens at most): bigger calls run in several forwards over copies of the prefilled cache.
  This bounds the (rows, length) grid that warm-up must cover, and each forward's memory.
- a batch forward (plain direct rows of several requests, `scoring.coalesced`) is right-padded
  to `length(longest prompt)` and its rows padded up to `rows(n)` with rows of padding tokens
  (`batch`; separate rows, so real rows never see them; their outputs are discarded). Its
  tokens after bucketing (`bucketed_tokens`) are the batch selector's cost, so a batch within
  SEMIF_MAX_BATCH_TOKENS runs within it, and `batch_shapes` lists every shape warm-up runs.

Tables (`Buckets()` defaults):
- length (ceil): multiples of 64 up to 1,024; above, 16 steps per doubling (128 up to 2,048,
  256 up to 4,096, 512 up to 8,192, ...), so padding costs less than 1/8 of a long prompt;
- prefix (floor): 1, 2, 4, 8, 16, 32, then multiples of 64 below 8,192, then 64 steps per
  doubling: the cut moves fewer than 64 tokens (on average ~32) into every suffix below 8k;
- rows (ceil): 1, 2, 4, 8, 16, 32, 64, then multiples of 64;
- rows per forward: the largest power of two r with r * length <= token_budget (8,192), at
  least 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PAD_TOKEN_ID = 0  # what right padding holds: any id in the vocabulary (real tokens never see it)
ON_CPU_DEFAULT = False  # CPU: padding costs real compute and nothing autotunes, so off
AUTO: Any = "auto"  # a scorer's `buckets` default: on for CUDA models, off on the CPU


@dataclass(frozen=True)
class Buckets:
    """The shape tables one scorer uses; `semif_serve.engine.warmup` runs each shape once."""

    fine_step: int = 64  # the length step up to `fine_until`
    fine_until: int = 1024
    steps_per_doubling: int = 16
    prefix_steps_per_doubling: int = 64
    row_step: int = 64  # powers of two up to this, then its multiples
    token_budget: int = 8192  # rows * suffix length of one suffix forward, at most

    def length(self, tokens: int) -> int:
        """The padded length of a sequence of `tokens` tokens (>= tokens)."""
        step = self._length_step(tokens)
        return -(-tokens // step) * step

    def prefix(self, tokens: int) -> int:
        """How many of a shared prefix's `tokens` tokens to prefill (<= tokens, >= 1)."""
        if tokens < self.fine_step:
            return 1 << (tokens.bit_length() - 1)
        step = max(self.fine_step, _floor_pow2(tokens) // self.prefix_steps_per_doubling)
        return tokens // step * step

    def rows(self, count: int) -> int:
        """The padded row count of one suffix forward holding `count` rows (>= count)."""
        if count <= self.row_step:
            return _ceil_pow2(count)
        return -(-count // self.row_step) * self.row_step

    def rows_per_forward(self, length: int) -> int:
        """How many rows of padded suffix length `length` one suffix forward may hold."""
        return max(1, _floor_pow2(max(1, self.token_budget // length)))

    def batch(self, rows: int, length: int) -> tuple[int, int]:
        """The (rows, width) one right-padded batch forward runs as, for `rows` rows whose
        longest prompt is `length` tokens: `rows(rows)` rows of `length(length)` tokens."""
        return self.rows(rows), self.length(length)

    def batch_shapes(
        self, *, max_rows: int, max_tokens: int, longest: int
    ) -> list[tuple[int, int]]:
        """Every (rows, width) a batch forward can run as when the batch selector takes at most
        `max_rows` rows and `bucketed_tokens` <= `max_tokens`, of prompts up to `longest`
        tokens: each row bucket of 2..max_rows rows with each length bucket of 1..longest
        tokens, at most max_tokens in all; by rows, then width. A batch of one row runs as the
        direct scorer does (its shapes are the direct ones), so max_rows 1 (batching off): none."""
        row_buckets = [count for count in self.row_counts(max(1, max_rows)) if count > 1]
        return [
            (count, width)
            for count in row_buckets
            for width in self.lengths(longest)
            if count * width <= max_tokens
        ]

    def lengths(self, up_to: int) -> list[int]:
        """Every padded length a sequence of 1..up_to tokens can get, ascending."""
        table = [self.length(1)]
        while table[-1] < up_to:
            table.append(self.length(table[-1] + 1))
        return table

    def prefixes(self, up_to: int) -> list[int]:
        """Every prefill length a prefix of 1..up_to tokens can get, ascending."""
        table = [1]
        while True:
            step = self._prefix_step_after(table[-1])
            if table[-1] + step > up_to:
                return table
            table.append(self.prefix(table[-1] + step))

    def row_counts(self, up_to: int) -> list[int]:
        """Every padded row count a call of 1..up_to rows can produce, ascending."""
        table = [1]
        while table[-1] < up_to:
            table.append(self.rows(table[-1] + 1))
        return table

    def _length_step(self, tokens: int) -> int:
        if tokens <= self.fine_until:
            return self.fine_step
        return max(self.fine_step, _ceil_pow2(tokens) // self.steps_per_doubling)

    def _prefix_step_after(self, value: int) -> int:
        """The distance from `value` to the next prefix bucket."""
        if value < self.fine_step:
            return value  # 1, 2, 4, ..., 32, then 64
        return max(self.fine_step, _floor_pow2(value) // self.prefix_steps_per_doubling)


DEFAULT = Buckets()


def bucketed_tokens(rows: int, length: int, buckets: Buckets | None) -> int:
    """The tokens one right-padded batch forward of `rows` rows, whose longest prompt is
    `length` tokens, holds as it runs: rows x length without buckets, `buckets.batch`'s rows x
    width with them. The batch selector's cost: a batch it takes within a token budget runs
    within it, and so does any part of the batch run as one forward (fewer rows, a shorter
    longest prompt: the count never falls as rows or length grow). One row alone is the direct
    scorer's shape, (1, `buckets.length(length)`)."""
    if buckets is None:
        return rows * length
    padded_rows, width = buckets.batch(rows, length)
    return padded_rows * width


def resolve(buckets: Buckets | None | str, device: Any) -> Buckets | None:
    """The buckets a scorer call uses: `AUTO` is `DEFAULT` for a CUDA model, None on the CPU."""
    if buckets is AUTO or buckets == AUTO:
        on_cuda = getattr(device, "type", str(device)).startswith("cuda")
        return DEFAULT if on_cuda or ON_CPU_DEFAULT else None
    if buckets is None or isinstance(buckets, Buckets):
        return buckets
    raise TypeError(f"buckets must be a Buckets, None or 'auto', got {buckets!r}")


def _ceil_pow2(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def _floor_pow2(value: int) -> int:
    return 1 << (value.bit_length() - 1)
