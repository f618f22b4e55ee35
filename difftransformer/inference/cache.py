"""KVCache: preallocated keys and values of every layer, for prefill then one-token decode steps.

Each attention module stores its keys and values in its own layout with the sequence on dimension -2
(differential V1: keys (B, Hkv, 2, T, d) and values (B, Hkv, T, 2d); standard and V2: (B, Hkv, T, d)), so the
cache holds exactly what the model reads: 2 * Hkv * d keys and values per token for V1, as for the baseline.
"""

from __future__ import annotations

import torch

from difftransformer.errors import InputError


class KVCache:
    """Keys and values of positions [0, length) for every layer, in buffers of max_len positions."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new entries (sequence on dim -2) after position ``length``; return all entries so far (views)."""
        start, end = self.length, self.length + k.shape[-2]
        if end > self.max_len:
            raise InputError(f"the cache holds {self.max_len} positions; {end} were asked for")
        if layer_idx not in self._keys:
            self._keys[layer_idx] = k.new_zeros(*k.shape[:-2], self.max_len, k.shape[-1])
            self._values[layer_idx] = v.new_zeros(*v.shape[:-2], self.max_len, v.shape[-1])
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        keys[..., start:end, :] = k
        values[..., start:end, :] = v
        return keys[..., :end, :], values[..., :end, :]

    def advance(self, n: int) -> None:
        """Mark n more positions as filled (the model calls this once all its layers have stored them)."""
        self.length += n
