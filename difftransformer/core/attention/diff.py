"""Differential attention, V1 (Ye et al., ICLR 2025; docs/paper.md section 1).

For differential head h with query halves q1, q2 and key halves k1, k2 of size d, and a value of width 2d:

    A     = (softmax(q1 k1^T / sqrt(d)) - lambda * softmax(q2 k2^T / sqrt(d))) v
    lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init
    lambda_init = 0.8 - 0.6 * exp(-0.3 * layer_idx)
    o_h   = RMSNorm_2d(A) * (1 - lambda_init)
    out   = out_proj(concat_h o_h)

``differential_attention`` below is that equation with both maps materialised, the readable method (and the one
analysis uses); ``MultiheadDiffAttn.forward`` adds lambda, the per-head norm and the projections. The exact fast
methods that compute the same ``A`` without holding the maps are in ``kernels.py``, chosen by ``impl`` when the
module is built.

The parameters are named and laid out as in the reference code, so its state_dict loads unchanged:
q_proj rows are (H, 2, d) (half-head 2h+c is component c of head h), k_proj rows (Hkv, 2, d) and
v_proj rows (Hkv, 2d). Query head h reads key/value group h // (H // Hkv) for both maps (``gqa_layout.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from difftransformer.core.attention import cpu_kernel
from difftransformer.core.attention.common import AttentionBase, attended
from difftransformer.core.attention.gqa_layout import warn_unknown_pairing
from difftransformer.core.attention.kernels import DECODE_ROWS, attention_probs, diff_method, softmax_dtype
from difftransformer.core.attention.logits import active_probe
from difftransformer.core.config import DIFF_IMPLS, ModelConfig
from difftransformer.core.lambda_init import lambda_init_fn
from difftransformer.core.layers import RMSNorm, bypassable, head_norm_project
from difftransformer.core.rotary import apply_rotary
from difftransformer.devices import choices
from difftransformer.errors import InputError


def differential_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lambda_full: torch.Tensor,
    *,
    scale: float,
    causal: bool = True,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A = (softmax(q1 k1^T * scale) - lambda softmax(q2 k2^T * scale)) v`` with both maps materialised: the readable
    transcription of the paper's equation, which the fast methods are tested against. Softmax in float32.

    Args:
        q: the queries, (B, H, 2, Tq, d): each head's two halves.
        k: the keys, (B, Hkv, 2, Tk, d); head h reads group h // (H / Hkv).
        v: the values, (B, Hkv, Tk, 2d).
        lambda_full: the layer's lambda, a scalar tensor.
        scale: the logits' factor, 1 / sqrt(d) in the paper.
        causal: a query attends only to keys at or before its position (aligned at the end when Tk > Tq).
        mask: boolean (B, Tk) key padding or (B, Tq, Tk) attention mask, True where attention is allowed.

    Returns:
        (A of shape (B, H, Tq, 2d), the differential map ``P1 - lambda P2`` of shape (B, H, Tq, Tk)).

    Examples:
        >>> import torch
        >>> q, k, v = torch.randn(1, 2, 2, 5, 8), torch.randn(1, 2, 2, 5, 8), torch.randn(1, 2, 5, 16)
        >>> a, w = differential_attention(q, k, v, torch.tensor(0.5), scale=8**-0.5)
        >>> a.shape, w.shape
        (torch.Size([1, 2, 5, 16]), torch.Size([1, 2, 5, 5]))
        >>> torch.allclose(w.sum(-1), torch.full((1, 2, 5), 0.5))  # each row sums to 1 - lambda
        True
    """
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)  # (B, H, 2, Tk, d): query head h reads group h // rep
    v = v.repeat_interleave(rep, dim=1)  # (B, H, Tk, 2d)
    maps = attention_probs(q, k, scale, causal, None if mask is None else mask[:, :, None])  # P1, P2: (B, H, 2, Tq, Tk)
    diff_map = maps[:, :, 0] - lambda_full * maps[:, :, 1]
    return torch.matmul(diff_map.to(v.dtype), v), diff_map


def _materialised(q, k, v, lambda_full, *, scale, causal=True, mask=None) -> torch.Tensor:
    """``impl="plain"``: the readable method as the module's method (A only)."""
    return differential_attention(q, k, v, lambda_full, scale=scale, causal=causal, mask=mask)[0]


def method_of(impl: str) -> Callable[..., torch.Tensor]:
    """The exact method ``impl`` names, as ``(q, k, v, lambda_full, *, scale, causal, mask) -> A``: ``plain`` is the
    materialised method above, the others are the fast ones of ``kernels.py``."""
    if impl not in DIFF_IMPLS:
        raise InputError(f"unknown impl {impl!r}; choose one of {DIFF_IMPLS}")
    return _materialised if impl == "plain" else diff_method(impl)


class MultiheadDiffAttn(AttentionBase):
    """Multi-head differential attention with ``num_heads`` differential heads (the paper's V1).

    Eight differential heads have the parameters of a sixteen-head standard attention of the same width. The
    parameters have the authors' names and layout, so their state dict loads with ``strict=True``.

    Args:
        embed_dim: the model width D; a multiple of ``2 * num_heads``.
        num_heads: differential heads H, each with two query/key halves of size D / 2H and a value of width D / H.
        layer_idx: the layer's index from 0, which sets lambda_init = 0.8 - 0.6 exp(-0.3 layer_idx).
        num_kv_heads: key/value groups for grouped-query attention (a divisor of ``num_heads``); None is one per
            head.
        rope_theta: the rotary embedding's base; None switches the rotary embedding off.
        norm_eps: the per-head RMSNorm's epsilon.
        causal: whether a position attends only to itself and earlier ones.
        impl: the exact method: ``auto``, ``block``, ``sdpa``, ``plain`` or ``triton`` (equal results).
        rope_scaling: a ``linear`` or ``llama3`` rotary scaling, as in Hugging Face configs.
        head_norm: False drops the per-head RMSNorm (the paper's ablation; the 1 - lambda_init factor stays).
        lambda_init: a constant lambda_init instead of the layer schedule.
        head_norm_gain: the initial weight of the per-head norm (1 in the paper; this library's option).
        head_norm_gain_fixed: keep the weight at 1 and multiply the norm's output by ``head_norm_gain``, a constant.

    Examples:
        >>> import torch
        >>> attn = MultiheadDiffAttn(embed_dim=256, num_heads=4, layer_idx=0)
        >>> y, w = attn(torch.randn(2, 10, 256), need_weights=True)
        >>> y.shape, w.shape
        (torch.Size([2, 10, 256]), torch.Size([2, 4, 10, 10]))
        >>> round(attn.lambda_init, 4)
        0.2
    """

    _version = 2  # state dicts of this version come from this library: head h reads group h // rep

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        layer_idx: int,
        num_kv_heads: int | None = None,
        rope_theta: float | None = 10000.0,
        norm_eps: float = 1e-5,
        causal: bool = True,
        impl: str = "auto",
        rope_scaling: dict | None = None,
        head_norm: bool = True,
        lambda_init: float | None = None,
        head_norm_gain: float | None = None,
        head_norm_gain_fixed: bool = False,
    ) -> None:
        what = "two half-heads per differential head"
        super().__init__(embed_dim, num_heads, layer_idx, num_kv_heads, rope_theta, causal, 2, what, rope_scaling)
        self.impl = impl
        d = self.head_dim
        self._add_projections(2 * num_heads, 2 * self.num_kv_heads, 2 * num_heads)
        self.lambda_init = lambda_init_fn(layer_idx) if lambda_init is None else float(lambda_init)
        self.lambda_q1 = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_k1 = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_q2 = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.lambda_k2 = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.subln = RMSNorm(2 * d, eps=norm_eps) if head_norm else None
        self._lambda_fixed: torch.Tensor | None = None  # set by fixed_lambdas
        self._set_head_norm_gain(head_norm_gain, head_norm_gain_fixed)
        self.reset_lambda()
        self.reset_head_norm()

    @property
    def impl(self) -> str:
        """The exact method this module runs (``DIFF_IMPLS``); assigning another switches to it."""
        return self._impl

    @impl.setter
    def impl(self, impl: str) -> None:
        self.method = method_of(impl)
        self._impl = impl

    @classmethod
    def _config_options(cls, cfg: ModelConfig, layer_idx: int) -> dict:
        """The matched pair (docs/paper.md section 2) is in the config's sizes: half the standard heads and groups,
        same head size (with ``diff_heads="all"``: as many heads and groups as the standard model, of half its head
        size)."""
        return dict(
            norm_eps=cfg.norm_eps,
            impl=cfg.attn_impl,
            head_norm=cfg.head_norm is not False,
            lambda_init=cfg.lambda_init,
            head_norm_gain=None if (gains := cfg.head_norm_gains()) is None else gains[layer_idx],
            head_norm_gain_fixed=cfg.head_norm_gain_fixed,
        )

    def reset_lambda(self, generator: torch.Generator | None = None) -> None:
        """Re-draw the four lambda vectors from N(0, 0.1) (the per-head norm: ``reset_head_norm``)."""
        for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            nn.init.normal_(p, mean=0.0, std=0.1, generator=generator)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs) -> None:
        version = (local_metadata or {}).get("version") or 0
        warn_unknown_pairing(prefix, self.num_heads, self.num_kv_heads, version)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    @property
    def head_factor(self) -> float:
        """The constant on each head's output after its norm: ``1 - lambda_init`` (the paper's), times the fixed gain
        of ``head_norm_gain_fixed`` (``head_scale``, else 1). Every path (the module and the fused decode kernel)
        takes it from here."""
        return (1 - self.lambda_init) * self.head_scale

    def lambda_full(self) -> torch.Tensor:
        """The current lambda: a float32 scalar shared by all heads of this layer (float64 for float64 vectors).
        The one place it is computed: every method and kernel receives it. Inside ``fixed_lambdas``, with no
        gradient recorded, the value computed on entering it."""
        if self._lambda_fixed is not None and not torch.is_grad_enabled():
            return self._lambda_fixed
        dtype = softmax_dtype(self.lambda_q1)
        lambda_1 = torch.exp(torch.sum(self.lambda_q1.to(dtype) * self.lambda_k1.to(dtype)))
        lambda_2 = torch.exp(torch.sum(self.lambda_q2.to(dtype) * self.lambda_k2.to(dtype)))
        return lambda_1 - lambda_2 + self.lambda_init

    def _attend(self, x, q, k, v, mask, causal, need_weights):
        b, t, _ = x.shape
        if not need_weights and self._decodes_fused(q, k, v):  # lambda, A and the per-head norm in one kernel call
            return self.out_proj(cpu_kernel.fused_decode_heads(self, q, k, v, causal, mask).reshape(b, t, -1))
        lam = self.lambda_full()
        weights = None
        if need_weights or active_probe() is not None:  # the maps are wanted, or their logits observed
            attn, weights = differential_attention(q, k, v, lam, scale=self.scaling, causal=causal, mask=mask)
        else:  # the same A by the exact method chosen at construction, without holding the maps
            attn = self.method(q, k, v, lam, scale=self.scaling, causal=causal, mask=mask)
        if self.subln is not None:  # out_proj(RMSNorm(A) * (1 - lambda_init)), the factor folded into the norm's weight
            out = head_norm_project(attn, self.subln, self.head_factor, self.out_proj)
        else:  # the ablation without the per-head norm keeps the factor
            out = self.out_proj((attn * self.head_factor).transpose(1, 2).reshape(b, t, -1))
        return (out, weights) if need_weights else out

    def _decodes_fused(self, q, k, v) -> bool:
        """Whether this call is a decode step for the fused decode kernel: ``auto``, no gradient, at most DECODE_ROWS
        queries, no logit probe, a kernel for these inputs, and a plain per-head norm in q's dtype (a norm with hooks,
        or another module, is called as a module on the path below)."""
        return (
            self.impl == "auto"
            and q.shape[3] <= DECODE_ROWS
            and not torch.is_grad_enabled()
            and active_probe() is None
            and (self.subln is None or (bypassable(self.subln) and self.subln.weight.dtype == q.dtype))
            and self.lambda_q1.dtype in (torch.float32, torch.float64)
            and choices(q.device).decode == "kernel"
            and cpu_kernel.decode_supported(q, k, v)
        )

    def _project(self, x, mask, positions, cache, rotary):
        """q (B, H, 2, T, d), k (B, Hkv, 2, Tk, d), v (B, Hkv, Tk, 2d) with rotary and cache, and the expanded mask."""
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, t, self.num_heads, 2, d)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, 2, d)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, 2 * d)
        rotary = self._rotary_of(x, positions, cache, rotary)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        q = q.permute(0, 2, 3, 1, 4)  # (B, H, 2, T, d)
        k = k.permute(0, 2, 3, 1, 4)  # (B, Hkv, 2, T, d)
        v = v.transpose(1, 2)  # (B, Hkv, T, 2d)
        return q, *attended(self, k, v, mask, cache, t)  # with a cache all L slots

    def cache_shapes(self, batch: int, slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of this layer's cached keys and values: (B, Hkv, 2, L, d) and (B, Hkv, L, 2d)."""
        d = self.head_dim
        return (batch, self.num_kv_heads, 2, slots, d), (batch, self.num_kv_heads, slots, 2 * d)

    @torch.no_grad()
    def softmax_maps(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The two softmax maps of every head, for analysis: (B, H, 2, T, T), float32. The differential map
        that forward(need_weights=True) returns is ``maps[:, :, 0] - lambda_full() * maps[:, :, 1]``."""
        q, k, _, mask = self._project(x, mask, positions, None, rotary)
        k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        return attention_probs(q, k, self.scaling, self.causal, None if mask is None else mask[:, :, None])

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"layer_idx={self.layer_idx}, lambda_init={self.lambda_init:.4f}, impl={self.impl!r}"
            + ("" if self.subln is not None else ", head_norm=False")
        )


@contextmanager
def fixed_lambdas(model: nn.Module) -> Iterator[None]:
    """Within it, with no gradient recorded, every differential attention layer of ``model`` uses the lambda it had
    on entry instead of computing it from its four vectors at every call: for a generation, whose weights do not
    change, each decode step saves one small computation per layer (about 10 to 30 us on a CPU, a few percent of a
    small model's step). Nested uses restore what they found."""
    layers = [m for m in model.modules() if isinstance(m, MultiheadDiffAttn)]
    before = [m._lambda_fixed for m in layers]
    with torch.no_grad():
        for m in layers:
            m._lambda_fixed = None
            m._lambda_fixed = m.lambda_full().detach()
    try:
        yield
    finally:
        for m, value in zip(layers, before, strict=True):
            m._lambda_fixed = value
