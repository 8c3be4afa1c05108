"""More options than the sixteen letters A..P: a question as groups of rows over its one state,
its answer read back as one distribution over all of its options.

A question with up to 16 options is one row, scored as direct-options-v1 (results and prompt
hashes exactly those of a plain row). Above 16 its options are cut, in the order sent, into the
fewest groups of at most 16 (sizes differing by at most one: 40 options are 14, 13, 13), each
group a row of the same question over the same state, so one shared call prefills the state once
for every group. Two ways read the groups back (docs/quality.md measures both):

- `grouped-16` (a shared normaliser): one softmax over every group's option logits together.
- `tournament-16`: each group's winner goes on to a final row of at most 16 options (255 options
  are 16 groups at most); p(option) = p(option within its group) · p(its group's winner in the
  final). A second shared call over the same state (its prefix reused).

Both are deterministic and sum to one. The server reads back by grouped-16 (`mapping.METHOD`:
docs/quality.md found tournament-16 no better, at a second call); tournament-16 stays here for
that measurement (bench/options_methods.py). The row results combine into one result of the shape a
row's has, with `method` naming the way and `group_prompt_sha256` the rows' own hashes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from semif_serve.scoring.rows import MAX_OPTIONS

DIRECT = "direct-options-v1"
SHARED_NORMALISER = "grouped-16"
TOURNAMENT = "tournament-16"
METHODS = (SHARED_NORMALISER, TOURNAMENT)


def groups(count: int, size: int = MAX_OPTIONS) -> list[range]:
    """`count` options as the fewest consecutive groups of at most `size`, balanced."""
    number = -(-count // size)
    base, extra = divmod(count, number)
    cuts, start = [], 0
    for index in range(number):
        stop = start + base + (1 if index < extra else 0)
        cuts.append(range(start, stop))
        start = stop
    return cuts


@dataclass(frozen=True)
class Plan:
    """The rows that score some questions: each question's rows are `rows[spans[i]]`."""

    rows: list[Any]  # Mapped-like: `.descriptions`, `.option_fields`
    spans: list[range]
    cuts: list[list[range]]  # each question's option groups ([] for a one-row question)


def plan(questions: Sequence[Any]) -> Plan:
    """One row per question of at most 16 options; one row per option group otherwise."""
    rows: list[Any] = []
    spans, cuts = [], []
    for question in questions:
        count = len(question.descriptions)
        own = groups(count) if count > MAX_OPTIONS else []
        start = len(rows)
        if own:
            rows.extend(_subset(question, cut) for cut in own)
        else:
            rows.append(question)
        spans.append(range(start, len(rows)))
        cuts.append(own)
    return Plan(rows, spans, cuts)


def _subset(question: Any, cut: Sequence[int]) -> Any:
    return replace(
        question,
        descriptions=tuple(question.descriptions[k] for k in cut),
        option_fields=tuple(question.option_fields[k] for k in cut),
    )


def pooled(results: Sequence[dict[str, Any]]) -> list[float]:
    """grouped-16: one softmax (float64) over every group's option logits together."""
    logits = [float(x) for result in results for x in result["option_logits"]]
    return softmax(logits)


def softmax(logits: Sequence[float]) -> list[float]:
    peak = max(logits)
    weights = [math.exp(x - peak) for x in logits]
    total = math.fsum(weights)
    return [weight / total for weight in weights]


def winners(results: Sequence[dict[str, Any]], cut: Sequence[range]) -> list[int]:
    """Each group's most probable option (the first on a tie), as positions in the question."""
    chosen = []
    for index, group in enumerate(cut):
        probabilities = results[index]["probabilities"]
        chosen.append(group[max(range(len(group)), key=probabilities.__getitem__)])
    return chosen


def final_row(question: Any, finalists: Sequence[int]) -> Any:
    """tournament-16's final: the group winners as one row of the question."""
    return _subset(question, finalists)


def knocked_out(results: Sequence[dict[str, Any]], final: dict[str, Any]) -> list[float]:
    """tournament-16: p(option) = p(option within its group) · p(its group's winner, final)."""
    probabilities = []
    for index, result in enumerate(results):
        weight = float(final["probabilities"][index])
        probabilities.extend(float(p) * weight for p in result["probabilities"])
    return probabilities


def combined(
    results: Sequence[dict[str, Any]],
    method: str,
    probabilities: list[float],
    extra: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """One result for a grouped question from its rows' results (and the final's, `extra`)."""
    every = [*results, *extra]
    hashes = [result["prompt_sha256"] for result in every]
    first = results[0]
    return {
        **{key: first[key] for key in ("prompt_version", "probability_status", "model")},
        "probabilities": probabilities,
        "option_logits": [float(x) for result in results for x in result["option_logits"]],
        "input_tokens": sum(result["input_tokens"] for result in every),
        "prompt_sha256": hashlib.sha256("\n".join(hashes).encode()).hexdigest(),
        "group_prompt_sha256": hashes,
        "cache_hit": first.get("cache_hit"),
        "prefix_sha256": first.get("prefix_sha256"),
        "method": method,
    }


def read_back(
    questions: Sequence[Any],
    layout: Plan,
    results: Sequence[dict[str, Any]],
    method: str,
    finals: Callable[[list[Any]], list[dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """One result per question, in order, from the plan's row results. tournament-16 scores its
    finals through `finals` (rows in, results in order out: one more shared call)."""
    own = [[results[k] for k in span] for span in layout.spans]
    if method == TOURNAMENT:
        return _tournament(questions, layout, own, finals)
    out = []
    for index, cut in enumerate(layout.cuts):
        out.append(combined(own[index], method, pooled(own[index])) if cut else own[index][0])
    return out


def _tournament(
    questions: Sequence[Any], layout: Plan, own: list[list[dict[str, Any]]], finals: Callable
) -> list[dict[str, Any]]:
    grouped = [index for index, cut in enumerate(layout.cuts) if cut]
    scored = finals([final_row(questions[i], winners(own[i], layout.cuts[i])) for i in grouped])
    final_of = {index: scored[position] for position, index in enumerate(grouped)}
    out = []
    for index, cut in enumerate(layout.cuts):
        if not cut:
            out.append(own[index][0])
            continue
        final = final_of[index]
        out.append(combined(own[index], TOURNAMENT, knocked_out(own[index], final), [final]))
    return out
