"""Standard multi-head softmax attention: the matched baseline (docs/paper.md section 2).

The same call interface as MultiheadDiffAttn. ``num_heads`` heads of size ``embed_dim // num_heads``;
``num_kv_heads`` groups for GQA / MQA.
"""

from __future__ import annotations

from difftransformer.core.attention.common import AttentionBase
from difftransformer.core.attention.kernels import standard_attention
from difftransformer.core.config import ModelConfig
from difftransformer.core.layers import RMSNorm, head_norm_project


class MultiheadAttention(AttentionBase):
    """Causal (by default) multi-head attention with rotary embedding and grouped keys/values: the matched
    baseline, with the interface of MultiheadDiffAttn.

    Args:
        embed_dim: the model width D; a multiple of ``num_heads``.
        num_heads: softmax heads of size D / num_heads.
        layer_idx: the layer's index from 0.
        num_kv_heads: key/value heads for grouped-query attention (a divisor of ``num_heads``); None is one per
            head.
        rope_theta: the rotary embedding's base; None switches the rotary embedding off.
        causal: whether a position attends only to itself and earlier ones.
        rope_scaling: a ``linear`` or ``llama3`` rotary scaling, as in Hugging Face configs.
        head_norm: True adds DIFF's per-head RMSNorm (one weight of the head size shared by the heads) to each
            head's output, for the paper's ablation; the standard model has none.
        norm_eps: that norm's epsilon.
        head_norm_gain: that norm's initial weight (None: 1).
        head_norm_gain_fixed: keep the weight at 1 and multiply the norm's output by ``head_norm_gain``, a constant.

    Examples:
        >>> import torch
        >>> attn = MultiheadAttention(embed_dim=256, num_heads=8, layer_idx=0)
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
        head_norm: bool = False,
        norm_eps: float = 1e-5,
        head_norm_gain: float | None = None,
        head_norm_gain_fixed: bool = False,
    ) -> None:
        what = "one head of size embed_dim/num_heads"
        super().__init__(embed_dim, num_heads, layer_idx, num_kv_heads, rope_theta, causal, 1, what, rope_scaling)
        self._add_projections(num_heads, self.num_kv_heads, num_heads)
        self.subln = RMSNorm(self.head_dim, eps=norm_eps) if head_norm else None
        self._set_head_norm_gain(head_norm_gain, head_norm_gain_fixed)
        self.reset_head_norm()

    @classmethod
    def _config_options(cls, cfg: ModelConfig, layer_idx: int) -> dict:
        gains = cfg.head_norm_gains()
        return dict(
            head_norm=bool(cfg.head_norm),
            norm_eps=cfg.norm_eps,
            head_norm_gain=None if gains is None else gains[layer_idx],
            head_norm_gain_fixed=cfg.head_norm_gain_fixed,
        )

    def _attend(self, x, q, k, v, mask, causal, need_weights):
        attn, weights = standard_attention(
            q, k, v, scale=self.scaling, causal=causal, mask=mask, need_weights=need_weights
        )  # (B, H, T, d)
        if self.subln is not None:
            out = head_norm_project(attn, self.subln, self.head_scale, self.out_proj)
        else:
            out = self.out_proj(attn.transpose(1, 2).flatten(2))
        return (out, weights) if need_weights else out
