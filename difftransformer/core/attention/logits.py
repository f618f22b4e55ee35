"""The attention logits, the pre-softmax scores ``q k^T / sqrt(d)``, as a point to observe or quantize.

Inside ``with logit_probe(fn):`` every attention layer (both maps of a DIFF V1 head, the query heads of DIFF V2,
the heads of the standard model) computes its maps on the materialising path and passes its scores through
``fn(scores, allowed)`` before the softmax; ``fn`` returns the scores to use. ``allowed`` is a boolean tensor
broadcastable to the scores (True where a query may attend), or None when every entry is allowed. Outside the
context nothing changes: training and the fast kernels never look at it.

``LogitQuantizer`` is the paper's Figure 8 protocol: symmetric uniform quantization of the logits to ``bits`` bits
with a dynamic absmax scale, taken over the entries a query may attend (masked entries never set the scale),
either per head and query row (``"row"``, the default: one scale per softmax) or per tensor (``"tensor"``: one
scale for all heads and rows of one sequence in one layer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from difftransformer.errors import InputError

Probe = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]
GRANULARITIES = ("row", "tensor")

# A module global rather than a context variable: torch.compile traces a global read without a graph break (and
# guards on it), where ContextVar.get breaks the graph. So a probe is process-wide, not per thread.
_PROBE: Probe | None = None


@contextmanager
def logit_probe(probe: Probe) -> Iterator[None]:
    """Route every attention call inside through the materialising path, with ``probe`` applied to its logits
    (process-wide while the context is open; contexts nest)."""
    global _PROBE
    outer, _PROBE = _PROBE, probe
    try:
        yield
    finally:
        _PROBE = outer


def active_probe() -> Probe | None:
    """The probe of the innermost open ``logit_probe`` context, or None."""
    return _PROBE


def check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
        raise InputError(f"logit bits must be an integer from 2 to 16, got {bits!r}")
    return bits


def quantize_absmax(
    scores: torch.Tensor, bits: int, allowed: torch.Tensor | None = None, granularity: str = "row"
) -> torch.Tensor:
    """``round(s / step) * step`` with ``step = absmax / (2^(bits-1) - 1)``: the values a signed ``bits``-bit
    integer with that scale represents. absmax over the last dimension (``row``) or over all but the first, the
    batch dimension (``tensor``), counting only ``allowed`` entries; a slice whose allowed entries are all zero is
    returned unchanged."""
    check_bits(bits)
    if granularity not in GRANULARITIES:
        raise InputError(f"unknown logit quantization granularity {granularity!r}; choose one of {GRANULARITIES}")
    levels = 2 ** (bits - 1) - 1
    magnitude = scores.abs() if allowed is None else scores.abs().masked_fill(~allowed, 0.0)
    absmax = magnitude.amax(-1, keepdim=True) if granularity == "row" else magnitude.flatten(1).amax(1)
    if granularity == "tensor":
        absmax = absmax.view(-1, *[1] * (scores.dim() - 1))
    step = absmax / levels
    safe = torch.where(step > 0, step, torch.ones_like(step))
    quantized = torch.round(scores / safe).clamp_(-levels, levels) * safe
    return torch.where(step > 0, quantized, scores)


class LogitQuantizer:
    """A probe that quantizes the attention logits to ``bits`` bits (dynamic absmax, per ``granularity``)."""

    def __init__(self, bits: int, granularity: str = "row") -> None:
        self.bits = check_bits(bits)
        if granularity not in GRANULARITIES:
            raise InputError(f"unknown logit quantization granularity {granularity!r}; choose one of {GRANULARITIES}")
        self.granularity = granularity

    def __call__(self, scores: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        return quantize_absmax(scores, self.bits, allowed, self.granularity)

    def __repr__(self) -> str:
        return f"LogitQuantizer(bits={self.bits}, granularity={self.granularity!r})"
