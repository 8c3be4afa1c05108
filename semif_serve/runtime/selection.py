"""Which queued decision requests go into the next forward, and how long a batch waits for them:
the scheduler's pure choices (no clock, no lock).

A pure function over the queue's costs, oldest first (as text-embeddings-inference's queue pops
within `--max-batch-tokens`): requests are taken in arrival order and the selection stops at the
first one that would break a limit, so no request is ever overtaken by a younger one (sorting by
length would cut padding but delay the oldest request, which TGI refused for that reason). The
limits: `max_rows` rows (a shared call counts all its rows, a rotated decision one per
ordering) and `max_tokens` padded tokens, counted as every row padded to the batch's longest
prompt (rows × longest). The oldest request always goes, even when it alone breaks a limit: it
then runs alone, never waiting forever and never blocking the queue (text-embeddings-inference
issue #723: a request over the budget made its batcher loop forever).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from semif_serve.runtime.waiting import Deadline

# How long before a request's deadline a batch that would take it stops waiting for company:
# the leader must take it while its deadline has not passed (else the request's own wait ends
# first, a 503), and the leader's thread needs a moment to wake: 5% of the request's timeout,
# at least 20 ms.
DEADLINE_MARGIN_S = 0.02
DEADLINE_MARGIN_SHARE = 0.05


@dataclass(frozen=True)
class BatchLimits:
    """SEMIF_MAX_BATCH_ROWS, SEMIF_MAX_BATCH_TOKENS and SEMIF_BATCH_WAIT_MS (as seconds)."""

    max_rows: int
    max_tokens: int
    wait_s: float


@dataclass(frozen=True)
class Cost:
    """What one queued request adds to a batch: its rows and its longest prompt (tokens)."""

    rows: int
    length: int
    work: int = 0  # the tokens it runs (a shared call: its state once, then each row's own)

    @property
    def tokens(self) -> int:
        """The work it brings, what `Pace` measures by: `work`, else every row at its longest
        prompt."""
        return self.work or self.rows * self.length


def padded_tokens(costs: Sequence[Cost]) -> int:
    """The tokens a forward over these requests holds: every row padded to the longest prompt."""
    if not costs:
        return 0
    return sum(cost.rows for cost in costs) * max(cost.length for cost in costs)


def unbucketed(rows: int, length: int) -> int:
    """A forward's tokens without shape buckets: every row padded to the longest prompt."""
    return rows * length


def select(
    costs: Sequence[Cost],
    max_rows: int,
    max_tokens: int,
    tokens: Callable[[int, int], int] = unbucketed,
) -> int:
    """How many of the queued requests (oldest first) go into the next batch: at least one when
    any is queued, then every next one while the batch stays within both limits. `tokens`:
    what a forward of (rows, longest prompt) holds as the model runs it (with shape buckets on
    CUDA, its bucketed rows x width: `Engine.batch_tokens`), so no forward passes the budget."""
    if not costs:
        return 0
    rows, longest = costs[0].rows, costs[0].length
    taken = 1
    for cost in costs[1:]:
        rows += cost.rows
        longest = max(longest, cost.length)
        if rows > max_rows or tokens(rows, longest) > max_tokens:
            break
        taken += 1
    return taken


def cost_of(item: Any) -> Cost:
    """What an encoded input adds to a batch (`scoring.inputs`: a direct row's prompt, a shared
    call's prompts); an input the scorer did not encode (a fake's rows) counts its rows."""
    prompts = getattr(item, "prompts", None)
    if prompts is not None:
        prefix = len(getattr(item, "prefix_ids", None) or ())
        work = prefix + sum(len(prompt.ids) - prefix for prompt in prompts)
        return Cost(len(prompts), max(len(prompt.ids) for prompt in prompts), work)
    prompt = getattr(item, "prompt", None)
    if prompt is not None:
        return Cost(1, len(prompt.ids))
    return Cost(len(item) if isinstance(item, list) else 1, 1)


def gather_ends(since: float, wait_s: float, deadlines: Sequence[Deadline]) -> float:
    """When a batch whose leader arrived at `since` stops waiting for company: once the leader
    has waited `wait_s` (its time in the queue counts, as Triton's queue delay does), or a
    margin before the earliest deadline of the requests it would take, whichever
    comes first, so that waiting for company never costs a request its deadline."""
    ends = since + wait_s
    for deadline in deadlines:
        if deadline.at is not None:
            margin = max(DEADLINE_MARGIN_S, DEADLINE_MARGIN_SHARE * deadline.timeout_s)
            ends = min(ends, deadline.at - margin)
    return ends
