"""difftransformer: the Differential Transformer (Ye et al., ICLR 2025), faithful and fast."""

from difftransformer.attention import MultiheadAttention, MultiheadDiffAttn, MultiheadDiffAttnV2
from difftransformer.config import ModelConfig
from difftransformer.generate import generate
from difftransformer.model import TransformerLM, count_parameters
from difftransformer.runs import load_run

__version__ = "0.1.0"

__all__ = [
    "ModelConfig",
    "MultiheadAttention",
    "MultiheadDiffAttn",
    "MultiheadDiffAttnV2",
    "TransformerLM",
    "count_parameters",
    "generate",
    "load_run",
    "__version__",
]
