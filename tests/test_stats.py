"""The reports' statistics on inputs whose answers are worked out by hand."""

import math

import pytest
import torch

from difftransformer.apps.repro.stats import binomial_se, paired, paired_se, t_interval


def test_t_interval_of_three_values():
    # mean 2, sample standard deviation 1, t(0.975, 2 df) = 4.303: half-width 4.303 / sqrt(3) = 2.4843
    m, low, high = t_interval([1.0, 2.0, 3.0])
    assert m == 2.0 and low == pytest.approx(2 - 2.48434, abs=1e-4) and high == pytest.approx(2 + 2.48434, abs=1e-4)
    assert t_interval([0.7]) == (0.7, 0.7, 0.7)
    # 41 values 0, 1, 0, 1, ...: beyond 30 degrees of freedom the 30-df quantile 2.042 is used
    values = [float(i % 2) for i in range(41)]
    m, low, high = t_interval(values)
    sd = (sum((v - m) ** 2 for v in values) / 40) ** 0.5
    assert high - m == pytest.approx(2.042 * sd / 41**0.5)


def test_paired_differences_match_seeds_and_give_the_interval():
    diff = {0: 0.9, 1: 0.8, 2: 0.7, 3: 0.5}
    standard = {0: 0.6, 1: 0.6, 2: 0.4, 4: 0.1}  # seed 3 and 4 are not pairs
    result = paired(diff, standard)
    assert result["seeds"] == [0, 1, 2]
    assert result["differences"] == pytest.approx([0.3, 0.2, 0.3])
    # mean 0.26667, sd 0.057735, half-width 4.303 * 0.057735 / sqrt(3) = 0.14343
    assert result["mean"] == pytest.approx(0.266667, abs=1e-5)
    assert result["high"] - result["mean"] == pytest.approx(0.14343, abs=1e-4)
    same = paired({0: 0.5, 1: 0.7}, {0: 0.4, 1: 0.6})  # a constant difference: a zero-width interval
    assert same["low"] == pytest.approx(0.1) and same["high"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="no seed is measured for both"):
        paired({0: 1.0}, {1: 1.0})


def test_binomial_standard_error():
    assert binomial_se(0.5, 100) == pytest.approx(0.05)
    assert binomial_se(0.9, 400) == pytest.approx(0.015)
    assert binomial_se(1.0, 10) == 0.0
    with pytest.raises(ValueError, match="at least one example"):
        binomial_se(0.5, 0)


def test_paired_se_of_two_accuracies_on_the_same_examples():
    first = torch.tensor([True, True, False, False])
    second = torch.tensor([True, False, False, True])
    # per-example differences 0, 1, 0, -1: sample std sqrt(2 / 3), over sqrt(4)
    assert paired_se(first, second) == pytest.approx(math.sqrt(2 / 3) / 2)
    assert paired_se(first, first) == 0.0  # the same answers: no sampling error in the difference
    with pytest.raises(ValueError, match="two equal-length vectors"):
        paired_se(first, second[:3])
