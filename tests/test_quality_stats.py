"""The statistics behind evaluate and calibrate, against hand-computed examples."""

import math

import numpy as np
import pytest

from semif_serve.quality.metrics import (
    accuracy,
    balanced_accuracy,
    bootstrap_replicates,
    paired_difference,
)
from semif_serve.quality.temperature import (
    expected_calibration_error,
    fit_temperature,
    mean_nll,
    out_of_fold_probabilities,
    probabilities,
)


def test_accuracy_counts_the_correct_share():
    assert accuracy([True, False, True, True]) == 0.75
    with pytest.raises(ValueError):
        accuracy([])


def test_balanced_accuracy_is_the_mean_recall_of_the_gold_classes():
    # recall of a: 2/3, recall of b: 0/1
    assert balanced_accuracy(["a", "a", "a", "b"], ["a", "a", "b", "a"]) == pytest.approx(1 / 3)
    # plain accuracy would be 0.5 here as well, but a heavy class must not dominate:
    gold = ["a"] * 9 + ["b"]
    always_a = ["a"] * 10
    assert accuracy([g == p for g, p in zip(gold, always_a)]) == 0.9
    assert balanced_accuracy(gold, always_a) == 0.5


def test_balanced_accuracy_ignores_classes_that_are_never_gold():
    assert balanced_accuracy(["a", "b"], ["c", "b"]) == 0.5


def test_paired_difference_point_estimate_and_interval():
    rng = np.random.default_rng(7)
    groups = [g for g in range(12) for _ in range(3)]
    correct_a = list(rng.random(36) < 0.6)
    correct_b = list(rng.random(36) < 0.8)
    result = paired_difference(correct_a, correct_b, groups)
    assert result.difference == pytest.approx(accuracy(correct_b) - accuracy(correct_a))
    assert result.low <= result.difference <= result.high
    assert result.low < result.high
    assert result.groups == 12
    assert paired_difference(correct_a, correct_b, groups) == result  # fixed seed
    same = bootstrap_replicates(correct_a, correct_b, groups)
    assert np.array_equal(same, bootstrap_replicates(correct_a, correct_b, groups))
    assert not np.array_equal(same, bootstrap_replicates(correct_a, correct_b, groups, seed=1))


def test_the_bootstrap_resamples_whole_groups():
    # 5 groups of 3 rows; in each group b beats a on all 3 rows or on none of them. Resampling
    # whole groups can only give k/5; resampling single rows would also give k/15.
    groups = [g for g in range(5) for _ in range(3)]
    wins = [g in (0, 3) for g in groups]
    replicates = bootstrap_replicates([False] * 15, wins, groups, resamples=500)
    scaled = replicates * 5
    assert np.allclose(scaled, np.round(scaled))
    assert len(set(np.round(scaled))) > 2  # and it did resample


def test_unequal_groups_weigh_by_rows():
    # group x: 1 row, a wrong b right; group y: 3 rows, both right. Possible resamples:
    # xx -> 1, yy -> 0, xy -> 1/4.
    replicates = bootstrap_replicates(
        [False, True, True, True], [True, True, True, True], ["x", "y", "y", "y"], resamples=300
    )
    assert set(np.round(replicates, 9)) == {0.0, 0.25, 1.0}


def test_one_group_gives_a_degenerate_interval():
    result = paired_difference([False, True], [True, True], ["g", "g"])
    assert result.low == result.high == result.difference == 0.5


def test_ece_with_equal_width_bins_by_hand():
    rows = [[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.55, 0.45]]
    gold = [0, 1, 0, 0]
    # bins (10): .9 right |1-.9|, .8 wrong |0-.8|, .6 right |1-.6|, .55 right |1-.55|
    assert expected_calibration_error(rows, gold) == pytest.approx((0.1 + 0.8 + 0.4 + 0.45) / 4)
    # 2 bins: both .9 (right) and .7 (wrong) fall in [0.5, 1]: |0.5 - 0.8|
    assert expected_calibration_error([[0.9, 0.1], [0.7, 0.3]], [0, 1], bins=2) == pytest.approx(
        0.3
    )
    # a confidence of exactly 1 belongs to the last bin
    assert expected_calibration_error([[1.0, 0.0]], [0], bins=10) == pytest.approx(0.0)


def test_nll_by_hand_and_under_a_temperature():
    logits, gold = [[0.0, math.log(3)]], [1]
    assert mean_nll(logits, gold, 1.0) == pytest.approx(-math.log(0.75))
    root3 = math.sqrt(3)
    assert mean_nll(logits, gold, 2.0) == pytest.approx(-math.log(root3 / (1 + root3)))


def test_probabilities_keep_the_argmax_and_pad_ragged_rows():
    scaled = probabilities([[2.0, 1.0, 0.0], [0.5, 1.5]], temperature=3.0)
    assert scaled.shape == (2, 3)
    assert list(scaled.argmax(axis=1)) == [0, 1]
    assert scaled[1, 2] == 0.0
    assert scaled.sum(axis=1) == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("true_temperature", [0.5, 2.0])
def test_the_fit_recovers_a_known_temperature(true_temperature):
    rng = np.random.default_rng(3)
    logits = rng.normal(0.0, 3.0, size=(20000, 3))
    truth = probabilities(logits, true_temperature)
    gold = [rng.choice(3, p=row) for row in truth]
    fitted = fit_temperature(logits, gold)
    assert fitted == pytest.approx(true_temperature, rel=0.05)
    assert mean_nll(logits, gold, fitted) <= mean_nll(logits, gold, 1.0)


def test_the_fit_stays_in_the_range_the_server_accepts():
    separable = [[0.1, 0.0], [0.0, 0.1], [0.2, 0.1]]  # still improving at T = 0.05
    assert fit_temperature(separable, [0, 1, 0]) == pytest.approx(0.05)
    backwards = [[5.0, 0.0], [0.0, 5.0], [4.0, 1.0]]
    assert fit_temperature(backwards, [1, 0, 1]) == pytest.approx(20.0)


def test_out_of_fold_scores_each_group_with_the_other_groups_temperature():
    rng = np.random.default_rng(5)
    logits = rng.normal(0.0, 2.0, size=(40, 3))
    gold = list(rng.integers(0, 3, size=40))
    groups = ["x"] * 20 + ["y"] * 20
    held_out, fold_temperatures = out_of_fold_probabilities(logits, gold, groups)
    t_without_x = fit_temperature(logits[20:], gold[20:])
    t_without_y = fit_temperature(logits[:20], gold[:20])
    assert fold_temperatures == [t_without_x, t_without_y]
    assert np.allclose(held_out[:20], probabilities(logits[:20], t_without_x))
    assert np.allclose(held_out[20:], probabilities(logits[20:], t_without_y))
    with pytest.raises(ValueError):
        out_of_fold_probabilities(logits, gold, ["x"] * 40)
