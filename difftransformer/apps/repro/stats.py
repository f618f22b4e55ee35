"""Statistics of the reports: intervals of a mean over seeds, paired differences between matched models, and the
sampling error of an accuracy measured on a finite evaluation set."""

from __future__ import annotations

import math
import statistics

import torch

# two-sided 95% Student t quantiles for 1..30 degrees of freedom; more than 30 uses the last (slightly wider than
# the true quantile, which falls to 1.96)
T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95% Student t interval of the mean (low = high = mean for one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, m, m
    half = T95[min(len(values) - 1, len(T95)) - 1] * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def paired(first: dict[int, float], second: dict[int, float]) -> dict:
    """first - second over the seeds both have (the same seed: the same initialisation of the shared layers and
    the same data), with the 95% t interval of the mean difference: {seeds, differences, mean, low, high}."""
    seeds = sorted(set(first) & set(second))
    if not seeds:
        raise ValueError("no seed is measured for both models")
    diffs = [first[s] - second[s] for s in seeds]
    m, low, high = t_interval(diffs)
    return {"seeds": seeds, "differences": diffs, "mean": m, "low": low, "high": high}


def binomial_se(accuracy: float, n: int) -> float:
    """The standard error of an accuracy measured on ``n`` independent examples."""
    if n < 1:
        raise ValueError(f"an accuracy needs at least one example, got n={n}")
    return math.sqrt(max(accuracy * (1 - accuracy), 0.0) / n)


def paired_se(first: torch.Tensor, second: torch.Tensor) -> float:
    """The standard error of the difference of two accuracies measured on the same examples: the standard
    deviation of the per-example differences (first - second, each 1 or 0 for right or wrong) over sqrt(n)."""
    if first.shape != second.shape or first.dim() != 1 or len(first) < 2:
        raise ValueError(f"need two equal-length vectors of at least 2 examples, got {first.shape} and {second.shape}")
    d = first.double() - second.double()
    return (d.std() / math.sqrt(len(d))).item()
