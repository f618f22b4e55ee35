"""Crash-safe checkpoints: safetensors for every tensor, JSON for everything else, nothing unpickled.

Layout: ``<run>/checkpoints/step_00000100/`` holding ``model.safetensors``, ``optimizer.safetensors`` (the
optimizer's tensors keyed ``<param name>/<state name>``) and ``state.json`` (step, data position, configs,
optimizer hyper-parameters, metrics). A checkpoint is written into a temporary directory, every file is
fsync'ed, and the directory is renamed into place, so a crash while writing never damages the last good
checkpoint; only then are checkpoints beyond the newest ``keep_last`` deleted.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CKPT_DIR = "checkpoints"
PREFIX = "step_"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def flatten_optimizer(optim_state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split a name-keyed optimizer state dict (torch.distributed.checkpoint's format) into tensors and JSON."""
    tensors, scalars = {}, {}
    for name, state in optim_state["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{name}/{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{name}/{key}"] = value
    return tensors, {"param_groups": optim_state["param_groups"], "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[str, dict] = {}
    for flat, value in list(tensors.items()) + list(meta["scalars"].items()):
        name, key = flat.rsplit("/", 1)
        state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optim_state: dict,
    meta: dict,
    keep_last: int = 3,
) -> Path:
    """Write checkpoint ``step`` atomically and prune older ones; returns its directory."""
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    optim_tensors, optim_meta = flatten_optimizer(optim_state)
    save_file(_unshared(model_state), tmp / "model.safetensors")
    save_file(optim_tensors, tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps({**meta, "step": step, "optimizer": optim_meta}, indent=1) + "\n")
    for path in tmp.iterdir():
        _fsync_file(path)
    _fsync_dir(tmp)
    if final.exists():  # the same step written again after a resume: swap, never leave a gap
        old = root / f".old-{PREFIX}{step:08d}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    for stale in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(stale)
    return final


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies in which tied weights (one storage under two names) are stored twice, as safetensors requires."""
    out, seen = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().contiguous().cpu()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return out


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories of interrupted writes are ignored)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def _load_tensors(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint {file.parent} is incomplete: {file.name} is missing")
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{file} is corrupt or truncated ({err}); use an earlier checkpoint") from None


def load_model_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The model weights of one checkpoint directory."""
    return _load_tensors(Path(path) / "model.safetensors")


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(model tensors, optimizer state dict, meta) of one checkpoint directory, with clear errors."""
    path = Path(path)
    state = path / "state.json"
    if not state.is_file():
        raise FileNotFoundError(f"checkpoint {path} is incomplete: state.json is missing")
    try:
        meta = json.loads(state.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{state} is corrupt ({err}); resume from an earlier checkpoint") from None
    model = load_model_tensors(path)
    optim = unflatten_optimizer(_load_tensors(path / "optimizer.safetensors"), meta.pop("optimizer"))
    return model, optim, meta
