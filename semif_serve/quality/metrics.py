"""Accuracy statistics: accuracy, balanced accuracy, and a group bootstrap of a paired difference.

Rows that share a state are not independent, so the bootstrap resamples whole groups (clusters)
with replacement and recomputes the paired accuracy difference on each resample. The seed is
fixed: the same inputs always give the same interval.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95


def accuracy(correct: Sequence[bool]) -> float:
    if not correct:
        raise ValueError("accuracy of no rows")
    return sum(map(bool, correct)) / len(correct)


def balanced_accuracy(gold: Sequence[Hashable], predicted: Sequence[Hashable]) -> float:
    """Mean per-class recall over the gold classes present (a class never gold is ignored)."""
    if len(gold) != len(predicted) or not gold:
        raise ValueError("balanced accuracy needs equally long, nonempty gold and predictions")
    hits: dict[Hashable, list[int]] = {}
    for truth, guess in zip(gold, predicted):
        counts = hits.setdefault(truth, [0, 0])
        counts[0] += truth == guess
        counts[1] += 1
    return sum(right / total for right, total in hits.values()) / len(hits)


@dataclass(frozen=True)
class PairedDifference:
    """accuracy(b) - accuracy(a) over the same rows, with a group-bootstrap interval."""

    difference: float
    low: float
    high: float
    groups: int
    resamples: int
    seed: int

    def as_dict(self) -> dict:
        return {
            "difference": self.difference,
            "ci95": [self.low, self.high],
            "groups": self.groups,
            "resamples": self.resamples,
            "seed": self.seed,
        }


def bootstrap_replicates(
    correct_a: Sequence[bool],
    correct_b: Sequence[bool],
    groups: Sequence[Hashable],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> np.ndarray:
    """The paired difference on each resample of whole groups (drawn with replacement)."""
    if not len(correct_a) == len(correct_b) == len(groups) or not groups:
        raise ValueError("the bootstrap needs equally long, nonempty rows and groups")
    index = {group: position for position, group in enumerate(dict.fromkeys(groups))}
    rows_per_group = np.zeros(len(index))
    difference_per_group = np.zeros(len(index))
    for a, b, group in zip(correct_a, correct_b, groups):
        rows_per_group[index[group]] += 1
        difference_per_group[index[group]] += bool(b) - bool(a)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(index), size=(resamples, len(index)))
    return difference_per_group[draws].sum(axis=1) / rows_per_group[draws].sum(axis=1)


def paired_difference(
    correct_a: Sequence[bool],
    correct_b: Sequence[bool],
    groups: Sequence[Hashable],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> PairedDifference:
    """The point difference and the percentile 95% interval of its group bootstrap."""
    replicates = bootstrap_replicates(correct_a, correct_b, groups, resamples=resamples, seed=seed)
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(replicates, [tail, 1 - tail])
    return PairedDifference(
        difference=accuracy(correct_b) - accuracy(correct_a),
        low=float(low),
        high=float(high),
        groups=len(set(groups)),
        resamples=resamples,
        seed=seed,
    )
