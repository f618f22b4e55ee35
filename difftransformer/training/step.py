"""One optimizer step and what goes with it: AdamW with the paper's defaults (fused where PyTorch has it), the
learning-rate schedule (warmup then cosine decay), the step itself (accumulation, autocast, clipping, the
non-finite guard, on the device), reading steps' results in one host synchronisation, batches to the device,
and the numerics of a run (TF32). The training loop (``loop.Trainer``) and the experiments step through
``optimizer_step``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from difftransformer.devices import choices, pin
from difftransformer.training.config import TrainConfig
from difftransformer.training.distributed import all_reduce_mean, unwrap


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of a step: linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at max_steps.

    Args:
        step: the step, from 0.
        cfg: the run's config.

    Returns:
        The learning rate.

    Examples:
        >>> from difftransformer import TrainConfig
        >>> cfg = TrainConfig(data="d", out="o", lr=1e-3, max_steps=100, warmup_steps=10, min_lr_ratio=0.1)
        >>> lr_at(0, cfg), lr_at(10, cfg), round(lr_at(100, cfg), 12)  # a tenth, the peak, the floor
        (0.0001, 0.001, 0.0001)
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def optimizer_flags(device: torch.device) -> dict:
    """AdamW's implementation for parameters on ``device`` (``devices.choices``): ``fused`` where PyTorch has it,
    ``foreach`` elsewhere. The fused one also skips a non-finite step on the device (``optimizer_step``), with no read
    on the host."""
    return {"fused": True} if choices(device).fused_adamw else {"foreach": True}


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """The run's AdamW (betas, weight decay and fused kernel from ``cfg``); weight decay on matrices and embeddings
    only, not on norms or the lambda vectors.

    Args:
        model: the model.
        cfg: the run's config.

    Returns:
        The optimizer, two parameter groups: with weight decay and without.

    Examples:
        >>> from difftransformer import ModelConfig, TrainConfig, TransformerLM
        >>> optimizer = make_optimizer(TransformerLM(ModelConfig.preset("tiny")), TrainConfig(data="d", out="o"))
        >>> [group["weight_decay"] for group in optimizer.param_groups]
        [0.05, 0.0]
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, **optimizer_flags(params[0].device))


def lambda_values(model: torch.nn.Module) -> torch.Tensor | None:
    """lambda of every layer (V1 models) as one tensor on the model's device, read by no one yet; None for models
    without a per-layer lambda."""
    blocks = unwrap(model).layers
    if not hasattr(blocks[0].attn, "lambda_init"):
        return None
    with torch.no_grad():
        lams = [block.attn.lambda_full() for block in blocks]  # DTensors under FSDP2, whose operations are global
        return torch.stack([lam.full_tensor() if hasattr(lam, "full_tensor") else lam for lam in lams]).float()


def layer_lambdas(model: torch.nn.Module) -> list[float] | None:
    """lambda of every layer (V1 models), as floats; None for models without a per-layer lambda."""
    values = lambda_values(model)
    return None if values is None else rounded_lambdas(values.tolist())


def rounded_lambdas(values: list[float]) -> list[float]:
    """Per-layer lambda values as metrics record them (6 decimals)."""
    return [round(v, 6) for v in values]


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    if cfg.dtype == "float32":
        return None
    if cfg.dtype == "bfloat16":
        return torch.bfloat16
    amp = choices(device).autocast
    if amp == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return None  # a GPU older than Ampere: float32
    return amp


@dataclass
class StepResult:
    """What one optimizer step did, still on the device: the mean loss over processes, the gradient norm before
    clipping, and whether the update was skipped (a non-finite loss or norm). ``read([...])`` reads them."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    skipped: torch.Tensor
    lr: float

    def row(self) -> dict:
        return read([self])[0][0]


def read(results: list[StepResult], extra: torch.Tensor | None = None) -> tuple[list[dict], list[float]]:
    """The rows {loss, lr, grad_norm[, skipped]} of ``results`` (at least one) and the values of ``extra`` (a tensor
    on the same device), read in one host synchronisation."""
    parts = [torch.stack([torch.stack([r.loss, r.grad_norm, r.skipped.float()]) for r in results]).flatten()]
    if extra is not None:
        parts.append(extra.float().flatten())
    values = torch.cat(parts).tolist()
    n = 3 * len(results)
    out = []
    for i, r in enumerate(results):
        loss, norm, skipped = values[3 * i : 3 * i + 3]
        row = {"loss": loss, "lr": r.lr, "grad_norm": norm}
        if skipped:
            row["skipped"] = "non-finite loss" if not math.isfinite(loss) else "non-finite gradient"
        out.append(row)
    return out, values[n:]


def read_steps(
    pending: list[tuple[int, StepResult, float]],
    flag: torch.Tensor,
    model: torch.nn.Module | None,
    tokens_per_step: int,
    start: float,
    start_step: int,
) -> tuple[list[dict], int]:
    """The rows of the ``pending`` (step, result, time dispatched) steps, with tokens/s since ``start_step`` began at
    ``start`` and, when ``model`` is given, lambda per layer in the last row; and the value of ``flag`` (a tensor
    (1,): the stop signal every process agrees on), all in one read."""
    lams = lambda_values(model) if model is not None else None
    extra = flag if lams is None else torch.cat([flag, lams.to(flag.device)])
    rows, values = read([result for _, result, _ in pending], extra)
    done = time.perf_counter()  # after the read: every step so far has finished on the device
    for (step, _, t), row in zip(pending, rows, strict=True):
        seconds = (done if step == pending[-1][0] else t) - start
        speed = (step - start_step) * tokens_per_step / seconds
        row.update(step=step, tokens=step * tokens_per_step, tokens_per_s=round(speed, 1))
    if lams is not None:
        rows[-1]["lambda"] = rounded_lambdas(values[1:])
    return rows, int(values[0])


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on ``device``: a host batch to a GPU from pinned memory without waiting (the copy overlaps the work
    queued before it); a batch already on the device, or any batch on the CPU, as it is. Only host memory can be
    pinned (PyTorch refuses a CUDA tensor)."""
    if choices(device).pin_batches and x.device.type == "cpu":
        return pin(x).to(device, non_blocking=True)
    return x.to(device)


def tf32_applies(device: torch.device, amp: torch.dtype | None, capability: tuple[int, int] | None) -> bool:
    """Whether a run's float32 matrix products should use TF32: a float32 run (no autocast) on a CUDA GPU of compute
    capability 8 (Ampere) or newer, where TF32 runs them several times faster with a 10-bit mantissa, the
    precision mixed-precision training has anyway."""
    return device.type == "cuda" and amp is None and capability is not None and capability[0] >= 8


def use_tf32(device: torch.device, amp: torch.dtype | None) -> bool:
    """Turn TF32 on for this process when ``tf32_applies`` (PyTorch's switches, process-wide); whether it did."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if not tf32_applies(device, amp, capability):
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def use_deterministic_algorithms() -> None:
    """Deterministic algorithms only, process-wide (torch's switch; cuBLAS needs a fixed workspace for it, which must
    be set before its first product)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def precision(amp: torch.dtype | None, tf32: bool, parallel: str) -> str:
    """The numerics of a run in words, for its summary line."""
    if amp is None:
        return "float32 with TF32 matrix products" if tf32 else "float32"
    name = str(amp).removeprefix("torch.")
    if parallel == "fsdp":
        return f"{name} (FSDP2 mixed precision: {name} parameters, float32 gradient reduction and weights)"
    return f"{name} autocast (float32 weights)"


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    grad_clip: float,
    device: torch.device,
    amp: torch.dtype | None = None,
) -> StepResult:
    """One optimizer step at learning rate ``lr`` on the mean next-token loss of ``micro_batches``, gradients clipped
    to norm ``grad_clip`` and, under DDP or FSDP, synchronised on the last micro-batch only. A non-finite loss or
    gradient norm skips the update, on the device (nothing is read on the host).

    Args:
        model: the model (wrapped by DDP or FSDP, or not).
        optimizer: its AdamW (``make_optimizer``).
        micro_batches: (tokens, targets) pairs of (B, T) ids; a target of -100 is not scored.
        lr: this step's learning rate (``lr_at``).
        grad_clip: the largest gradient norm kept.
        device: where the batches go.
        amp: the autocast dtype (bfloat16 on GPUs), or None for float32.

    Returns:
        A StepResult, still on the device: the loss, the gradient norm and whether the step was skipped
        (``.row()`` reads them).

    Examples:
        >>> import torch
        >>> from difftransformer import ModelConfig, TrainConfig, TransformerLM
        >>> model = TransformerLM(ModelConfig.preset("tiny"))
        >>> optimizer = make_optimizer(model, TrainConfig(data="d", out="o"))
        >>> tokens = torch.randint(0, 256, (2, 33))
        >>> result = optimizer_step(model, optimizer, [(tokens[:, :-1], tokens[:, 1:])], 1e-3, 1.0, torch.device("cpu"))
        >>> row = result.row()
        >>> "skipped" in row, row["loss"] > 0
        (False, True)
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
    total = torch.zeros((), device=device)
    for micro, (x, y) in enumerate(micro_batches):
        x, y = to_device(x, device), to_device(y, device)
        sync = micro == len(micro_batches) - 1
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(sync)
        with (
            _no_sync(model, sync),
            torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None),
        ):
            logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / len(micro_batches)
            loss.backward()
        total += loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float()  # a DTensor under FSDP2
    loss = all_reduce_mean(total)
    skipped = ~(torch.isfinite(loss) & torch.isfinite(norm))  # the same on every process: both are global
    if all(group.get("fused") for group in optimizer.param_groups):
        optimizer.found_inf = skipped.float()
        optimizer.step()
        optimizer.found_inf = None
    elif not bool(skipped):  # no fused AdamW for this device: one read
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, norm.detach(), skipped, lr)


class _no_sync:
    """DDP's no_sync() for accumulation micro-steps; nothing for other models."""

    def __init__(self, model, sync: bool) -> None:
        self.ctx = model.no_sync() if not sync and hasattr(model, "no_sync") else None

    def __enter__(self):
        return self.ctx.__enter__() if self.ctx else None

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc) if self.ctx else False
