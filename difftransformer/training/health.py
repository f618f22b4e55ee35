"""Whether a training state can be trusted, checked where it is cheap.

A checkpoint is written only when the state is **healthy**: every parameter and optimizer-state tensor is finite,
and the weights give a finite loss on the probe (the first ``PROBE_WINDOWS`` validation windows, the same ones for
the whole run). Finite weights alone are not enough: a DIFF model's lambda is ``exp(lambda_q1 . lambda_k1) - ...``,
so finite lambda vectors can give an infinite lambda and a NaN loss.

A healthy checkpoint is **calm** when its probe loss is at most ``SPIKE_FACTOR`` times the lowest probe loss of the
run so far (the initial weights' included); otherwise the loss had spiked when it was written. Keep-last never
deletes the newest calm checkpoint while every newer one is spiked, and a run that diverges names it.

Between checkpoints, the training loss smoothed over about four steps (an exponential moving average with weight
``EMA_WEIGHT``) rising above ``SPIKE_FACTOR`` times its lowest is noted once per spike: at the learning rates where
a run blows up, it usually comes several steps before the first NaN.
"""

from __future__ import annotations

import math

import torch

from difftransformer.training.evaluate import token_losses

SPIKE_FACTOR = 1.5
PROBE_WINDOWS = 4
EMA_WEIGHT = 0.25


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor (a DTensor's local shard under FSDP2)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def state_flags(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    probe: torch.Tensor,
    device: torch.device,
    amp: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(flags, probe loss), both on ``device``, not yet read (the model's eval-mode check of the probe's token ids
    aside): ``flags`` is a float tensor (3,) holding 1 where the weights, the optimizer state and the probe loss are
    all finite (this process's shards), and the probe loss is the mean loss of ``model`` over the windows ``probe``
    (N, T + 1)."""
    weights = [_local(p.detach()) for p in model.parameters()]
    moments = [_local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    loss = token_losses(model, probe, batch=len(probe), amp=amp, device=device).mean()

    def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.ones((), device=device)
        return torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).all().float()

    return torch.stack([all_finite(weights), all_finite(moments), torch.isfinite(loss).float()]), loss


def unhealthy_parts(flags: list[float]) -> str:
    """What ``state_flags`` found non-finite, in words (empty when healthy)."""
    names = ("the weights are not finite", "the optimizer state is not finite", "the weights give a non-finite loss")
    return "; ".join(name for name, ok in zip(names, flags, strict=True) if ok < 1)


class LossWatch:
    """The training-loss spike rule: notes the step where the smoothed loss first rises above SPIKE_FACTOR times
    its lowest, once per spike (a new note after it has come back down)."""

    def __init__(self, state: dict | None = None) -> None:
        state = state or {}
        self.smoothed: float | None = state.get("smoothed")
        self.lowest: float | None = state.get("lowest")
        self.lowest_step: int | None = state.get("lowest_step")
        self.spiking: bool = bool(state.get("spiking", False))

    def state(self) -> dict:
        return {
            "smoothed": self.smoothed,
            "lowest": self.lowest,
            "lowest_step": self.lowest_step,
            "spiking": self.spiking,
        }

    def update(self, step: int, loss: float) -> bool:
        """Take one step's training loss (non-finite losses are left out); True when a spike begins here."""
        if not math.isfinite(loss):
            return False
        self.smoothed = loss if self.smoothed is None else (1 - EMA_WEIGHT) * self.smoothed + EMA_WEIGHT * loss
        if self.lowest is None or self.smoothed < self.lowest:
            self.lowest, self.lowest_step = self.smoothed, step
        spiking = self.smoothed > SPIKE_FACTOR * self.lowest
        began = spiking and not self.spiking
        self.spiking = spiking
        return began
