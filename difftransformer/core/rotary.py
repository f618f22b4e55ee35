"""Rotary position embedding (RoPE) with the interleaved (GPT-J) pairing of the reference code.

Feature pairs ``(x[2i], x[2i+1])`` are rotated by the angle ``pos * f_i`` with ``f_i = theta ** (-2i / d)``.
Hugging Face Llama models pair ``(x[i], x[i + d/2])`` instead ("rotate half"); `difftransformer.interop.hf` permutes the
projection rows when converting, so the two conventions give identical results.

Two context-extension scalings of the frequencies are supported, as Llama-family checkpoints use them (their
``rope_scaling`` / ``rope_parameters`` entries, same names):
- ``{"rope_type": "linear", "factor": s}``: every frequency divided by s (positions interpolated);
- ``{"rope_type": "llama3", "factor": s, "low_freq_factor": a, "high_freq_factor": b,
  "original_max_position_embeddings": L}`` (Llama 3.1): frequencies whose wavelength ``2 pi / f`` is shorter
  than ``L / b`` are kept, those longer than ``L / a`` are divided by s, and those in between are blended,
  ``(1 - w) f / s + w f`` with ``w = (L / wavelength - a) / (b - a)``.
"""

from __future__ import annotations

import math

import torch

from difftransformer.errors import InputError

ROPE_SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def rope_scaling_problem(scaling: object) -> str | None:
    """What is wrong with a ``rope_scaling`` dict (None when it is valid or None)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict) or scaling.get("rope_type") not in ROPE_SCALINGS:
        kinds = ", ".join(f"{{'rope_type': {k!r}, ...}}" for k in ROPE_SCALINGS)
        return f"must be None or one of {kinds}, got {scaling!r}"
    expected = set(ROPE_SCALINGS[scaling["rope_type"]])
    if set(scaling) - {"rope_type"} != expected:
        return f"of rope_type {scaling['rope_type']!r} needs exactly the keys {sorted(expected)}, got {sorted(scaling)}"
    for key in expected:
        value = scaling[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            return f"{key} must be a positive finite number, got {value!r}"
    if scaling["rope_type"] == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        return f"needs low_freq_factor < high_freq_factor, got {scaling}"
    return None


def inv_frequencies(
    head_dim: int, theta: float, scaling: dict | None = None, dtype: torch.dtype = torch.float32, device=None
) -> torch.Tensor:
    """The ``head_dim // 2`` rotation frequencies f_i, with the scaling applied."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim))
    if scaling is None:
        return freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / freq
    blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: divide by factor, 1: keep
    scaled = (1 - blend) * freq / factor + blend * freq
    return torch.where(
        wavelength < context / high, freq, torch.where(wavelength > context / low, freq / factor, scaled)
    )


def rotary_angles(
    positions: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype = torch.float32,
    scaling: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, shape ``positions.shape + (head_dim // 2,)``.

    float32 by default (float64 only for float64 models, as in the exactness tests).
    """
    inv_freq = inv_frequencies(head_dim, theta, scaling, dtype, positions.device)
    angles = positions.to(dtype)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def check_positions(positions: torch.Tensor, seq_len: int) -> None:
    """Refuse rotary positions ((T,) or (B, T)) that do not give one position per token."""
    if positions.shape[-1] != seq_len:
        raise InputError(f"positions has {positions.shape[-1]} entries for a sequence of {seq_len} tokens")


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
