"""MagnitudeStats: running statistics of |x| over a stream of tensors (the largest values exactly, the rest in a
log histogram), for the activation-outlier tables and the calibration of quantized inputs."""

from __future__ import annotations

import torch

TOPS = (1, 2, 3, 10, 100)
BINS_PER_DECADE = 100
LOW, HIGH = -6, 6  # log10 of the histogram's range
EDGES = torch.logspace(LOW, HIGH, (HIGH - LOW) * BINS_PER_DECADE + 1, dtype=torch.float64)


class MagnitudeStats:
    """Running statistics of |x| over a stream of tensors: the largest ``max(TOPS)`` values and a histogram."""

    def __init__(self) -> None:
        self.top = torch.empty(0, dtype=torch.float64)
        self.counts = torch.zeros(len(EDGES) + 1, dtype=torch.int64)  # bin i: EDGES[i-1] <= |x| < EDGES[i]
        self.count = 0

    def add(self, values: torch.Tensor) -> None:
        mags = values.detach().reshape(-1).abs().to(torch.float32)
        if mags.numel() == 0:
            return
        if not torch.isfinite(mags).all():
            raise ValueError("non-finite activations: the model's weights or inputs are broken")
        keep = min(max(TOPS), mags.numel())
        candidates = torch.cat([self.top, mags.topk(keep).values.to(torch.float64)])
        self.top = candidates.topk(min(max(TOPS), len(candidates))).values
        # bin i + 1 holds EDGES[i] <= |x| < EDGES[i + 1]: from the logarithm directly (a search is slower)
        position = torch.log10(mags.clamp_min(1e-30)).sub_(LOW).mul_(BINS_PER_DECADE).floor_()
        bins = position.clamp_(-1, len(EDGES) - 1).to(torch.int64) + 1
        self.counts += torch.bincount(bins, minlength=len(EDGES) + 1)
        self.count += mags.numel()

    def merge(self, other: MagnitudeStats) -> MagnitudeStats:
        out = MagnitudeStats()
        candidates = torch.cat([self.top, other.top])
        out.top = candidates.topk(min(max(TOPS), len(candidates))).values
        out.counts = self.counts + other.counts
        out.count = self.count + other.count
        return out

    def median(self) -> float:
        """The histogram's median: the geometric centre of the bin that holds the middle value."""
        return self.quantile(0.5)

    def quantile(self, q: float, upper: bool = False) -> float:
        """The ``q``-quantile of |x| from the histogram: the geometric centre of the bin that holds it (within 1.2%),
        or with ``upper`` that bin's upper edge or the largest value, whichever is smaller (a bound no smaller than
        the quantile, for clipping ranges)."""
        if self.count == 0:
            return float("nan")
        rank = max(1, min(self.count, int(torch.tensor(q * self.count, dtype=torch.float64).ceil())))
        index = int(torch.searchsorted(self.counts.cumsum(0), rank))
        if index == 0:
            return float(EDGES[0])
        if index >= len(EDGES):
            return float(self.top[0])
        if upper:  # never above the largest value seen
            return min(float(EDGES[index]), float(self.top[0]))
        return float(torch.sqrt(EDGES[index - 1] * EDGES[index]))

    def summary(self) -> dict:
        out = {f"top{k}": float(self.top[k - 1]) if len(self.top) >= k else float("nan") for k in TOPS}
        out["median"] = self.median()
        out["count"] = self.count
        return out
