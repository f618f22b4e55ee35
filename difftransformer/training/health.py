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
a run blows up, it usually comes several steps before the first NaN. A step whose loss or gradient is not finite is
skipped by the step itself (training/step.py); ``HealthGuard`` counts them and stops the run at
``max_nonfinite_steps`` in a row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from difftransformer.errors import InputError
from difftransformer.training.distributed import World, all_reduce_max
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


def check_health(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, probe: torch.Tensor, world: World, amp=None
) -> tuple[list[float], float]:
    """(for the weights, the optimizer state and the probe loss: 0 where any process found it non-finite, else 1;
    the probe loss), with one host synchronisation."""
    flags, loss = state_flags(model, optimizer, probe, world.device, amp)
    values = torch.cat([all_reduce_max(1 - flags), loss.detach().float().reshape(1)]).tolist()
    return [1 - v for v in values[:3]], values[3]


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


class HealthGuard:
    """A run's guard, fed the rows the trainer reads: notes a loss spike (with the newest checkpoint from before
    it, which ``calm`` gives), counts the skipped steps in a row and says when the run must stop; keeps the lowest
    probe loss that tells a calm checkpoint from one written during a spike. ``note`` prints a note."""

    def __init__(self, max_nonfinite: int, note: Callable[[str], None], calm: Callable[[], Path | None]) -> None:
        self.max_nonfinite, self.note, self.calm = max_nonfinite, note, calm
        self.watch = LossWatch()
        self.nonfinite_in_a_row = 0
        self.probe_best = math.inf  # the lowest probe loss of the run so far
        self.updated = False  # whether a step read so far changed the weights (all skipped: diverged)

    def begin(self, flags: list[float], probe: float, start: Path | None) -> None:
        """Start a new run whose first weights (fresh, or from the checkpoint ``start``) ``check_health`` found
        ``flags`` and ``probe``: they must give a finite loss (a checkpoint of a diverged run does not); their probe
        loss is the run's first lowest."""
        if min(flags) < 1:
            if start is None:  # fresh weights: a defect, not something the user can change
                raise RuntimeError(f"the initial weights are not healthy: {unhealthy_parts(flags)}")
            raise InputError(
                f"{start} (init_from) is not healthy: {unhealthy_parts(flags)} (that run diverged); give an earlier "
                "checkpoint of it as `init_from` (its checkpoints/step_N directory)"
            )
        self.probe_best = probe

    def state(self) -> dict:
        """What a checkpoint records of the guard, for ``restore``."""
        return {
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "probe_best": self.probe_best,
            "loss_watch": self.watch.state(),
        }

    def restore(self, meta: dict, probe: float) -> None:
        """Go on from a checkpoint's ``meta`` (older ones lack some fields) whose weights have probe loss ``probe``."""
        self.probe_best = min(meta.get("probe_best", probe), probe)
        self.watch = LossWatch(meta.get("loss_watch"))
        self.nonfinite_in_a_row = meta.get("nonfinite_in_a_row", 0)

    def observe(self, row: dict) -> str | None:
        """Take a step's row (marked ``spike`` when a spike begins there); the reason the run must stop, or None."""
        self.updated = self.updated or "skipped" not in row
        if self.watch.update(row["step"], row["loss"]):
            row["spike"] = True
            calm = self.calm()
            before = "(no checkpoint is from before it)"
            if calm:
                before = f"from {calm}, the newest checkpoint from before it"
            self.note(
                f"step {row['step']}: the training loss, smoothed over about four steps, has risen to "
                f"{self.watch.smoothed:.4g}, over {SPIKE_FACTOR} times its lowest ({self.watch.lowest:.4g} at step "
                f"{self.watch.lowest_step}): a loss spike, which often comes before divergence. If it keeps rising, "
                f"stop the run and start a new one with a lower learning rate {before}"
            )
        if "skipped" not in row:
            self.nonfinite_in_a_row = 0
            return None
        self.nonfinite_in_a_row += 1
        limit = self.max_nonfinite
        self.note(
            f"step {row['step']}: {row['skipped']} (loss {row['loss']}, gradient norm {row['grad_norm']}): the update "
            f"was skipped ({self.nonfinite_in_a_row} in a row; the run stops at {limit})"
        )
        if self.nonfinite_in_a_row >= limit:
            return f"{limit} steps in a row (to step {row['step']}) had a non-finite loss or gradient"
        return None

    def calm_at(self, step: int, probe: float) -> bool:
        """Whether a checkpoint at ``step`` whose probe loss is ``probe`` is calm (noted when not)."""
        calm = probe <= SPIKE_FACTOR * self.probe_best
        if not calm:
            self.note(
                f"step {step}: this checkpoint is written during a loss spike (its probe loss {probe:.4g} is "
                f"over {SPIKE_FACTOR} times the run's lowest, {self.probe_best:.4g}); keep-last keeps the newest "
                "checkpoint from before the spike too"
            )
        self.probe_best = min(self.probe_best, probe)
        return calm
