"""difftransformer: the Differential Transformer (Ye et al., ICLR 2025), faithful and fast."""

from difftransformer.core.attention import MultiheadAttention, MultiheadDiffAttn, MultiheadDiffAttnV2
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM, count_parameters
from difftransformer.inference.generate import generate
from difftransformer.training.runs import load_run

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
