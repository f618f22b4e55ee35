"""Crash-safe checkpoints: safetensors for every tensor, JSON for everything else, nothing unpickled.

Layout: ``<run>/checkpoints/step_00000100/`` holding ``model.safetensors``, ``optimizer.safetensors`` (the
optimizer's tensors keyed ``<param name>/<state name>``) and ``state.json`` (step, data position, configs,
optimizer hyper-parameters, metrics). A checkpoint is written into a temporary directory, every file is
fsync'ed, and the directory is renamed into place, so a crash while writing never damages the last good
checkpoint; only then are checkpoints beyond the newest ``keep_last`` deleted (but not the newest calm one while
every kept one was written during a loss spike: training/health.py, nor, with ``keep_best``, the one whose recorded
validation loss is lowest). A failed write (a full disk)
removes its temporary directory; ``clean_stale`` removes those of killed writes.

Every file carries a SHA-256 digest of its content (the tensors' names, dtypes, shapes and bytes in the safetensors
metadata; the rest of state.json in its ``sha256`` field), checked on loading, so a damaged checkpoint is refused
instead of loading changed weights. Checkpoints written before the digests existed load unchecked.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from difftransformer.errors import InputError
from difftransformer.fsutil import io_errno, shell
from difftransformer.paths import read_bytes
from difftransformer.schema import ANY, NUMBER, check
from difftransformer.store.shards import CHUNKS_KEY, PieceReader, piece_file_name, piece_files, piece_metadata
from difftransformer.store.weights_file import check_header

CKPT_DIR = "checkpoints"
PREFIX = "step_"
TMP, OLD = ".tmp-", ".old-"
STATE_KEYS = ("step", "optimizer")
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.safetensors", "optimizer.safetensors", "state.json"

# state.json (its sha256 aside), as the trainer, save_run and the quantizer write it (schema.py's notation); open to
# other keys, which nothing reads: save_checkpoint and save_run record what else their caller's meta holds
_PARAM_GROUP = {  # AdamW's settings as PyTorch writes them (a resume takes them from the recipe); other versions' too
    "params": [str],
    **{f"{k}?": NUMBER for k in ("lr", "eps", "weight_decay")},
    "betas?": [NUMBER],
    **{f"{k}?": bool for k in ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay")},
    **{f"{k}?": (bool, None) for k in ("foreach", "fused")},
    "*": ANY,
}
STATE_SCHEMA = {
    "step": int,
    "optimizer": {"param_groups": [_PARAM_GROUP], "scalars": {"*": ANY}},
    "files?": {"*": str},
    "data_position?": int,
    "rng_torch?": [int],
    "nonfinite_in_a_row?": int,
    "health?": {"probe_loss": NUMBER, "calm": bool},
    "probe_best?": NUMBER,
    "loss_watch?": {"smoothed": (NUMBER, None), "lowest": (NUMBER, None), "lowest_step": (int, None), "spiking": bool},
    "model_config?": {"*": ANY},
    "train_config?": {"*": ANY},
    "tokenizer?": str,
    "data?": {"path": str, "id": str},
    "val_loss?": NUMBER,
    "sharded?": {"processes": int},
    "source?": str,  # convert --from-hf
    "experiment?": str,  # repro's models
    "seed?": int,
    "spec?": {"*": ANY},
    "quantization?": {"*": ANY},  # difftx quantize
    "*": ANY,
}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def flatten_optimizer(optim_state: dict, keep: Callable[[torch.Tensor], Any] | None = None) -> tuple[dict, dict]:
    """Split a name-keyed optimizer state dict (torch.distributed.checkpoint's format) into tensors keyed
    ``<param name>/<state name>`` and JSON. ``keep(tensor)`` gives what is stored of each tensor (default: a CPU copy;
    None leaves it out: another process stores it)."""
    tensors, scalars = {}, {}
    for name, state in optim_state["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                scalars[f"{name}/{key}"] = value
            elif (kept := value.detach().contiguous().cpu() if keep is None else keep(value)) is not None:
                tensors[f"{name}/{key}"] = kept
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
    keep_best: bool = False,
) -> Path:
    """Write checkpoint ``step`` atomically and prune older ones (``keep_best``: not the one whose state.json
    records the lowest ``val_loss``); returns its directory."""
    tmp = new_checkpoint_dir(run_dir, step, f"-{os.getpid()}")
    try:
        optim_tensors, optim_meta = flatten_optimizer(optim_state)
        files = {
            MODEL_FILE: _save_tensors(_unshared(model_state), tmp / MODEL_FILE),
            OPTIMIZER_FILE: _save_tensors(optim_tensors, tmp / OPTIMIZER_FILE),
        }
    except BaseException as err:
        _raise_write_failed(run_dir, step, tmp, err)
    return publish_checkpoint(run_dir, step, tmp, files, {**meta, "optimizer": optim_meta}, keep_last, keep_best)


SHARDED_TAG = "-sharded"  # the temporary directory of a sharded write: one name for every process


def checkpoint_tmp_dir(run_dir: str | Path, step: int, tag: str) -> Path:
    """Where checkpoint ``step`` is written before it is published (``tag`` ends the name)."""
    return Path(run_dir) / CKPT_DIR / f"{TMP}{PREFIX}{step:08d}{tag}"


def new_checkpoint_dir(run_dir: str | Path, step: int, tag: str) -> Path:
    """The empty temporary directory checkpoint ``step`` is written into (``checkpoint_tmp_dir``)."""
    (Path(run_dir) / CKPT_DIR).mkdir(parents=True, exist_ok=True)
    tmp = checkpoint_tmp_dir(run_dir, step, tag)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def write_pieces(tmp: Path, kind: str, rank: int, world: int, pieces: dict) -> tuple[str, str]:
    """Write process ``rank``'s pieces of ``kind`` (model or optimizer) into the temporary directory ``tmp`` of a
    sharded checkpoint: {name: (local tensor, global shape, offset)}, in one file with the pieces' records
    (store/shards.py) and its digest, fsync'ed; returns (file name, digest)."""
    name = piece_file_name(kind, rank, world)
    tensors = _unshared({key: tensor for key, (tensor, _, _) in pieces.items()})
    records = {key: (tuple(shape), tuple(offset)) for key, (_, shape, offset) in pieces.items()}
    digest = _save_tensors(tensors, tmp / name, {CHUNKS_KEY: piece_metadata(records)})
    _fsync_file(tmp / name)
    return name, digest


def publish_checkpoint(
    run_dir: str | Path,
    step: int,
    tmp: Path,
    files: dict[str, str],
    meta: dict,
    keep_last: int = 3,
    keep_best: bool = False,
) -> Path:
    """Finish the checkpoint written into ``tmp`` (``files``: name -> digest of its tensor files): write state.json,
    fsync, rename it into place (swapping an earlier copy of the same step, never leaving a gap), and prune."""
    root = Path(run_dir) / CKPT_DIR
    final = root / f"{PREFIX}{step:08d}"
    try:
        state = {**meta, "step": step, "files": files}
        (tmp / STATE_FILE).write_text(json.dumps({**state, "sha256": _json_digest(state)}, indent=1) + "\n")
        for path in tmp.iterdir():
            _fsync_file(path)
        _fsync_dir(tmp)
    except BaseException as err:
        _raise_write_failed(run_dir, step, tmp, err)
    if (final.exists() or final.is_symlink()) and (final.is_symlink() or not final.is_dir()):
        shutil.rmtree(tmp, ignore_errors=True)
        raise InputError(
            f"{final} is not a checkpoint directory (a file or a link put there): it is left as it is and checkpoint "
            f"{final.name} was not written; move it out of {root}, then resume (the newest checkpoint is intact)"
        )
    if final.exists():  # the same step written again after a resume: swap, never leave a gap
        old = root / f"{OLD}{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    for stale in _stale(list_checkpoints(run_dir), keep_last, keep_best):
        if not stale.is_symlink():  # never followed (a resume refuses a run holding one)
            shutil.rmtree(stale)
    return final


def _raise_write_failed(run_dir: str | Path, step: int, tmp: Path, err: BaseException):
    failure = write_failed(run_dir, step, tmp, err)
    if failure is err:
        raise err
    raise failure from err


def write_failed(run_dir: str | Path, step: int, tmp: Path, err: BaseException) -> BaseException:
    """What a failed write of checkpoint ``step`` raises, after removing its temporary directory: for an I/O error (a
    full disk) an OSError that says nothing was replaced and which checkpoint is intact; any other error as it is."""
    shutil.rmtree(tmp, ignore_errors=True)
    if not (isinstance(err, OSError) and err.errno is not None):
        return err
    earlier = list_checkpoints(run_dir)
    state = (
        f"the newest checkpoint, {earlier[-1].name}, is intact. Free some space (or fix the problem) and resume"
        if earlier
        else "it was the first checkpoint, so there is no earlier one"
    )
    problem = f"could not write checkpoint {PREFIX}{step:08d} in {tmp.parent} ({err.strerror})"
    return OSError(err.errno, f"{problem}; nothing was replaced: {state}")


def _stale(checkpoints: list[Path], keep_last: int, keep_best: bool = False) -> list[Path]:
    """The checkpoints that keep-last deletes: all but the newest ``keep_last`` (none for 0), except the newest
    calm one when every kept checkpoint was written during a loss spike (training/health.py), and with
    ``keep_best`` the one with the lowest validation loss."""
    if keep_last <= 0 or len(checkpoints) <= keep_last:
        return []
    stale = checkpoints[:-keep_last]
    if not any(is_calm(p) for p in checkpoints[-keep_last:]):
        calm = [p for p in stale if is_calm(p)]
        if calm:
            stale.remove(calm[-1])
    best = lowest_val_loss(checkpoints) if keep_best else None
    if best is not None and best[0] in stale:
        stale.remove(best[0])
    return stale


def _recorded(checkpoint: Path) -> dict:
    """A checkpoint's state.json as written, unchecked (empty when unreadable): for what pruning reads."""
    try:
        state = json.loads(read_bytes(checkpoint / STATE_FILE))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def val_loss_of(checkpoint: Path) -> float | None:
    """The validation loss a checkpoint's state.json records (None: not validated when written)."""
    value = _recorded(checkpoint).get("val_loss")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def lowest_val_loss(checkpoints: list[Path]) -> tuple[Path, float] | None:
    """The checkpoint with the lowest recorded validation loss and that loss (the earliest of equal ones; None if
    none records one)."""
    scored = [(p, loss) for p in checkpoints if (loss := val_loss_of(p)) is not None]
    return min(scored, key=lambda item: item[1]) if scored else None


def is_calm(checkpoint: Path) -> bool:
    """Whether a checkpoint was written outside a loss spike, as its state.json records (True for checkpoints
    written before the record existed, False for an unreadable state.json)."""
    state = _recorded(checkpoint)
    health = state.get("health", {})
    return bool(state) and isinstance(health, dict) and bool(health.get("calm", True))


def newest_calm(run_dir: str | Path) -> Path | None:
    """The newest checkpoint written outside a loss spike (None if there is none)."""
    return next((p for p in reversed(list_checkpoints(run_dir)) if is_calm(p)), None)


def clean_stale(run_dir: str | Path) -> list[str]:
    """Remove the temporary directories of checkpoint writes that were killed, and put back a checkpoint whose
    swap was interrupted. Call it only while no other process writes into the run (the run lock). Returns what was
    done, one line each."""
    root = Path(run_dir) / CKPT_DIR
    done: list[str] = []
    if not root.is_dir():
        return done
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or entry.is_symlink():  # the trainer writes folders only: a file is someone else's
            continue
        if entry.name.startswith(TMP):
            shutil.rmtree(entry)
            done.append(f"removed {entry} (an interrupted checkpoint write)")
        elif entry.name.startswith(OLD):
            final = root / entry.name[len(OLD) :].rsplit("-", 1)[0]
            if final.exists():
                shutil.rmtree(entry)
                done.append(f"removed {entry} (the replaced copy of {final.name})")
            else:
                entry.rename(final)
                done.append(f"restored {final} from {entry.name} (an interrupted swap)")
    return done


def refuse_foreign_checkpoints(run_dir: str | Path) -> None:
    """Refuse a run whose checkpoints folder holds a file (or a link) under a checkpoint's name: training writes
    checkpoints as folders and would stop at that step, so it is named before anything is trained."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if _STEP.fullmatch(entry.name) and (entry.is_symlink() or not entry.is_dir()):
            raise InputError(
                f"{entry} is not a checkpoint (a file or a link, where training writes a folder): move it out of "
                f"{root}, then run the command again"
            )


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path, extra: dict[str, str] | None = None) -> str:
    """Write ``tensors`` with their digest (and ``extra``) in the file's metadata; returns the digest."""
    metadata = {"format": "pt", "sha256": tensors_digest(tensors), **(extra or {})}
    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as err:  # an I/O failure inside safetensors: make it the OSError it is
        number = io_errno(err) or errno.EIO
        raise OSError(number, os.strerror(number), str(path)) from err
    return metadata["sha256"]


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the tensors' names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def _json_digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies in which tied weights (one storage under two names) are stored twice, as safetensors requires."""
    out, seen = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().contiguous().cpu()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        out[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return out


_STEP = re.compile(re.escape(PREFIX) + r"\d{8,}")  # the names the trainer writes, and nothing else


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first: the directories named as the trainer names them (``step_`` and the step;
    temporary directories of interrupted writes, and a user's ``step_00000010.keep``, are not checkpoints)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP.fullmatch(p.name))


def _load_tensors(file: Path, expected: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file, checked against the digest in its metadata and, when state.json records
    one (``expected``), against that: a file copied in from another checkpoint matches its own digest only."""
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint {file.parent} is incomplete: {file.name} is missing")
    check_header(file, use_earlier(file.parent))
    try:
        with safe_open(file, "pt") as f:
            metadata = f.metadata() or {}
            # copies: safetensors' tensors map the file, which would stay mapped (its disk space not freed once
            # keep-last deletes it) for as long as the optimizer holds them
            tensors = {name: f.get_tensor(name).clone() for name in f.keys()}
    except Exception as err:  # safetensors parses untrusted bytes: any failure means a damaged file
        raise InputError(f"{file} is corrupt or truncated ({err}); {use_earlier(file.parent)}") from None
    if "sha256" in metadata and metadata["sha256"] != tensors_digest(tensors):
        raise InputError(f"{file} does not match its checksum: the file is damaged; {use_earlier(file.parent)}")
    if expected is not None and metadata.get("sha256") != expected:
        raise InputError(
            f"{file} is not the file {file.parent / STATE_FILE} was written with (their digests differ): it was "
            f"replaced, e.g. by one from another checkpoint; {use_earlier(file.parent)}"
        )
    return tensors


def use_earlier(checkpoint: Path) -> str:
    """The advice after naming a damaged checkpoint: move it aside, so that the one before it is used."""
    aside = checkpoint.parent / f"damaged-{checkpoint.name}"
    return f"move the checkpoint away (mv {shell(checkpoint)} {shell(aside)}) to use the one before it"


def is_sharded(path: str | Path) -> bool:
    """Whether a checkpoint directory stores its tensors in pieces, one file per process (a sharded FSDP run)."""
    return bool(piece_files(Path(path), "model"))


def _verify(meta: dict) -> Callable[[Path], None]:
    """A check that a piece file matches its own digest and the one state.json recorded for it."""
    recorded = meta.get("files", {})

    def check(file: Path) -> None:
        if file.name not in recorded:
            raise InputError(f"{file} is not one of the files {file.parent / STATE_FILE} was written with; "
                             f"{use_earlier(file.parent)}")  # fmt: skip
        _load_tensors(file, recorded[file.name])

    return check


def pieces(path: str | Path, kind: str, meta: dict) -> PieceReader:
    """The tensors of ``kind`` (model or optimizer) of one checkpoint directory as pieces, read on demand, each file
    checked against its digests before its first read: a sharded checkpoint's process files, or the single file of
    one process's checkpoint (one whole piece per tensor)."""
    path = Path(path)
    files = piece_files(path, kind)
    if not files:
        single = path / (MODEL_FILE if kind == "model" else OPTIMIZER_FILE)
        if not single.is_file():
            raise FileNotFoundError(f"checkpoint {path} is incomplete: {single.name} is missing")
        files = [single]
    try:
        return PieceReader(files, _verify(meta))
    except InputError as err:
        raise InputError(f"{err}; {use_earlier(path)}") from None
    except Exception as err:  # safetensors parses untrusted bytes: any failure means a damaged file
        raise InputError(f"a {kind} file of {path} is corrupt or truncated ({err}); {use_earlier(path)}") from None


def _whole(path: Path, kind: str, meta: dict) -> dict[str, torch.Tensor]:
    """Every tensor of ``kind`` whole: a sharded checkpoint's pieces assembled, or the single file as it is."""
    if not piece_files(path, kind):
        name = MODEL_FILE if kind == "model" else OPTIMIZER_FILE
        return _load_tensors(path / name, meta.get("files", {}).get(name))
    return pieces(path, kind, meta).read_all()


def load_model(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(model weights, meta) of one checkpoint directory (a sharded one's pieces assembled); the meta is empty for a
    checkpoint without state.json."""
    path = Path(path)
    meta = read_state(path) if (path / STATE_FILE).is_file() else {}
    return _whole(path, "model", meta), meta


def load_model_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The model weights of one checkpoint directory."""
    return load_model(path)[0]


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(model tensors, optimizer state dict, meta) of one checkpoint directory (a sharded one's pieces assembled),
    with clear errors."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"checkpoint {path} is incomplete: {STATE_FILE} is missing")
    model, meta = load_model(path)
    try:
        optim = unflatten_optimizer(_whole(path, "optimizer", meta), meta.pop("optimizer"))
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        if isinstance(err, InputError):
            raise
        raise InputError(f"{path / STATE_FILE} holds no valid optimizer state ({err!r}); {use_earlier(path)}") from None
    return model, optim, meta


def read_state(path: Path) -> dict:
    """The state.json of one checkpoint directory, checked against its digest."""
    state = path / STATE_FILE
    try:
        meta = json.loads(read_bytes(state).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise InputError(f"{state} is corrupt ({err}); {use_earlier(path)}") from None
    if not isinstance(meta, dict) or any(key not in meta for key in STATE_KEYS):
        raise InputError(f"{state} is not a checkpoint's state (it lacks {', '.join(STATE_KEYS)}); {use_earlier(path)}")
    digest = meta.pop("sha256", None)
    if digest is None and "files" in meta:  # written with a digest (as every state with a files entry is) that is gone
        raise InputError(f"{state} has lost its checksum field: the file is damaged; {use_earlier(path)}")
    if digest is not None and (not isinstance(digest, str) or digest != _json_digest(meta)):
        raise InputError(f"{state} does not match its checksum: the file is damaged; {use_earlier(path)}")
    return check(meta, STATE_SCHEMA, str(state), use_earlier(path))
