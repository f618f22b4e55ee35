"""Rotary embedding: frequencies, the interleaved rotation and the two scalings, on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from difftransformer.core.rotary import apply_rotary, inv_frequencies, rope_scaling_problem, rotary_angles


def test_frequencies_are_theta_to_the_minus_2i_over_d():
    torch.testing.assert_close(
        inv_frequencies(8, 10000.0, dtype=torch.float64),
        torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64),  # 10000 ** (-0/8, -2/8, -4/8, -6/8)
    )


def test_interleaved_pairs_rotate_by_position_times_frequency():
    x = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64).view(1, 1, 4)  # (B, T, d), head axes none
    cos, sin = rotary_angles(torch.tensor([2]), 4, 100.0, torch.float64)  # frequencies 1 and 0.1
    out = apply_rotary(x, cos, sin)
    # pair (1, 0) turns by 2 rad -> (cos 2, sin 2); pair (0, 1) turns by 0.2 rad -> (-sin 0.2, cos 0.2)
    expected = [math.cos(2), math.sin(2), -math.sin(0.2), math.cos(0.2)]
    torch.testing.assert_close(out.view(-1), torch.tensor(expected, dtype=torch.float64))


def test_rotation_keeps_norms_and_depends_only_on_relative_position():
    q, k = torch.randn(1, 1, 2, 16, dtype=torch.float64), torch.randn(1, 1, 2, 16, dtype=torch.float64)

    def score(i, j):
        qi = apply_rotary(q, *rotary_angles(torch.tensor([i]), 16, 10000.0, torch.float64))
        kj = apply_rotary(k, *rotary_angles(torch.tensor([j]), 16, 10000.0, torch.float64))
        return (qi * kj).sum()

    torch.testing.assert_close(score(7, 3), score(107, 103))
    rotated = apply_rotary(q, *rotary_angles(torch.tensor([5]), 16, 10000.0, torch.float64))
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))


def test_linear_scaling_divides_every_frequency():
    plain = inv_frequencies(8, 10000.0, dtype=torch.float64)
    scaled = inv_frequencies(8, 10000.0, {"rope_type": "linear", "factor": 4.0}, torch.float64)
    torch.testing.assert_close(scaled, plain / 4)


def test_llama3_scaling_keeps_short_waves_divides_long_ones_and_blends_between():
    # theta 10000, d 8: wavelengths 2 pi / f = 6.28, 62.8, 628, 6283. With L = 64, low 1, high 4: kept below
    # L / 4 = 16, divided by the factor above L / 1 = 64, blended in between.
    spec = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    freq = inv_frequencies(8, 10000.0, spec, torch.float64)
    w = (64 / (2 * math.pi / 0.1) - 1) / (4 - 1)  # the blend of the 62.8-token wave: 0.0062
    expected = [1.0, (1 - w) * 0.1 / 8 + w * 0.1, 0.01 / 8, 0.001 / 8]
    torch.testing.assert_close(freq, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize(
    "scaling, problem",
    [
        ({"rope_type": "yarn", "factor": 2.0}, "must be None or one of"),
        ({"rope_type": "linear"}, "needs exactly the keys ['factor']"),
        ({"rope_type": "linear", "factor": -1}, "factor must be a positive finite number, got -1"),
        ({"rope_type": "linear", "factor": True}, "factor must be a positive finite number, got True"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 64,
            },
            "needs low_freq_factor < high_freq_factor",
        ),  # fmt: skip
    ],
)
def test_bad_scalings_are_named(scaling, problem):
    assert problem in rope_scaling_problem(scaling)


def test_valid_scalings_have_no_problem():
    assert rope_scaling_problem(None) is None
    assert rope_scaling_problem({"rope_type": "linear", "factor": 2}) is None
