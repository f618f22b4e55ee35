"""KVCache: fixed buffers for the keys and values of every layer, written at given slots (gpt-fast's design).

The buffers are allocated once, for ``batch`` rows and ``max_len`` slots, in each attention module's own layout with
the sequence on dimension -2 (differential V1: keys (B, Hkv, 2, L, d) and values (B, Hkv, L, 2d); standard and V2:
(B, Hkv, L, d)). The cache holds exactly what the model reads: ``2 Hkv d`` keys and values per token for V1, as for
the baseline. Every forward pass writes its tokens' keys and values at its ``slots`` and attends over all ``max_len``
slots, with a mask that lets the query in slot i see the slots up to i (and, with a padding mask, only real tokens);
a first pass without padding attends its own slots causally instead, with no mask (``prepare``).
All shapes are fixed from prefill to the last decode step, so ``torch.compile`` compiles one decode step for all.

The buffers are the cache module's registered buffers (``keys_<layer>``, ``values_<layer>``), as gpt-fast keeps its
cache: ``cache.to(device)`` moves them, and ``torch.compile`` sees tensors whose addresses never change, which CUDA
graphs (mode ``reduce-overhead``) need of what a step writes into.
"""

from __future__ import annotations

import torch

from difftransformer.core.attention.common import expand_mask
from difftransformer.errors import InputError


class KVCache(torch.nn.Module):
    """Keys and values of every layer of ``model`` for ``batch`` rows and ``max_len`` slots, in fixed buffers (so
    that every decode step has the same shapes).

    ``TransformerLM.forward(tokens, cache=cache)`` writes at slots ``length .. length + T - 1`` and advances
    ``length``; with ``slots=`` the caller chooses the slots and keeps ``length`` itself (a compiled decode step).

    Args:
        model: the TransformerLM whose layers it holds keys and values for.
        batch: rows decoded together.
        max_len: slots per row (default: the model's context, ``max_seq_len``).

    Examples:
        >>> import torch
        >>> from difftransformer import ModelConfig, TransformerLM
        >>> model = TransformerLM(ModelConfig.preset("tiny")).eval()
        >>> tokens = torch.randint(0, 256, (1, 8))
        >>> cache = KVCache(model, batch=1, max_len=16)
        >>> with torch.no_grad():
        ...     _ = model(tokens[:, :7], cache=cache)  # prefill
        ...     step = model(tokens[:, 7:], cache=cache)  # one decode step
        ...     full = model(tokens)
        >>> cache.length, torch.allclose(step[0, -1], full[0, -1], atol=1e-4)
        (8, True)
    """

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int | None = None) -> None:
        super().__init__()
        max_len = model.config.max_seq_len if max_len is None else max_len
        if not 1 <= max_len <= model.config.max_seq_len:
            raise InputError(
                f"a cache holds 1 to the model's max_seq_len={model.config.max_seq_len} slots, got {max_len}"
            )
        like = model.embed.weight
        self.max_len, self.length, self.n_layers = max_len, 0, len(model.layers)
        for i, block in enumerate(model.layers):
            key_shape, value_shape = block.attn.cache_shapes(batch, max_len)
            self.register_buffer(f"keys_{i}", torch.zeros(key_shape, dtype=like.dtype, device=like.device), False)
            self.register_buffer(f"values_{i}", torch.zeros(value_shape, dtype=like.dtype, device=like.device), False)
        self.slots: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.prefix: int | None = None

    @property
    def keys(self) -> list[torch.Tensor]:
        """Every layer's key buffer."""
        return [getattr(self, f"keys_{i}") for i in range(self.n_layers)]

    @property
    def values(self) -> list[torch.Tensor]:
        """Every layer's value buffer."""
        return [getattr(self, f"values_{i}") for i in range(self.n_layers)]

    def prepare(self, slots: torch.Tensor, padding: torch.Tensor | None = None, start: int | None = None) -> None:
        """Set the slots (T,) that the next forward pass writes, and its attention mask (B|1, 1, T, max_len): slot j
        is visible to the query in slot i when j <= i and, with ``padding`` (a boolean (B, max_len) key mask, or a
        (B, T, max_len) / (B, 1, T, max_len) mask), where it is True. ``start``: the first slot, where the caller
        knows it on the host and the slots run on from it; a first pass (start 0) without padding sets ``prefix`` to
        T and builds no mask (its T x max_len booleans would be 4 GiB at 64K tokens): the attention modules run it
        causal over slots 0..T-1, the same attention at half the products."""
        if padding is None and start == 0:
            self.slots, self.mask, self.prefix = slots, None, len(slots)
            return
        self.prefix = None
        visible = torch.arange(self.max_len, device=slots.device)[None, :] <= slots[:, None]  # (T, max_len)
        mask = visible[None, None]
        if padding is not None:
            if padding.shape[-1] != self.max_len:
                raise InputError(
                    f"with a cache the attention mask covers its {self.max_len} slots, got {tuple(padding.shape)}"
                )
            mask = mask & expand_mask(padding, self.keys_0.shape[0], len(slots), self.max_len)
        self.slots, self.mask = slots, mask

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's keys and values (sequence on dim -2) at the prepared slots; return all ``max_len``."""
        keys, values = getattr(self, f"keys_{layer_idx}"), getattr(self, f"values_{layer_idx}")
        keys.index_copy_(keys.dim() - 2, self.slots, k.to(keys.dtype))
        values.index_copy_(values.dim() - 2, self.slots, v.to(values.dtype))
        return keys, values
