"""Rotary position embedding (RoPE) with the interleaved (GPT-J) pairing of the reference code.

Feature pairs ``(x[2i], x[2i+1])`` are rotated by the angle ``pos * theta ** (-2i / d)``. Hugging Face
Llama models pair ``(x[i], x[i + d/2])`` instead ("rotate half"); `difftransformer.hf` permutes the
projection rows when converting, so the two conventions give identical results.
"""

from __future__ import annotations

import torch


def rotary_angles(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, shape ``positions.shape + (head_dim // 2,)``.

    float32 by default (float64 only for float64 models, as in the exactness tests).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim))
    angles = positions.to(dtype)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of the last dimension of ``x``.

    x: (B, T, ..., d). cos, sin: (T, d/2) shared by the batch, or (B, T, d/2) per sequence.
    Computed in the angles' precision (float32, or float64 for float64 inputs), returned in ``x``'s dtype.
    """
    extra = x.dim() - 3  # head axes between T and d
    shape = cos.shape[:-1] + (1,) * extra + cos.shape[-1:]
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    pairs = x.to(torch.promote_types(x.dtype, cos.dtype)).unflatten(-1, (-1, 2))  # (..., d/2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)
