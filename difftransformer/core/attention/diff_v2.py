"""Differential attention, V2 (Microsoft, Jan 2026; docs/paper.md section 5).

Keeps the baseline's key/value heads and doubles the query heads; paired query heads (2h, 2h+1) share
their key/value group, and one ordinary attention call over the 2H query heads gives maps A:

    out_h = A_{2h} - sigmoid(lambda_proj(x))_h * A_{2h+1}
    out   = out_proj(concat_h out_h)

No per-head norm, no lambda_init, no exponential re-parameterisation: lambda is per token and head.
"""

from __future__ import annotations

import torch
from torch import nn

from difftransformer.core.attention.common import AttentionBase
from difftransformer.core.attention.kernels import softmax_dtype, standard_attention


class MultiheadDiffAttnV2(AttentionBase):
    """Differential attention V2: ``num_heads`` output heads of size ``embed_dim // num_heads``, each the
    difference of two query heads' softmax maps over shared keys, with a per-token lambda ``sigmoid(lambda_proj(x))``
    and no per-head norm (docs/paper.md section 5).

    Args:
        embed_dim: the model width D; a multiple of ``num_heads``.
        num_heads: output heads (2 num_heads query heads).
        layer_idx: the layer's index from 0.
        num_kv_heads: key/value heads for grouped-query attention (a divisor of ``num_heads``); None is one per
            head.
        rope_theta: the rotary embedding's base; None switches the rotary embedding off.
        causal: whether a position attends only to itself and earlier ones.
        rope_scaling: a ``linear`` or ``llama3`` rotary scaling, as in Hugging Face configs.

    Examples:
        >>> import torch
        >>> attn = MultiheadDiffAttnV2(embed_dim=256, num_heads=8, layer_idx=0)
        >>> attn(torch.randn(2, 10, 256)).shape
        torch.Size([2, 10, 256])
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        layer_idx: int,
        num_kv_heads: int | None = None,
        rope_theta: float | None = 10000.0,
        causal: bool = True,
        rope_scaling: dict | None = None,
    ) -> None:
        what = "one head of size embed_dim/num_heads"
        super().__init__(embed_dim, num_heads, layer_idx, num_kv_heads, rope_theta, causal, 1, what, rope_scaling)
        self._add_projections(2 * num_heads, self.num_kv_heads, num_heads)  # q_proj's rows (H, 2, d)
        self.lambda_proj = nn.Linear(embed_dim, num_heads, bias=False)

    def lambda_full(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token, per-head lambda in float32: (B, H, T, 1)."""
        return torch.sigmoid(self.lambda_proj(x).to(softmax_dtype(x))).transpose(1, 2)[..., None]

    def _attend(self, x, q, k, v, mask, causal, need_weights):
        attn, probs = standard_attention(
            q, k, v, scale=self.scaling, causal=causal, mask=mask, need_weights=need_weights
        )  # (B, 2H, T, d)
        lam = self.lambda_full(x)  # (B, H, T, 1)
        attn = attn[:, 0::2] - lam.to(attn.dtype) * attn[:, 1::2]  # (B, H, T, d)
        out = self.out_proj(attn.transpose(1, 2).flatten(2))
        return (out, probs[:, 0::2] - lam * probs[:, 1::2]) if need_weights else out
