"""What lies on disk, below training, inference and interop: run directories (their layout, the lock, ``load_run``
and ``save_run``), checkpoints, tokenizers, corpora and the token shards (prepared, read and sampled). Loading a run
to sample from it imports this layer and the core, never the training loop. ``load_run`` loads on first use, so
that importing one module of the layer (a corpus reader) does not import torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["load_run"]

if TYPE_CHECKING:
    from difftransformer.store.runs import load_run


def __getattr__(name: str):
    if name == "load_run":
        from difftransformer.store.runs import load_run

        return load_run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
