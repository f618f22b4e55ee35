"""Attention maps of a model and the attention-allocation metric (docs/paper.md section 3: attention to the answer span
against attention noise).

``attention_maps`` runs a forward pass and returns, per layer, the map that mixes the values: the differential map
``P1 - lambda P2`` for DIFF layers (signed), the softmax map for standard ones; with ``both=True`` a DIFF layer's two
softmax maps as well. ``allocation`` reads the row of one query position per sequence and sums it over the answer's
positions and over the rest of the context, as signed and absolute shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difftransformer.core.attention import MultiheadDiffAttn
from difftransformer.core.model import TransformerLM


@dataclass
class LayerMaps:
    mixed: torch.Tensor  # (B, H, T, T): differential map (DIFF) or softmax map (standard), float32
    softmax: torch.Tensor | None  # (B, H, 2, T, T): a DIFF layer's two softmax maps (when asked for), else None
    lam: float | None  # a DIFF layer's lambda


@torch.no_grad()
def attention_maps(model: TransformerLM, tokens: torch.Tensor, both: bool = False) -> list[LayerMaps]:
    """Per-layer attention maps of ``model`` on ``tokens`` (B, T), from one forward pass."""
    found: list[LayerMaps] = []

    def hook(module, args, kwargs, _output):
        x = args[0]
        rotary, positions = kwargs.get("rotary"), kwargs.get("positions")
        _, weights = module.forward(x, positions=positions, need_weights=True, rotary=rotary)
        if isinstance(module, MultiheadDiffAttn):
            maps = module.softmax_maps(x, positions=positions, rotary=rotary) if both else None
            found.append(LayerMaps(weights.float(), maps, module.lambda_full().item()))
        else:
            found.append(LayerMaps(weights.float(), None, None))

    handles = [block.attn.register_forward_hook(hook, with_kwargs=True) for block in model.layers]
    try:
        model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return found


def allocation(
    maps: torch.Tensor, query_pos: torch.Tensor, answer: torch.Tensor, context: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Attention of each sequence's query position to its answer positions and to the rest of its context.

    maps: (B, H, T, T) one layer's maps. query_pos: (B,) the row read. answer, context: (B, T) boolean masks of the
    answer positions and of the context (the noise is the context less the answer; positions outside the context, the
    query itself, count in neither share). Returns (B, H) tensors: ``answer`` and ``noise`` (sums of the signed map),
    ``answer_abs`` and ``noise_abs`` (sums of its absolute value). For a softmax map signed and absolute agree.
    """
    b = maps.shape[0]
    rows = maps[torch.arange(b), :, query_pos]  # (B, H, T)
    in_answer, in_noise = answer & context, context & ~answer
    out = {}
    for name, values in (("", rows), ("_abs", rows.abs())):
        out["answer" + name] = (values * in_answer[:, None]).sum(-1)
        out["noise" + name] = (values * in_noise[:, None]).sum(-1)
    return out


def span_masks(span: torch.Tensor, context_end: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """allocation's (answer, context) masks over ``t`` positions for answer spans (B, 2) [start, end) and contexts
    [0, context_end) (B,)."""
    pos = torch.arange(t)[None]
    return (pos >= span[:, :1]) & (pos < span[:, 1:]), pos < context_end[:, None]
