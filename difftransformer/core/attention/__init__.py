"""The attention variants, one interface, chosen by name."""

from difftransformer.core.attention.diff import GQALayoutWarning, MultiheadDiffAttn, lambda_init_fn, own_layout
from difftransformer.core.attention.diff_v2 import MultiheadDiffAttnV2
from difftransformer.core.attention.standard import MultiheadAttention

ATTENTION = {"diff": MultiheadDiffAttn, "diff_v2": MultiheadDiffAttnV2, "standard": MultiheadAttention}

__all__ = [
    "ATTENTION",
    "GQALayoutWarning",
    "MultiheadAttention",
    "MultiheadDiffAttn",
    "MultiheadDiffAttnV2",
    "lambda_init_fn",
    "own_layout",
]
