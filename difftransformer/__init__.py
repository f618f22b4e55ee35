"""difftransformer: the Differential Transformer (Ye et al., ICLR 2025), faithful and fast.

The public names load on first use (PEP 562), so that importing the package, and so starting ``difftx``, does not
import torch before the command line is read: a Ctrl-C during start-up is then a clean stop, not a traceback. The
import makes OpenMP's idle threads wait passively when torch is not yet loaded (difftransformer/threads.py).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from difftransformer.threads import wait_passively

__version__ = "0.1.0"

wait_passively()  # before torch loads OpenMP, which reads its wait policy once (difftransformer/threads.py)

_HOME = {
    "ModelConfig": "difftransformer.core.config",
    "MultiheadAttention": "difftransformer.core.attention",
    "MultiheadDiffAttn": "difftransformer.core.attention",
    "MultiheadDiffAttnV2": "difftransformer.core.attention",
    "TrainConfig": "difftransformer.training.config",
    "TransformerLM": "difftransformer.core.model",
    "count_parameters": "difftransformer.core.model",
    "generate": "difftransformer.inference.generate",
    "load_run": "difftransformer.store.runs",
    "train": "difftransformer.training.loop",
}

__all__ = [
    "ModelConfig",
    "MultiheadAttention",
    "MultiheadDiffAttn",
    "MultiheadDiffAttnV2",
    "TrainConfig",
    "TransformerLM",
    "count_parameters",
    "generate",
    "load_run",
    "train",
    "__version__",
]

if TYPE_CHECKING:  # what the names are, for type checkers and readers
    from difftransformer.core.attention import MultiheadAttention, MultiheadDiffAttn, MultiheadDiffAttnV2
    from difftransformer.core.config import ModelConfig
    from difftransformer.core.model import TransformerLM, count_parameters
    from difftransformer.inference.generate import generate
    from difftransformer.store.runs import load_run
    from difftransformer.training.config import TrainConfig
    from difftransformer.training.loop import train


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'difftransformer' has no attribute {name!r}")
    value = getattr(import_module(_HOME[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
