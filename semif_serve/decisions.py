"""Order averaging and calibration on top of scorer results: pure functions, no torch, no HTTP.

Order averaging scores a decision under several orderings of its options and combines them:
per ordering the log-softmax of `option_logits`, averaged per option id, renormalised. Any
additive position bias (a constant per letter position) cancels exactly, because under
rotations every option sits in every position once.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # `semif_serve.scoring` imports torch: the CLI's parser must not
    from semif_serve.scoring.rows import Row

ORDERINGS = ("none", "rotations", "all")
MAX_OPTIONS_FOR_ALL = 4


def ordering_permutations(count: int, mode: str) -> list[tuple[int, ...]]:
    """Index orders for `count` options, the caller's order first."""
    if mode == "rotations":
        return [
            tuple((start + offset) % count for offset in range(count)) for start in range(count)
        ]
    if mode == "all":
        if count > MAX_OPTIONS_FOR_ALL:
            raise ValueError(
                f"orderings 'all' is allowed for at most {MAX_OPTIONS_FOR_ALL} options, got {count}"
            )
        return list(itertools.permutations(range(count)))
    if mode == "none":
        return [tuple(range(count))]
    raise ValueError(f"orderings must be one of {', '.join(ORDERINGS)}, got {mode!r}")


def ordering_id(decision_id: str, index: int) -> str:
    return f"{decision_id}#o{index}"


def expand(row: Row, mode: str) -> list[Row]:
    """One row per ordering: id `<id>#o<k>`, same state and question, options reordered."""
    return [
        replace(row, id=ordering_id(row.id, index), options=tuple(row.options[i] for i in order))
        for index, order in enumerate(ordering_permutations(len(row.options), mode))
    ]


def log_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    log_total = top + math.log(sum(math.exp(value - top) for value in logits))
    return [value - log_total for value in logits]


def softmax(logits: list[float]) -> list[float]:
    return [math.exp(value) for value in log_softmax(logits)]


def top_option(option_ids: list[str], probabilities: list[float]) -> str:
    """The option with the highest probability; the earliest in `option_ids` on a tie."""
    return option_ids[max(range(len(probabilities)), key=probabilities.__getitem__)]


def combine(option_ids: list[str], results: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """The `combined` block for one averaged decision, in the caller's option order."""
    sums = dict.fromkeys(option_ids, 0.0)
    spread: dict[str, list[float]] = {option: [math.inf, -math.inf] for option in option_ids}
    tops = []
    for result in results:
        ordered_ids = result["option_ids"]
        for option, log_probability, probability in zip(
            ordered_ids, log_softmax(result["option_logits"]), result["probabilities"]
        ):
            sums[option] += log_probability
            low, high = spread[option]
            spread[option] = [min(low, probability), max(high, probability)]
        tops.append(top_option(ordered_ids, result["probabilities"]))
    mean_log = [sums[option] / len(results) for option in option_ids]
    probabilities = softmax(mean_log)
    top = top_option(option_ids, probabilities)
    return {
        "method": mode,
        "orderings": len(results),
        "probabilities": probabilities,
        "top": top,
        "agreement": sum(1 for chosen in tops if chosen == top) / len(results),
        "spread": spread,
    }


def averaged_result(
    decision_id: str, option_ids: list[str], results: list[dict[str, Any]], mode: str
) -> dict[str, Any]:
    return {
        "id": decision_id,
        "option_ids": option_ids,
        "combined": combine(option_ids, results, mode),
        "orderings": results,
    }


def calibrated(result: dict[str, Any], workload: str, temperature: float) -> dict[str, Any]:
    """`softmax(option_logits / T)`; dividing by T > 0 keeps the argmax."""
    return {
        "workload": workload,
        "temperature": temperature,
        "probabilities": softmax([value / temperature for value in result["option_logits"]]),
    }
