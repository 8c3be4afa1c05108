"""Temperature scaling: NLL of option logits, a one-parameter fit, ECE, and an out-of-fold check.

`softmax(logits / T)` keeps every argmax. The mean NLL is convex in 1/T, so a golden-section
search over 1/T in [1/20, 1/0.05] finds the minimum; T therefore always lies in [0.05, 20], the
range SEMIF_CALIBRATION accepts. The out-of-fold estimate fits T without each group in turn and
scores that group with it (leave one group out), so "ECE after" is not measured on the rows T was
fitted to.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from semif_serve.calibration import MAX_TEMPERATURE, MIN_TEMPERATURE

ECE_BINS = 10
_GOLDEN = (np.sqrt(5) - 1) / 2
_FIT_TOLERANCE = 1e-7


def log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=1, keepdims=True)
    shifted = logits - top
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def mean_nll(logits: Sequence[Sequence[float]], gold: Sequence[int], temperature: float) -> float:
    """Mean negative log-likelihood of the gold options under softmax(logits / T)."""
    scaled = log_softmax(_matrix(logits) / temperature)
    return float(-scaled[np.arange(len(gold)), np.asarray(gold)].mean())


def fit_temperature(logits: Sequence[Sequence[float]], gold: Sequence[int]) -> float:
    """The T in [0.05, 20] that minimises the mean NLL (golden-section search over 1/T)."""
    matrix, labels = _matrix(logits), np.asarray(gold)
    rows = np.arange(len(labels))

    def nll(inverse: float) -> float:
        return float(-log_softmax(matrix * inverse)[rows, labels].mean())

    low, high = 1 / MAX_TEMPERATURE, 1 / MIN_TEMPERATURE
    left, right = high - _GOLDEN * (high - low), low + _GOLDEN * (high - low)
    left_value, right_value = nll(left), nll(right)
    while high - low > _FIT_TOLERANCE:
        if left_value <= right_value:
            high, right, right_value = right, left, left_value
            left = high - _GOLDEN * (high - low)
            left_value = nll(left)
        else:
            low, left, left_value = left, right, right_value
            right = low + _GOLDEN * (high - low)
            right_value = nll(right)
    temperature = 1 / ((low + high) / 2)
    return min(max(temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)


def probabilities(logits: Sequence[Sequence[float]], temperature: float = 1.0) -> np.ndarray:
    return np.exp(log_softmax(_matrix(logits) / temperature))


def expected_calibration_error(
    probability_rows: np.ndarray | Sequence[Sequence[float]],
    gold: Sequence[int],
    bins: int = ECE_BINS,
) -> float:
    """ECE with `bins` equal-width confidence bins on [0, 1]: sum over bins of
    (rows in bin / rows) * |accuracy in bin - mean confidence in bin|; confidence = max prob."""
    matrix = _matrix(probability_rows)
    confidence = matrix.max(axis=1)
    correct = matrix.argmax(axis=1) == np.asarray(gold)
    bin_of = np.minimum((confidence * bins).astype(int), bins - 1)
    error = 0.0
    for index in range(bins):
        members = bin_of == index
        if members.any():
            gap = abs(correct[members].mean() - confidence[members].mean())
            error += members.sum() / len(matrix) * gap
    return float(error)


def out_of_fold_probabilities(
    logits: Sequence[Sequence[float]], gold: Sequence[int], groups: Sequence[Hashable]
) -> tuple[np.ndarray, list[float]]:
    """Each group's probabilities under a T fitted on all other groups; and those fold Ts."""
    matrix, labels = _matrix(logits), np.asarray(gold)
    numbering = {group: number for number, group in enumerate(dict.fromkeys(groups))}
    if len(numbering) < 2:
        raise ValueError("an out-of-fold fit needs rows from at least 2 groups")
    group_numbers = np.array([numbering[group] for group in groups])
    result = np.zeros_like(matrix)
    temperatures = []
    for number in range(len(numbering)):
        held_out = group_numbers == number
        temperature = fit_temperature(matrix[~held_out], labels[~held_out])
        temperatures.append(temperature)
        result[held_out] = probabilities(matrix[held_out], temperature)
    return result, temperatures


def _matrix(values) -> np.ndarray:
    """Rows x options as float64; rows with fewer options are padded with -inf, which softmax,
    max and argmax all treat as an option that is not there."""
    if isinstance(values, np.ndarray):
        matrix = values.astype(np.float64)
    else:
        rows = [list(row) for row in values]
        width = max((len(row) for row in rows), default=0)
        matrix = np.array([row + [-np.inf] * (width - len(row)) for row in rows], dtype=np.float64)
    if matrix.ndim != 2 or not matrix.size:
        raise ValueError("expected a nonempty rows x options matrix")
    return matrix
