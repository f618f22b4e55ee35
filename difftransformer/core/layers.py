"""Building blocks of the LLaMA-style decoder: RMSNorm and the SwiGLU feed-forward network."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 (or float64), optional weight."""

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """``x / sqrt(mean(x^2) + eps) * weight * scale``; a constant ``scale`` is folded into the weight, which
        saves a pass over x (the per-head norm of differential attention scales by 1 - lambda_init)."""
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        weight = self.weight
        if weight is None and scale != 1.0:
            weight = torch.full((x.shape[-1],), scale, dtype=xf.dtype, device=x.device)
        elif weight is not None:
            weight = (weight * scale if scale != 1.0 else weight).to(xf.dtype)
        return F.rms_norm(xf, (x.shape[-1],), weight, self.eps).type_as(x)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{None if self.weight is None else self.weight.shape[0]}, eps={self.eps}"


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases (docs/paper.md section 2)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
