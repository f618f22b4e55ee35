"""Independent plain implementations of docs/paper.md sections 1 and 5, for the parity tests.

Written from the equations with explicit loops over heads and float64 arithmetic; they share no code
with the package. Parameters are given as a dict named like the reference code's state_dict.
"""

from __future__ import annotations

import math

import torch


def rope_interleaved(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x: (B, T, N, d). Rotate pairs (2i, 2i+1) of position t by t * theta ** (-2i / d) (GPT-J pairing)."""
    _, t, _, d = x.shape
    out = torch.empty_like(x)
    for i in range(d // 2):
        angle = torch.arange(t, dtype=x.dtype) * theta ** (-2 * i / d)
        cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = a * cos - b * sin
        out[..., 2 * i + 1] = a * sin + b * cos
    return out


def softmax_map(q: torch.Tensor, k: torch.Tensor, causal: bool, keep: torch.Tensor | None) -> torch.Tensor:
    """q, k: (B, T, d) -> softmax(q k^T / sqrt(d)) (B, T, T); keep: (B, T, T) bool or None."""
    d = q.shape[-1]
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    t = s.shape[-1]
    allowed = torch.ones_like(s, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(t, t, dtype=torch.bool).tril()
    if keep is not None:
        allowed &= keep
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.nan_to_num(p, nan=0.0)  # a row with nothing to attend is all zero


def diff_attn_v1(
    x: torch.Tensor,
    params: dict[str, torch.Tensor],
    num_heads: int,
    num_kv_heads: int,
    layer_idx: int,
    rope_theta: float | None = 10000.0,
    causal: bool = True,
    keep: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/paper.md section 1. Returns (output (B, T, D), differential maps (B, H, T, T))."""
    b, t, dim = x.shape
    h_n, g_n = num_heads, num_kv_heads
    d = dim // h_n // 2
    q = (x @ params["q_proj.weight"].T).view(b, t, 2 * h_n, d)
    k = (x @ params["k_proj.weight"].T).view(b, t, 2 * g_n, d)
    v = (x @ params["v_proj.weight"].T).view(b, t, g_n, 2 * d)
    if rope_theta is not None:
        q, k = rope_interleaved(q, rope_theta), rope_interleaved(k, rope_theta)
    lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
    lam = (
        torch.exp(torch.dot(params["lambda_q1"], params["lambda_k1"]))
        - torch.exp(torch.dot(params["lambda_q2"], params["lambda_k2"]))
        + lambda_init
    )
    heads, maps = [], []
    for h in range(h_n):
        g = h // (h_n // g_n)  # both maps of query head h read group g
        a1 = softmax_map(q[:, :, 2 * h], k[:, :, 2 * g], causal, keep)
        a2 = softmax_map(q[:, :, 2 * h + 1], k[:, :, 2 * g + 1], causal, keep)
        m = a1 - lam * a2
        o = m @ v[:, :, g]  # (B, T, 2d)
        o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + eps) * params["subln.weight"]
        heads.append(o * (1 - lambda_init))
        maps.append(m)
    out = torch.cat(heads, dim=-1) @ params["out_proj.weight"].T
    return out, torch.stack(maps, dim=1)


def diff_attn_v2(
    x: torch.Tensor,
    params: dict[str, torch.Tensor],
    num_heads: int,
    num_kv_heads: int,
    rope_theta: float | None = 10000.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/paper.md section 5, causal. Returns (output (B, T, D), differential maps (B, H, T, T))."""
    b, t, dim = x.shape
    d = dim // num_heads
    q = (x @ params["q_proj.weight"].T).view(b, t, 2 * num_heads, d)
    k = (x @ params["k_proj.weight"].T).view(b, t, num_kv_heads, d)
    v = (x @ params["v_proj.weight"].T).view(b, t, num_kv_heads, d)
    if rope_theta is not None:
        q, k = rope_interleaved(q, rope_theta), rope_interleaved(k, rope_theta)
    lam = torch.sigmoid(x @ params["lambda_proj.weight"].T)  # (B, T, H)
    group = 2 * num_heads // num_kv_heads
    heads, maps = [], []
    for h in range(num_heads):
        a1 = softmax_map(q[:, :, 2 * h], k[:, :, (2 * h) // group], True, None)
        a2 = softmax_map(q[:, :, 2 * h + 1], k[:, :, (2 * h + 1) // group], True, None)
        m = a1 - lam[:, :, h, None] * a2
        heads.append(m @ v[:, :, (2 * h) // group])
        maps.append(m)
    out = torch.cat(heads, dim=-1) @ params["out_proj.weight"].T
    return out, torch.stack(maps, dim=1)


def standard_attn(
    x: torch.Tensor, params: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int, rope_theta: float = 10000.0
) -> torch.Tensor:
    """Causal softmax attention with GQA, rotary on each head."""
    b, t, dim = x.shape
    d = dim // num_heads
    q = rope_interleaved((x @ params["q_proj.weight"].T).view(b, t, num_heads, d), rope_theta)
    k = rope_interleaved((x @ params["k_proj.weight"].T).view(b, t, num_kv_heads, d), rope_theta)
    v = (x @ params["v_proj.weight"].T).view(b, t, num_kv_heads, d)
    rep = num_heads // num_kv_heads
    heads = [softmax_map(q[:, :, h], k[:, :, h // rep], True, None) @ v[:, :, h // rep] for h in range(num_heads)]
    return torch.cat(heads, dim=-1) @ params["out_proj.weight"].T
