"""What the three attention modules share: argument checks, masks and rotary angles."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from difftransformer.core.attention.kernels import softmax_dtype
from difftransformer.core.rotary import apply_rotary, check_positions, rope_scaling_problem, rotary_angles
from difftransformer.errors import InputError

if TYPE_CHECKING:
    from difftransformer.core.config import ModelConfig


class KVStore(Protocol):
    """What the attention modules need of a key/value cache (``difftransformer.inference.cache.KVCache`` is one):
    the slots (T,) this pass writes, the mask (B|1, 1, T, L) over all L slots (causality included), and ``update``,
    which writes a layer's new keys and values (sequence on dim -2) at the slots and returns all L. ``prefix``: T
    when this pass is a first one without padding (slots 0..T-1, whose queries see the first T slots causally: the
    attention runs causal over them and no mask is built), else None."""

    slots: torch.Tensor
    mask: torch.Tensor | None
    prefix: int | None
    length: int  # slots filled by passes that let the model choose the slots
    max_len: int

    def prepare(self, slots: torch.Tensor, padding: torch.Tensor | None = None, start: int | None = None) -> None: ...

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class AttentionBase(nn.Module):
    """Arguments shared by the attention variants: sizes, checks, rotary settings, causality; the initial gain of
    a per-head norm (``subln``) for the variants that have one."""

    head_norm_gain = 1.0
    head_norm_gain_fixed = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        layer_idx: int,
        num_kv_heads: int | None,
        rope_theta: float | None,
        causal: bool,
        per_head: int,
        what: str,
        rope_scaling: dict | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.head_dim = check_heads(embed_dim, num_heads, num_kv_heads, per_head, what)
        check_rotary(self.head_dim, rope_theta, rope_scaling)
        if layer_idx < 0:
            raise InputError(f"layer_idx counts layers from 0, got {layer_idx}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.layer_idx, self.rope_theta, self.causal = layer_idx, rope_theta, causal
        self.rope_scaling = rope_scaling
        self.scaling = self.head_dim**-0.5

    @classmethod
    def from_config(cls, cfg: ModelConfig, layer_idx: int) -> AttentionBase:
        """This variant's layer ``layer_idx`` of a model: the sizes and rotary settings every variant takes, and the
        variant's own options (``_config_options``)."""
        return cls(
            cfg.d_model,
            cfg.attention_heads,
            layer_idx,
            cfg.attention_kv_heads,
            rope_theta=cfg.rope_theta,
            rope_scaling=cfg.rope_scaling,
            **cls._config_options(cfg, layer_idx),
        )

    @classmethod
    def _config_options(cls, cfg: ModelConfig, layer_idx: int) -> dict:
        """The keyword arguments of this variant's own options for layer ``layer_idx``, from the model config (none
        by default)."""
        return {}

    def _set_head_norm_gain(self, gain: float | None, fixed: bool) -> None:
        """The per-head norm's initial weight ``gain`` (None: 1), or with ``fixed`` a constant factor ``gain`` on
        its output and the weight at 1 (``head_scale``); needs the norm (``subln``)."""
        if gain is None and fixed:
            raise InputError("head_norm_gain_fixed needs a head_norm_gain")
        if gain is not None and not (getattr(self, "subln", None) is not None and 0 < gain < math.inf):
            raise InputError(f"head_norm_gain is a positive number, with head_norm=True; got {gain!r}")
        self.head_norm_gain = 1.0 if gain is None else float(gain)
        self.head_norm_gain_fixed = bool(fixed)

    @property
    def head_scale(self) -> float:
        """The constant factor on the per-head norm's output: the fixed gain, or 1."""
        return self.head_norm_gain if self.head_norm_gain_fixed else 1.0

    def reset_head_norm(self) -> None:
        """Reset the per-head norm's weight to its initial value: ``head_norm_gain``, or 1 with a fixed gain."""
        norm = getattr(self, "subln", None)
        if norm is None:
            return
        norm.reset_parameters()
        if not self.head_norm_gain_fixed and self.head_norm_gain != 1.0:
            with torch.no_grad():
                norm.weight.fill_(self.head_norm_gain)

    def _add_projections(self, q_heads: int, kv_heads: int, out_heads: int) -> None:
        """``q_proj``, ``k_proj``, ``v_proj`` (to that many heads of ``head_dim``, ``kv_heads`` for both keys and
        values) and ``out_proj`` (from ``out_heads`` of them), without biases, made in this order."""
        d, width = self.head_dim, self.embed_dim
        self.q_proj = nn.Linear(width, q_heads * d, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * d, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * d, bias=False)
        self.out_proj = nn.Linear(out_heads * d, width, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        need_weights: bool = False,
        cache: KVStore | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend: (B, T, D) -> (B, T, D).

        Args:
            x: the input, (B, T, D).
            mask: boolean, (B, Tk) key padding or (B, T, Tk) / (B, 1, T, Tk), True where attention is allowed.
            positions: (T,) or (B, T) integer positions for the rotary embedding (default 0..T-1, or after the
                cache).
            need_weights: also return the attention map, (B, H, T, Tk): the differential map ``map1 - lambda *
                map2`` of the differential variants, the softmax map of the standard one.
            cache: a KVStore; the new keys and values are stored and all cached ones attended (Tk = cached + T).
            rotary: (cos, sin) of the new tokens' positions, when the caller computes them once for all layers.

        Returns:
            The output (B, T, D), or (output, map) with ``need_weights``.
        """
        q, k, v, mask = self._project(x, mask, positions, cache, rotary)
        # with a cache, its mask says what each slot sees (but see attended)
        return self._attend(x, q, k, v, mask, causal_of(self, cache), need_weights)

    def _project(self, x, mask, positions, cache, rotary):
        """q (B, query heads, T, d), k and v (B, Hkv, Tk, d) with rotary and cache, and the expanded mask (the
        softmax variants; differential V1 overrides it)."""
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, t, -1, d)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, d)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, d)
        if (rotary := self._rotary_of(x, positions, cache, rotary)) is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        return q.transpose(1, 2), *attended(self, k.transpose(1, 2), v.transpose(1, 2), mask, cache, t)

    def _rotary_of(self, x, positions, cache, rotary) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos/sin of the T new tokens of ``x``: ``rotary`` when the caller computed it once for all layers, else
        from ``positions`` (default: 0..T-1, or the positions after the cache); None without RoPE."""
        if self.rope_theta is None:
            return None
        if rotary is not None:
            return rotary
        if positions is None and cache is not None:
            positions = cache.slots
        return rotary_for(positions, x.shape[1], self.head_dim, self.rope_theta, x, self.rope_scaling)

    def _attend(self, x, q, k, v, mask, causal: bool, need_weights: bool):
        """The variant's attention of the projected q, k, v and its output projection: forward's return."""
        raise NotImplementedError

    def cache_shapes(self, batch: int, slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of this layer's cached keys and values, (B, Hkv, L, d) each (differential V1 overrides it)."""
        shape = (batch, self.num_kv_heads, slots, self.head_dim)
        return shape, shape


def check_heads(embed_dim: int, num_heads: int, num_kv_heads: int, per_head: int, what: str) -> int:
    """Validate the head counts; return the head size ``embed_dim // (per_head * num_heads)``."""
    if num_heads < 1 or num_kv_heads < 1:
        raise InputError(f"num_heads ({num_heads}) and num_kv_heads ({num_kv_heads}) must be at least 1")
    if embed_dim % (per_head * num_heads):
        raise InputError(
            f"embed_dim {embed_dim} is not divisible by {per_head} * num_heads = {per_head * num_heads} "
            f"({what}); choose embed_dim a multiple of {per_head * num_heads} or another num_heads"
        )
    if num_heads % num_kv_heads:
        raise InputError(
            f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}: each key/value group "
            f"must serve the same number of query heads; choose num_kv_heads among the divisors of {num_heads}"
        )
    return embed_dim // (per_head * num_heads)


def check_rotary(head_dim: int, rope_theta: float | None, rope_scaling: dict | None = None) -> None:
    if rope_theta is not None and head_dim % 2:
        raise InputError(
            f"rotary embedding needs an even head size, got {head_dim}; change embed_dim or num_heads, "
            "or pass rope_theta=None for no rotary embedding"
        )
    if (problem := rope_scaling_problem(rope_scaling)) is not None:
        raise InputError(f"rope_scaling {problem}")


def rotary_for(
    positions: torch.Tensor | None,
    seq_len: int,
    head_dim: int,
    theta: float,
    like: torch.Tensor,
    scaling: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for ``positions`` ((T,) or (B, T) integers), or for 0..T-1 when None, on ``like``'s device."""
    device = like.device
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    else:
        check_positions(positions, seq_len)
    return rotary_angles(positions, head_dim, theta, softmax_dtype(like), scaling)


def expand_mask(mask: torch.Tensor | None, batch: int, tq: int, tk: int) -> torch.Tensor | None:
    """Normalise an attention mask to a boolean (B|1, 1, Tq, Tk) tensor, True where attention is allowed.

    Accepts a key padding mask (B, Tk) (True for real tokens), or a full mask (B, Tq, Tk) or
    (B|1, 1, Tq, Tk). The mask combines with causality; it does not replace it.
    """
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise InputError(f"attention mask must be boolean (True = may attend), got dtype {mask.dtype}")
    if mask.dim() == 2:
        mask = mask[:, None, None, :]
    elif mask.dim() == 3:
        mask = mask[:, None]
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] != 1 or mask.shape[-1] != tk:
        raise InputError(
            f"attention mask of shape {tuple(mask.shape)} does not fit batch {batch}, {tq} queries and {tk} "
            "keys; give (B, Tk), (B, Tq, Tk) or (B, 1, Tq, Tk)"
        )
    if mask.shape[2] not in (1, tq):
        raise InputError(f"attention mask has {mask.shape[2]} query rows for {tq} queries")
    return mask.expand(mask.shape[0], 1, tq, tk)


def attended(
    attn: torch.nn.Module, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, cache, tq: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The keys, values and normalised mask that ``tq`` queries attend: with a cache every slot (the new keys and
    values written at theirs) and the cache's mask, which includes causality, or for a first pass without padding
    (``cache.prefix``) its own slots and no mask (``causal_of`` then says causal); without a cache, the new ones and
    ``mask`` expanded (expand_mask). The heads' axis is 1 and the keys' axis -2 of ``v``."""
    if cache is not None:
        k, v = cache.update(attn.layer_idx, k, v)
        if cache.prefix is not None:  # the same attention as the mask's over all slots, at a triangle's cost
            return k.narrow(-2, 0, cache.prefix), v.narrow(-2, 0, cache.prefix), None
        return k, v, cache.mask
    return k, v, expand_mask(mask, v.shape[0], tq, v.shape[-2])


def causal_of(attn: torch.nn.Module, cache) -> bool:
    """Whether the attention applies causality itself: the module's setting without a cache; with one, only for a
    first pass without padding (``attended`` hands it the pass's own slots), else the cache's mask carries it."""
    return attn.causal if cache is None else cache.prefix is not None
