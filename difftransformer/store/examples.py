"""Small inputs for the docstrings' examples, each made in a new temporary directory: a short text prepared as data,
and a run directory holding an untrained tiny model. They show how a call is made, not what it measures."""

from __future__ import annotations

import tempfile
from pathlib import Path

from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.store.data import prepare
from difftransformer.store.runs import save_run
from difftransformer.store.tokenizer import ByteTokenizer

TEXTS = ["To be, or not to be. " * 100] * 20  # 20 documents of 2,101 bytes


def example_data() -> Path:
    """``TEXTS`` prepared with the byte tokenizer, whole documents split, one in ten for validation: a new
    ``data`` directory in a new temporary directory (a run can go beside it)."""
    out = Path(tempfile.mkdtemp()) / "data"
    prepare(TEXTS, ByteTokenizer(), out, split="documents", val_every=10)
    return out


def example_run() -> Path:
    """A run directory (``run`` in a new temporary directory) holding an untrained tiny DIFF model with the byte
    tokenizer, as ``save_run`` writes it."""
    out = Path(tempfile.mkdtemp()) / "run"
    return save_run(TransformerLM(ModelConfig.preset("tiny", vocab_size=257)), ByteTokenizer(), out, {})
