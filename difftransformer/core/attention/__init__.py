"""The attention variants, one interface, chosen by name."""

from difftransformer.core.attention.diff import MultiheadDiffAttn, differential_attention, lambda_init_fn
from difftransformer.core.attention.diff_v2 import MultiheadDiffAttnV2
from difftransformer.core.attention.gqa_layout import GQALayoutWarning, own_layout
from difftransformer.core.attention.standard import MultiheadAttention

ATTENTION = {"diff": MultiheadDiffAttn, "diff_v2": MultiheadDiffAttnV2, "standard": MultiheadAttention}

__all__ = [
    "ATTENTION",
    "GQALayoutWarning",
    "MultiheadAttention",
    "MultiheadDiffAttn",
    "MultiheadDiffAttnV2",
    "differential_attention",
    "lambda_init_fn",
    "own_layout",
]
