"""Where a run's metrics go besides metrics.jsonl (which is always written and is the record a resume keeps):
TensorBoard event files in RUN/tensorboard and a Weights & Biases run in RUN/wandb, each with the same scalars.

A row of metrics.jsonl becomes the scalars of ``scalars(row)``. TensorBoard's files are rebuilt from metrics.jsonl
when a run resumes, so that the run is one curve with one value per step (the steps trained again after the
checkpoint replace the ones a stopped invocation wrote). W&B runs offline unless ``WANDB_MODE`` says otherwise; each
invocation of a run is one offline directory under RUN/wandb with the run's W&B id, and a resumed one starts at the
step after its checkpoint (``wandb sync`` uploads them as one run).
"""

from __future__ import annotations

import importlib
import os
import secrets
import shutil
from pathlib import Path

from difftransformer.fsutil import write_text_atomic

SINKS = ("jsonl", "tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
WANDB_ID = "wandb_id"  # in WANDB_DIR: the run's W&B id, the same for every invocation of the run


def parse_sinks(value: str) -> tuple[str, ...] | str:
    """The sinks of a comma-separated ``--log-to`` value, jsonl first and always (a string: what is wrong)."""
    names = [name.strip() for name in value.split(",")] if isinstance(value, str) else None
    if not names or any(name not in SINKS for name in names):
        return f"must be a comma-separated list of {', '.join(SINKS)}, got {value!r}"
    return ("jsonl", *(name for name in SINKS[1:] if name in names))


def scalars(row: dict) -> dict[str, float]:
    """The scalars of a metrics.jsonl row, by the name every sink gives them."""
    out = {
        "train/loss": row["loss"],
        "train/lr": row["lr"],
        "train/grad_norm": row["grad_norm"],
        "train/tokens_per_s": row["tokens_per_s"],
        "train/skipped": 1.0 if "skipped" in row else 0.0,
    }
    if "val_loss" in row:
        out["val/loss"], out["val/bpb"] = row["val_loss"], row["val_bpb"]
    for layer, value in enumerate(row.get("lambda") or ()):
        out[f"lambda/layer_{layer:02d}"] = value
    return out


class TensorBoardSink:
    """Event files in ``run_dir``/tensorboard (through torch.utils.tensorboard)."""

    def __init__(self, run_dir: Path, rows: list[dict]) -> None:
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        path = run_dir / TENSORBOARD_DIR
        shutil.rmtree(path, ignore_errors=True)  # rebuilt from the rows metrics.jsonl keeps
        self.writer = SummaryWriter(log_dir=str(path))
        for row in rows:
            self.write(row, flush=False)
        self.writer.flush()

    def write(self, row: dict, flush: bool = True) -> None:
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, row["step"])
        if flush:
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in ``run_dir``/wandb, offline unless WANDB_MODE is set; ``config`` is the run's recipe."""

    def __init__(self, run_dir: Path, config: dict) -> None:
        _require("wandb")
        import wandb

        path = run_dir / WANDB_DIR
        path.mkdir(exist_ok=True)
        id_file = path / WANDB_ID
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(4)
            write_text_atomic(id_file, run_id + "\n")
        self.run = wandb.init(
            dir=str(run_dir),
            project=os.environ.get("WANDB_PROJECT", "difftransformer"),
            name=run_dir.name,
            id=run_id,
            resume="allow",
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )

    def write(self, row: dict) -> None:
        self.run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


def open_sinks(sinks: tuple[str, ...], run_dir: Path, rows: list[dict], config: dict) -> list:
    """The sinks besides jsonl, opened on ``run_dir`` whose metrics.jsonl holds ``rows``."""
    opened = []
    try:
        if "tensorboard" in sinks:
            opened.append(TensorBoardSink(run_dir, rows))
        if "wandb" in sinks:
            opened.append(WandbSink(run_dir, config))
    except BaseException:
        for sink in opened:
            sink.close()
        raise
    return opened


def check_available(sinks: tuple[str, ...]) -> None:
    """Import what the sinks need, so that a missing one fails before a run starts."""
    for name in sinks[1:]:
        _require(name)


def _require(module: str) -> None:
    """Import ``module``; a ModuleNotFoundError names it (the CLI then names the extra that installs it)."""
    importlib.import_module(module)
