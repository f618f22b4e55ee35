"""Standard multi-head softmax attention: the matched baseline (docs/paper.md section 2).

The same call interface as MultiheadDiffAttn. ``num_heads`` heads of size ``embed_dim // num_heads``;
``num_kv_heads`` groups for GQA / MQA.
"""

from __future__ import annotations

import torch
from torch import nn

from difftransformer.core.attention.common import AttentionBase, KVStore, attended, causal_of, project_heads
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
        d, num_kv_heads = self.head_dim, self.num_kv_heads
        self.q_proj = nn.Linear(embed_dim, num_heads * d, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * d, bias=False)
        self.out_proj = nn.Linear(num_heads * d, embed_dim, bias=False)
        self.subln = RMSNorm(d, eps=norm_eps) if head_norm else None
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

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        need_weights: bool = False,
        cache: KVStore | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: (B, T, D) -> (B, T, D); with need_weights also the softmax map (B, num_heads, T, Tk).

        mask, positions, cache and rotary as in MultiheadDiffAttn.forward.
        """
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = project_heads(self, x, positions, cache, rotary, self.num_heads)  # (B, heads, T, d)
        k, v, mask = attended(self, k, v, mask, cache, t)  # with a cache all L slots (B, Hkv, L, d)
        attn, weights = standard_attention(
            q, k, v, scale=self.scaling, causal=causal_of(self, cache), mask=mask, need_weights=need_weights
        )
        if self.subln is not None:
            out = head_norm_project(attn, self.subln, self.head_scale, self.out_proj)
        else:
            out = self.out_proj(attn.transpose(1, 2).reshape(b, t, self.num_heads * d))
        return (out, weights) if need_weights else out
