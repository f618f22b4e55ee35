"""The training loop: AdamW with the paper's defaults, warmup then cosine decay, clipping, accumulation,
autocast, periodic validation (loss and bits per byte), JSONL metrics with lambda per layer, crash-safe
checkpoints and exact resume, on one process or many (torchrun, DDP or FSDP2)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from difftransformer.checkpoint import list_checkpoints, load_checkpoint, load_model_tensors, save_checkpoint
from difftransformer.config import ModelConfig
from difftransformer.data import TokenData, WindowSampler, eval_windows
from difftransformer.distributed import (
    PARALLEL_MODES,
    World,
    all_reduce_mean,
    full_state,
    init_world,
    load_full_state,
    parallelize,
    unwrap,
)
from difftransformer.fsutil import check_new_dir
from difftransformer.model import TransformerLM
from difftransformer.runs import MODEL_CONFIG
from difftransformer.tokenizer import load_tokenizer

TRAIN_CONFIG = "train_config.json"

METRICS = "metrics.jsonl"


@dataclass
class TrainConfig:
    """One training run. The defaults follow PAPER.md section 2 (AdamW (0.9, 0.98), lr 1.5e-3, wd 0.05,
    375 warmup steps) scaled to short runs: warmup is capped at a tenth of the steps."""

    data: str
    out: str
    preset: str = "tiny"
    attention: str = "diff"
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides
    init_from: str | None = None  # a run directory whose newest weights (and model config) start this run
    seq_len: int | None = None  # None: min(preset max_seq_len, 256)
    batch_size: int = 16  # sequences per optimizer step, all processes together
    grad_accum: int = 1
    max_steps: int = 2000
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # None: min(375, max_steps // 10)
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    eval_interval: int = 200
    eval_tokens: int = 1 << 16
    log_interval: int = 10
    ckpt_interval: int = 500
    keep_last: int = 3
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 autocast on GPUs that support it, else float32
    compile: bool = False
    checkpoint_activations: bool = False
    parallel: str = "none"
    threads: int | None = None

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if self.warmup_steps is None:
            self.warmup_steps = min(375, self.max_steps // 10)
        for name in ("batch_size", "grad_accum", "max_steps", "eval_interval", "log_interval", "ckpt_interval"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)!r}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by --grad-accum {self.grad_accum}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError("--lr must be positive, --min-lr-ratio in [0, 1] and --warmup-steps >= 0")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"--parallel must be one of {PARALLEL_MODES}, got {self.parallel!r}")

    def model_config(self, vocab_size: int) -> ModelConfig:
        overrides = dict(self.model)
        if "vocab_size" in overrides and overrides["vocab_size"] != vocab_size:
            raise ValueError(
                f"the model's vocab_size {overrides['vocab_size']} does not match the data's tokenizer "
                f"({vocab_size} tokens); drop the vocab_size override or prepare the data with the matching tokenizer"
            )
        return ModelConfig.preset(self.preset, attention=self.attention, **{**overrides, "vocab_size": vocab_size})

    def resolve_seq_len(self, model_config: ModelConfig) -> None:
        """Default the window length to min(max_seq_len, 256); refuse one longer than the model's context."""
        if self.seq_len is None:
            self.seq_len = min(model_config.max_seq_len, 256)
        if self.seq_len > model_config.max_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} exceeds the model's max_seq_len {model_config.max_seq_len}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        return cls(**json.loads(text))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices and embeddings only (not on norms or the lambda vectors)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, foreach=False)


def layer_lambdas(model: torch.nn.Module) -> list[float] | None:
    """lambda of every layer (V1 models), as floats; None for models without a per-layer lambda."""
    blocks = unwrap(model).layers
    if not hasattr(blocks[0].attn, "lambda_init"):
        return None
    values = []
    with torch.no_grad():
        for block in blocks:
            lam = block.attn.lambda_full()  # a DTensor under FSDP2, whose operations have global meaning
            values.append(round(float(lam.full_tensor() if hasattr(lam, "full_tensor") else lam), 6))
    return values


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    if cfg.dtype == "float32":
        return None
    if cfg.dtype == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


@torch.no_grad()
def evaluate(
    model, windows: torch.Tensor, token_bytes: torch.Tensor, device, amp, batch: int = 8
) -> tuple[float, float]:
    """Mean validation loss (nats per token) and bits per byte over fixed windows."""
    model.eval()
    total_loss, total_tokens, total_bytes = 0.0, 0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch].to(device)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        total_loss += float(loss)
        total_tokens += chunk[:, 1:].numel()
        total_bytes += int(token_bytes[chunk[:, 1:].cpu()].sum())
    model.train()
    return total_loss / total_tokens, total_loss / math.log(2) / max(1, total_bytes)


class Progress:
    """A one-line progress bar on terminals, a plain line per update elsewhere."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.tty = total, enabled, sys.stderr.isatty()

    def update(self, step: int, loss: float, tokens_per_s: float, seconds_left: float) -> None:
        if not self.enabled:
            return
        frac = step / self.total
        bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
        left = time.strftime("%H:%M:%S", time.gmtime(max(0, seconds_left)))
        line = f"[{bar}] {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s {left} left"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


class Trainer:
    """Holds one run: model, optimizer, data, and the run directory. ``train_step()`` trains one optimizer step,
    ``fit()`` trains with logging, validation and checkpoints."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, world: World | None = None, quiet: bool = False):
        self.cfg, self.world = cfg, world or init_world(cfg.device)
        self.run_dir = Path(cfg.out)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.train_data = TokenData(cfg.data, "train")
        self.val_data = TokenData(cfg.data, "val")
        data_tok = self.train_data.manifest["tokenizer"]
        self.tokenizer = self.train_data.tokenizer()
        if resume:
            run_tok = load_tokenizer(self.run_dir)
            if run_tok.fingerprint() != data_tok["fingerprint"]:
                raise ValueError(
                    f"the data in {cfg.data} was tokenised with {data_tok['fingerprint']}, but the run {self.run_dir} "
                    f"uses {run_tok.fingerprint()}: resume with the data the run was started on"
                )
            self.model_config = ModelConfig.from_json(self.run_dir / MODEL_CONFIG)
        elif cfg.init_from:
            self.model_config = ModelConfig.from_json(Path(cfg.init_from) / MODEL_CONFIG)
            if self.model_config.vocab_size != data_tok["vocab_size"]:
                raise ValueError(
                    f"--init-from {cfg.init_from} has a vocabulary of {self.model_config.vocab_size}, the data's "
                    f"tokenizer {data_tok['vocab_size']}: prepare the data with that run's tokenizer"
                )
        else:
            self.model_config = cfg.model_config(data_tok["vocab_size"])
        cfg.resolve_seq_len(self.model_config)
        if cfg.batch_size % (cfg.grad_accum * self.world.size):
            raise ValueError(
                f"--batch-size {cfg.batch_size} does not split into --grad-accum {cfg.grad_accum} x "
                f"{self.world.size} processes"
            )
        self.sampler = WindowSampler(self.train_data, cfg.seq_len, cfg.batch_size, cfg.seed)
        self.val_windows = eval_windows(self.val_data, cfg.seq_len, cfg.eval_tokens)
        self.token_bytes = torch.from_numpy(self.tokenizer.token_bytes())
        torch.manual_seed(cfg.seed)
        with torch.device(self.world.device):
            model = TransformerLM(self.model_config)
        if cfg.init_from and not resume:
            start = list_checkpoints(cfg.init_from)
            if not start:
                raise FileNotFoundError(f"--init-from {cfg.init_from} has no checkpoint to start from")
            model.load_state_dict(load_model_tensors(start[-1]), strict=True)
        self.model = parallelize(model, cfg.parallel, self.world, cfg.compile, cfg.checkpoint_activations)
        self.optimizer = make_optimizer(self.model, cfg)
        self.amp = autocast_dtype(cfg, self.world.device)
        self.step_idx = 0
        self.progress = Progress(cfg.max_steps, enabled=self.world.is_main and not quiet)
        if resume:
            self._resume()
        else:
            self._start_run_dir()

    # run directory -------------------------------------------------------------------------------------------
    def _start_run_dir(self) -> None:
        if self.world.is_main:
            check_new_dir(self.run_dir, "run directory")
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / TRAIN_CONFIG).write_text(self.cfg.to_json())
            self.model_config.to_json(self.run_dir / MODEL_CONFIG)
            self.tokenizer.save(self.run_dir)
            (self.run_dir / METRICS).write_text("")

    def _resume(self) -> None:
        checkpoints = list_checkpoints(self.run_dir)
        if not checkpoints:
            raise FileNotFoundError(f"{self.run_dir} has no checkpoint to resume from")
        model_sd, optim_sd, meta = load_checkpoint(checkpoints[-1])
        load_full_state(self.model, self.optimizer, model_sd, optim_sd)
        self.step_idx = meta["step"]
        torch.set_rng_state(torch.tensor(meta["rng_torch"], dtype=torch.uint8))
        if self.world.is_main:  # drop metrics written after the checkpoint: they will be written again
            metrics = self.run_dir / METRICS
            rows = [r for r in metrics.read_text().splitlines() if r and json.loads(r)["step"] <= self.step_idx]
            metrics.write_text("".join(r + "\n" for r in rows))

    def save(self) -> None:
        model_sd, optim_sd = full_state(self.model, self.optimizer)
        if self.world.is_main:
            meta = {
                "data_position": self.step_idx,  # the next global batch index
                "rng_torch": torch.get_rng_state().tolist(),
                "model_config": self.model_config.to_dict(),
                "train_config": dataclasses.asdict(self.cfg),
            }
            save_checkpoint(self.run_dir, self.step_idx, model_sd, optim_sd, meta, self.cfg.keep_last)

    def log(self, row: dict) -> None:
        if self.world.is_main:
            with open(self.run_dir / METRICS, "a") as f:
                f.write(json.dumps(row) + "\n")

    # training ------------------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg, model, device = self.cfg, self.model, self.world.device
        lr = lr_at(self.step_idx, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            part = self.world.rank * cfg.grad_accum + micro
            x, y = self.sampler.batch(self.step_idx, part, self.world.size * cfg.grad_accum)
            x, y = x.to(device), y.to(device)
            sync = micro == cfg.grad_accum - 1
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(sync)
            with (
                _no_sync(model, sync),
                torch.autocast(device.type, dtype=self.amp or torch.float32, enabled=self.amp is not None),
            ):
                logits = model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / cfg.grad_accum
                loss.backward()
            total += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_idx += 1
        return {"loss": float(all_reduce_mean(total)), "lr": lr, "grad_norm": float(grad_norm)}

    def validate(self) -> tuple[float, float]:
        return evaluate(self.model, self.val_windows, self.token_bytes, self.world.device, self.amp)

    def fit(self, until: int | None = None) -> list[dict]:
        """Train to ``until`` (default max_steps), logging, validating and checkpointing on the configured
        intervals; returns the logged rows."""
        cfg = self.cfg
        stop = cfg.max_steps if until is None else min(until, cfg.max_steps)
        tokens_per_step = cfg.batch_size * cfg.seq_len
        start, start_step, rows = time.perf_counter(), self.step_idx, []
        while self.step_idx < stop:
            row = self.train_step()
            step = self.step_idx
            elapsed = time.perf_counter() - start
            speed = (step - start_step) * tokens_per_step / elapsed
            row.update(step=step, tokens=step * tokens_per_step, tokens_per_s=round(speed, 1))
            if (lams := layer_lambdas(self.model)) is not None:
                row["lambda"] = lams
            if step % cfg.eval_interval == 0 or step == cfg.max_steps:
                row["val_loss"], row["val_bpb"] = self.validate()
            if step % cfg.log_interval == 0 or "val_loss" in row:
                self.log(row)
                rows.append(row)
                left = (cfg.max_steps - step) * elapsed / (step - start_step)
                self.progress.update(step, row["loss"], speed, left)
            if step % cfg.ckpt_interval == 0 or step == cfg.max_steps:
                self.save()
        if self.step_idx == cfg.max_steps:
            self.progress.close()
        return rows


class _no_sync:
    """DDP's no_sync() for accumulation micro-steps; nothing for other models."""

    def __init__(self, model, sync: bool) -> None:
        self.ctx = model.no_sync() if not sync and hasattr(model, "no_sync") else None

    def __enter__(self):
        return self.ctx.__enter__() if self.ctx else None

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc) if self.ctx else False


def train(cfg: TrainConfig, resume: bool = False, quiet: bool = False) -> list[dict]:
    return Trainer(cfg, resume=resume, quiet=quiet).fit()


def resume_config(run_dir: str | Path, max_steps: int | None = None) -> TrainConfig:
    """The TrainConfig saved in a run directory (optionally with a new max_steps)."""
    path = Path(run_dir) / TRAIN_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory ({TRAIN_CONFIG} is missing)")
    cfg = TrainConfig.from_json(path.read_text())
    if max_steps is not None:
        cfg.max_steps = max_steps
    return cfg
