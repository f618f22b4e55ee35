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


def t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t with ``df`` degrees of freedom: 1/2 plus the density integrated from 0 to |x|
    (Simpson's rule on 2000 intervals of u = atan(t / sqrt(df)), where the density is smooth and bounded)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    k = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    top = math.atan(abs(x) / math.sqrt(df))
    n = 2000

    def f(u: float) -> float:  # density of t = sqrt(df) tan u, times dt/du
        c = math.cos(u)
        return math.exp(k + (df - 1) * math.log(c)) * math.sqrt(df) if c > 0 else 0.0

    h = top / n
    area = f(0) + f(top) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
    half = area * h / 3
    return 0.5 + half if x >= 0 else 0.5 - half


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on ``t_cdf``)."""
    if not 0 < p < 1:
        raise ValueError(f"a quantile's probability is in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment of ``pvalues`` (one family): the k-th smallest is multiplied by (m - k + 1), then
    made non-decreasing in that order and capped at 1; reject where the adjusted value is below the level."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def holm_levels(pvalues: list[float], alpha: float) -> list[float]:
    """The level at which Holm's step-down procedure tests each p-value: alpha / (m - k + 1) for the k-th smallest
    while every smaller one was rejected, and from the first that is not on, the level at which that one failed. An
    interval at 1 - level excludes the null value exactly when ``holm`` rejects (adjusted p-value below alpha); as a
    set such intervals are not guaranteed to cover simultaneously (Bonferroni's at alpha / m are)."""
    m = len(pvalues)
    levels = [0.0] * m
    failed = None
    for rank, i in enumerate(sorted(range(m), key=lambda i: pvalues[i])):
        step = alpha / (m - rank)
        if failed is None and pvalues[i] >= step:
            failed = step
        levels[i] = step if failed is None else failed
    return levels


def paired_test(differences: list[float], margin: float, level: float) -> dict:
    """A paired comparison over seeds: the mean difference, its two-sided p-value against 0, and the TOST
    equivalence p-value at ``margin`` (the larger of the two one-sided p-values that the true difference is above
    -margin and below +margin), with the two-sided interval at ``level`` (e.g. 1 - 0.05 / m for an interval
    Bonferroni-adjusted over a family of m; TOST at a level alpha reads the (1 - 2 alpha) interval)."""
    n = len(differences)
    if n < 2:
        raise ValueError(f"a paired test needs at least 2 seeds, got {n}")
    mean = statistics.fmean(differences)
    se = statistics.stdev(differences) / math.sqrt(n)
    df = n - 1
    if se == 0:
        p_zero = 0.0 if mean != 0 else 1.0
        p_tost = 0.0 if abs(mean) < margin else 1.0
    else:
        p_zero = 2 * (1 - t_cdf(abs(mean) / se, df))
        p_tost = max(1 - t_cdf((mean + margin) / se, df), t_cdf((mean - margin) / se, df))
    half = t_quantile(1 - (1 - level) / 2, df) * se
    return {"n": n, "mean": mean, "se": se, "p_zero": p_zero, "p_tost": p_tost, "margin": margin,
            "level": level, "low": mean - half, "high": mean + half}  # fmt: skip


def contrasts(family: list[tuple[str, str, str]], values: dict[str, dict[int, float]], margin: float, alpha: float):
    """A family of paired contrasts, each (first, second, the question it answers), over the seeds both of ``values``
    have: Holm-adjusted p-values against zero and for TOST at ``margin``; each interval at the level of its Holm step
    (it excludes zero exactly when Holm calls the difference), Bonferroni's simultaneous one beside it
    (``simultaneous``); and what each may say (``verdict``)."""
    differences = []
    for first, second, _ in family:
        a, b = values[first], values[second]
        seeds = sorted(set(a) & set(b))
        differences.append((seeds, [a[s] - b[s] for s in seeds]))
    simultaneous = 1 - alpha / max(1, len(family))
    rows = [{"first": first, "second": second, "question": question, "seeds": seeds,
             **paired_test(diffs, margin, simultaneous)}
            for (first, second, question), (seeds, diffs) in zip(family, differences, strict=True)]  # fmt: skip
    levels = holm_levels([r["p_zero"] for r in rows], alpha)
    for row, level, (_, diffs) in zip(rows, levels, differences, strict=True):
        row["simultaneous"] = [row["low"], row["high"]]
        row.update(paired_test(diffs, margin, 1 - level))
    for key in ("p_zero", "p_tost"):
        for row, adjusted in zip(rows, holm([r[key] for r in rows]), strict=True):
            row[key + "_holm"] = adjusted
    for row in rows:
        row["verdict"] = verdict(row, alpha)
    return rows


def verdict(row: dict, alpha: float) -> str:
    """What a contrast may say: equivalent (TOST at its margin), different (against zero), or neither."""
    if row["p_tost_holm"] < alpha:
        return f"equivalent within +-{row['margin']:g}"
    if row["p_zero_holm"] < alpha:
        return "lower" if row["mean"] < 0 else "higher"
    return f"not distinguishable at +-{max(abs(row['low']), abs(row['high'])):.3f}"


def paired_finite(first: dict[int, float], second: dict[int, float]) -> dict | None:
    """paired, or None when a value is not finite (a diverged run; a slice without tokens)."""
    if not all(math.isfinite(x) for x in (*first.values(), *second.values())):
        return None
    return paired(first, second)
