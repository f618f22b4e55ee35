"""Power-law fits of loss against model size or training tokens, and the fraction of one architecture's size (or
tokens) that the other needs to reach the same loss (the paper's Figure 3: 62.2% of the parameters, 63.7% of the
tokens).

A fit is ``L(x) = a * x ** -b``, least squares on log L against log x. With two or three points per curve there is
nothing left to fit an irreducible-loss offset with, so none is fitted; inside the measured range the power law
only interpolates, and a fraction read outside it is an extrapolation (``inside`` says which).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class PowerLaw:
    a: float
    b: float

    def __call__(self, x: float) -> float:
        return self.a * x**-self.b

    def inverse(self, loss: float) -> float:
        """The x at which the curve reaches ``loss``."""
        return (self.a / loss) ** (1 / self.b)


def fit_power_law(xs: list[float], losses: list[float]) -> PowerLaw:
    """Least-squares fit of log L = log a - b log x (at least two distinct x, all values positive)."""
    if len(xs) != len(losses) or len(set(xs)) < 2:
        raise ValueError(f"a power-law fit needs two or more distinct x values, got {xs}")
    if min(xs) <= 0 or min(losses) <= 0:
        raise ValueError("a power-law fit needs positive x and loss values")
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in losses]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    slope = sum((u - mx) * (v - my) for u, v in zip(lx, ly, strict=True)) / sum((u - mx) ** 2 for u in lx)
    return PowerLaw(a=math.exp(my - slope * mx), b=-slope)


def fraction_needed(candidate: PowerLaw, reference: PowerLaw, x: float) -> float:
    """The x the candidate needs to reach the reference's loss at ``x``, as a fraction of ``x`` (NaN when the
    candidate's loss does not fall with x, so no x reaches it)."""
    if candidate.b <= 0:
        return float("nan")
    return candidate.inverse(reference(x)) / x
