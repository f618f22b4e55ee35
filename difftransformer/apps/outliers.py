"""Activation outliers, the paper's Table 5: the largest absolute attention logits and hidden states of a model.

Over the validation windows of a run, two kinds of activation are collected per layer and pooled over layers:

- attention logits: the pre-softmax scores ``q k^T / sqrt(d)`` of every head (both maps of each DIFF V1 head, all
  2H query heads of DIFF V2, every head of the standard model), at the positions a query may attend (causal);
- hidden states: the residual stream after every block.

For each, the statistics of the paper: the 1st, 2nd, 3rd, 10th and 100th largest absolute value (exact) and the
median absolute value (from a histogram with 100 log-spaced bins per decade between 1e-6 and 1e6, so within 1.2%
of the exact median; values under 1e-6 count in the lowest bin). Collected through hooks and the logit probe:
the model and what training runs are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from difftransformer.core.attention.logits import logit_probe
from difftransformer.core.model import TransformerLM
from difftransformer.inference.magnitudes import MagnitudeStats
from difftransformer.progress import Progress, batches


class OutlierRecorder:
    """Collects per-layer attention-logit and hidden-state statistics of every forward pass of ``model`` inside
    ``with recorder.recording():``."""

    def __init__(self, model: TransformerLM) -> None:
        self.model = model
        n = len(model.layers)
        self.logits = [MagnitudeStats() for _ in range(n)]
        self.hidden = [MagnitudeStats() for _ in range(n)]
        self.tokens = 0
        self._layer: int | None = None

    @contextmanager
    def recording(self) -> Iterator[None]:
        handles = []
        for i, block in enumerate(self.model.layers):
            handles.append(block.attn.register_forward_pre_hook(self._entering(i)))
            handles.append(block.register_forward_hook(self._hidden(i)))
        handles.append(self.model.register_forward_pre_hook(self._count))
        try:
            with logit_probe(self._observe):
                yield
        finally:
            for handle in handles:
                handle.remove()
            self._layer = None

    def _entering(self, index: int):
        def hook(_module, _args):
            self._layer = index

        return hook

    def _hidden(self, index: int):
        def hook(_module, _args, output):
            self.hidden[index].add(output)

        return hook

    def _count(self, _module, args):
        self.tokens += args[0].numel()

    def _observe(self, scores: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        if self._layer is None:
            raise RuntimeError("attention logits outside a block of the recorded model")
        values = scores if allowed is None else scores.masked_select(allowed.expand_as(scores))
        self.logits[self._layer].add(values)
        return scores

    def summary(self) -> dict:
        """{"tokens", "attention_logits": {"pooled", "layers"}, "hidden_states": {...}}."""

        def table(stats: list[MagnitudeStats]) -> dict:
            pooled = stats[0]
            for s in stats[1:]:
                pooled = pooled.merge(s)
            return {"pooled": pooled.summary(), "layers": [s.summary() for s in stats]}

        return {"tokens": self.tokens, "attention_logits": table(self.logits), "hidden_states": table(self.hidden)}

    def histograms(self) -> dict[str, torch.Tensor]:
        """Pooled bin counts of each kind over ``EDGES`` (first and last bins: below and above the range)."""
        return {
            "attention_logits": sum(s.counts for s in self.logits),
            "hidden_states": sum(s.counts for s in self.hidden),
        }


@torch.no_grad()
def measure(
    model: TransformerLM, windows: torch.Tensor, batch: int = 4, progress: Progress | None = None
) -> OutlierRecorder:
    """Run ``model`` (eval mode, float32) over ``windows`` (N, T) and return the filled recorder (``progress``: a
    live line counting the windows)."""
    recorder = OutlierRecorder(model)
    was_training = model.training
    model.eval()
    try:
        with recorder.recording():
            for chunk in batches(windows, batch, progress, windows.shape[1]):
                model(chunk)
    finally:
        model.train(was_training)
    return recorder
