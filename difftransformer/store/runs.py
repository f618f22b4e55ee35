"""Run directories: their layout, a lock against two trainers in one run, and loading a trained model.

A run directory is self-contained and can be copied or moved: it holds the model config, the training config
(with the data directory as an absolute path, checked at resume), the tokenizer, the metrics and the
checkpoints. Nothing in it names the directory itself, so a copy resumes into the copy.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

import torch

from difftransformer.core.attention.gqa_layout import own_layout
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.core.quantized import SCHEMES, quantized_shell
from difftransformer.errors import InputError
from difftransformer.fsutil import read_json_object, read_text, write_new_dir
from difftransformer.schema import NUMBER, check
from difftransformer.store.checkpoint import (
    CKPT_DIR,
    MODEL_FILE,
    PREFIX,
    is_sharded,
    list_checkpoints,
    load_model,
    save_checkpoint,
)
from difftransformer.store.data import TokenData, eval_windows
from difftransformer.store.tokenizer import Tokenizer, load_tokenizer, refuse_replaced

MODEL_CONFIG = "model_config.json"
TRAIN_CONFIG = "train_config.json"
METRICS = "metrics.jsonl"
LOCK = ".lock"
QUANTIZATION = "quantization.json"

# a row of metrics.jsonl (schema.py's notation): what the trainer logs at a step
METRIC_ROW = {
    "step": int,
    "loss": NUMBER,
    "lr": NUMBER,
    "grad_norm": NUMBER,
    "tokens": int,
    "tokens_per_s": NUMBER,
    "lambda?": [NUMBER],
    "val_loss?": NUMBER,
    "val_bpb?": NUMBER,
    "skipped?": str,
    "spike?": bool,
}
METRICS_LIMIT = 1 << 30  # 1 GiB: millions of rows
QUANTIZATION_SCHEMA = {
    "scheme": str,
    "weight_bits": int,
    "source": str,
    "source_step": int,
    "layers": [str],
    "calibrator?": str,
    "calibration_data?": str,
    "calibration_split?": str,
    "calibration_windows?": int,
    "calibration_tokens?": int,
}


class RunLock:
    """An exclusive lock on a run directory while a trainer writes into it (released when the process ends). The
    lock file is opened without following a link: a run copied from elsewhere whose lock points at another file
    (a shell's start-up file) cannot make training truncate that file."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK
        self._file = _open_lock(self.path, create=True)
        holder = _take(self._file)
        if holder is not None:
            self._file.close()
            raise InputError(being_written(run_dir, holder))
        self._file.seek(0)
        self._file.truncate()
        self._file.write(str(os.getpid()))
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


def writer_of(run_dir: Path) -> str | None:
    """The pid a run's lock names while another process holds it (a trainer writing the run), else None."""
    if not run_dir.is_dir():
        return None
    lock = _open_lock(run_dir / LOCK, create=False)
    if lock is None:
        return None
    with lock:
        holder = _take(lock)
        if holder is None:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return holder


def being_written(run_dir: Path, pid: str) -> str:
    return f"run {run_dir} is being written by another process (pid {pid}); wait for it to finish or stop it"


def read_metrics(run_dir: Path) -> tuple[list[dict], list[int]]:
    """(the rows of a run's metrics.jsonl, each checked against METRIC_ROW; the numbers of the lines that are not
    JSON objects: a row being written when its process was killed). A row that is JSON but breaks the schema (a file
    edited by hand) is an InputError naming the line and the field. No file: no rows."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return [], []
    rows, torn = [], []
    for number, line in enumerate(read_text(path, METRICS_LIMIT).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            row = None
        if not isinstance(row, dict):
            torn.append(number)
            continue
        rows.append(check(row, METRIC_ROW, f"{path}:{number}", "correct the line or delete it"))
    return rows, torn


def last_logged_step(run_dir: Path) -> int:
    """The step of the last complete row of a run's metrics.jsonl, 0 before the first: for a watcher of a running run
    (the text after the last newline may be a row still being written; ``read_metrics`` sets it aside)."""
    rows, _ = read_metrics(run_dir)
    return max((row["step"] for row in rows if "step" in row), default=0)


def _open_lock(path: Path, create: bool):
    """A run's lock file, opened without following a link and only if it is a regular file (None when it is not there
    and ``create`` is false)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise InputError(_link_message(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{path} is not a regular file: remove it (it is the run's lock, made again)")
    return os.fdopen(fd, "r+")


def _take(lock) -> str | None:
    """Lock ``lock`` exclusively without waiting: None when this process holds it now, else the pid its holder wrote."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        return lock.read().strip() or "unknown"
    return None


def refuse_links(run_dir: Path) -> None:
    """Refuse a run directory that a command is about to write into when one of its entries, or of its checkpoints
    folder, is a symbolic link: such a command writes and deletes only inside the run directory and never follows a
    link there."""
    entries = list(run_dir.iterdir()) if run_dir.is_dir() else []
    checkpoints = run_dir / CKPT_DIR
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        entries += list(checkpoints.iterdir())
    for entry in sorted(entries):
        if entry.is_symlink():
            raise InputError(_link_message(entry))


def _link_message(entry: Path) -> str:
    return (
        f"{entry} is a symbolic link (to {os.readlink(entry)}): training writes only inside its run directory and "
        "never follows a link there, so that a run from elsewhere cannot make it write or delete outside; replace "
        "the link by a copy of what it points to, or remove it"
    )


def is_unstarted_run(path: Path) -> bool:
    """A run directory that a trainer created but that holds no checkpoint yet (it stopped before its first)."""
    return (path / TRAIN_CONFIG).is_file() and not list_checkpoints(path)


def names_checkpoint(path: Path) -> bool:
    """Whether ``path`` names one checkpoint of a run (``RUN/checkpoints/step_N``) rather than a run."""
    return path.parent.name == CKPT_DIR and path.name.startswith(PREFIX)


def run_and_checkpoint(path: str | Path) -> tuple[Path, Path | None]:
    """(run directory, the checkpoint ``path`` names or None): a command given a run reads its newest checkpoint,
    one given ``RUN/checkpoints/step_N`` that one."""
    path = Path(path)
    if names_checkpoint(path) and path.is_dir():
        return path.parent.parent, path
    return path, None


def start_checkpoint(init_from: str | Path) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) that ``init_from`` names: a run (its newest checkpoint) or one of its
    checkpoints (``RUN/checkpoints/step_N``)."""
    path = Path(init_from)
    if names_checkpoint(path):
        if not (path / MODEL_FILE).is_file() and not is_sharded(path):
            raise FileNotFoundError(f"checkpoint {path} (init_from) does not exist or has no {MODEL_FILE}")
        return path.parent.parent, path
    if not path.is_dir():
        raise FileNotFoundError(f"`init_from` {path} is not a run directory (it does not exist or is a file)")
    checkpoints = list_checkpoints(path)
    if not checkpoints:
        raise FileNotFoundError(f"`init_from` {path} has no checkpoint to start from")
    return path, checkpoints[-1]


def refuse_changed(file: Path, what: str, now: dict, recorded: dict, skip: Iterable[str] = ()) -> None:
    """Refuse a config ``file`` whose values ``now`` differ from those a checkpoint's state.json ``recorded`` (the
    keys in ``skip`` aside), naming the first field that differs: ``file`` is not ``what`` (e.g. "the config
    step_00000010 was written with")."""
    now = json.loads(json.dumps(now))  # as JSON holds it: tuples are lists
    changed = sorted(k for k in recorded if k not in skip and now.get(k) != recorded[k])
    if changed:
        k = changed[0]
        raise InputError(
            f"{file} is not {what} ({k} is {now.get(k)!r}; its state.json says {recorded[k]!r}): the file was replaced "
            "or edited; put the original back"
        )


def check_recorded(checkpoint: Path, meta: dict, config: ModelConfig, tokenizer: Tokenizer) -> None:
    """The run's model_config.json and tokenizer are the ones ``checkpoint`` was written with, as its state.json
    (``meta``) records them: a file replaced by another run's of the same shape would compute another function
    without a word. Checkpoints written before the records existed are not checked."""
    run = checkpoint.parent.parent
    recorded = meta.get("model_config")
    if isinstance(recorded, dict):
        refuse_changed(run / MODEL_CONFIG, f"the config {checkpoint.name} was written with", config.to_dict(), recorded)
    refuse_replaced(
        tokenizer, meta.get("tokenizer"), f"the tokenizer in {run}", checkpoint.name, "the run's data directory"
    )


def check_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: str, config: str) -> None:
    """Refuse weights whose names, shapes or dtypes differ from the model's, naming the first difference (a tensor of
    another dtype would be cast, or truncated, without a word)."""
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    for name, (shape, dtype) in expected.items():
        if name not in tensors:
            raise InputError(f"{source} does not match {config}: it has no {name}")
        if tuple(tensors[name].shape) != shape:
            raise InputError(
                f"{source} does not match {config}: {name} has shape {tuple(tensors[name].shape)}, the config needs "
                f"{shape}"
            )
        if tensors[name].dtype != dtype:
            raise InputError(
                f"{source} does not match {config}: {name} is stored as {tensors[name].dtype}, the model holds "
                f"{dtype} (the file was written by another tool or edited)"
            )
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise InputError(f"{source} does not match {config}: unexpected {extra[0]}")


def check_optimizer_state(model: torch.nn.Module, optim_state: dict, source: str, groups: int) -> None:
    """Refuse an optimizer state of another number of parameter groups than the run's optimizer has (``groups``), or
    with tensors (AdamW's moments and step, keyed by parameter name) whose parameter, shape or dtype is not the
    model's: a moment cast or broadcast without a word would change every later step."""
    if len(optim_state["param_groups"]) != groups:
        raise InputError(
            f"{source} holds {len(optim_state['param_groups'])} parameter groups, the run's optimizer has {groups}: "
            "it was written by another tool or edited"
        )
    params = dict(model.named_parameters())
    for name, state in optim_state["state"].items():
        if name not in params:
            raise InputError(f"{source} holds optimizer state for {name}, which is not a parameter of the model")
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            shape, dtype = ((), torch.float32) if key == "step" else (tuple(params[name].shape), params[name].dtype)
            if tuple(value.shape) != shape or value.dtype != dtype:
                raise InputError(
                    f"{source} does not match the model: the optimizer's {name}/{key} is {value.dtype} of shape "
                    f"{tuple(value.shape)}, the model needs {dtype} of shape {shape}"
                )


def save_run(model: TransformerLM, tokenizer: Tokenizer, out_dir: str | Path, meta: dict, step: int = 0) -> Path:
    """A new run directory holding ``model`` (a checkpoint of ``step``, no optimizer state) and ``tokenizer``: what
    the converters write; ``load_run`` reads it and ``difftx train --init-from`` trains it.

    Args:
        model: the model.
        tokenizer: its tokenizer.
        out_dir: the new directory.
        meta: what else the checkpoint's state.json records (e.g. where the weights came from).
        step: the checkpoint's step.

    Returns:
        ``out_dir``.

    Examples:
        >>> import tempfile
        >>> from difftransformer import ModelConfig, TransformerLM
        >>> from difftransformer.store.tokenizer import ByteTokenizer
        >>> out = f"{tempfile.mkdtemp()}/run"
        >>> run = save_run(TransformerLM(ModelConfig.preset("tiny", vocab_size=257)), ByteTokenizer(), out, {})
        >>> model, tokenizer = load_run(run)
        >>> model.config.vocab_size, tokenizer.vocab_size
        (257, 257)
    """

    def write(tmp: Path) -> None:
        model.config.to_json(tmp / MODEL_CONFIG)
        tokenizer.save(tmp)
        meta_all = {**meta, "model_config": model.config.to_dict(), "tokenizer": tokenizer.fingerprint()}
        save_checkpoint(tmp, step, model.state_dict(), {"state": {}, "param_groups": []}, meta_all, keep_last=1)

    write_new_dir(out_dir, "output directory", write)
    return Path(out_dir)


def load_run(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[TransformerLM, Tokenizer]:
    """The model and tokenizer of a run directory (trained, converted or quantized), to sample from or evaluate.

    Args:
        run_dir: a run directory (its newest checkpoint's weights) or one checkpoint of a run
            (``RUN/checkpoints/step_N``).
        device: where the model's weights go.

    Returns:
        (model in eval mode, tokenizer). A quantized run's model has QuantizedLinear layers.

    Raises:
        FileNotFoundError: the directory, its model_config.json or its checkpoints are missing.
        InputError: a damaged checkpoint, or weights that are not finite (a run that diverged).

    Examples:
        >>> from difftransformer.store.examples import example_run
        >>> run = example_run()  # an untrained tiny DIFF model's run, in a new temporary directory
        >>> model, tokenizer = load_run(run)
        >>> tokenizer.decode(tokenizer.encode("To be"))
        'To be'
    """
    run, checkpoint = run_and_checkpoint(run_dir)
    if run.exists() and not run.is_dir():
        raise InputError(f"{run} is a file, not a run directory")
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist")
    if not (run / MODEL_CONFIG).is_file():
        raise FileNotFoundError(f"{run} is not a run directory: {MODEL_CONFIG} is missing")
    config = ModelConfig.from_json(run / MODEL_CONFIG)
    checkpoints = list_checkpoints(run)
    if not checkpoints:
        raise FileNotFoundError(f"{run} has no checkpoint (checkpoints/step_*/model.safetensors)")
    checkpoint = checkpoint or checkpoints[-1]
    tensors, meta = load_model(checkpoint)
    tokenizer = load_tokenizer(run)
    check_recorded(checkpoint, meta, config, tokenizer)
    _refuse_nonfinite(tensors, checkpoint, checkpoints)
    quantization = read_quantization(run)
    with torch.device("meta"):
        model = TransformerLM(config)
        if quantization is not None:  # integer weights (difftx quantize), dequantized on first use
            quantized_shell(model, quantization["scheme"])
    check_weights(model, tensors, str(weights_of(checkpoint)), str(run / MODEL_CONFIG))
    with own_layout():
        model.load_state_dict(tensors, strict=True, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.to(device).eval(), tokenizer


def weights_of(checkpoint: Path) -> Path:
    """Where a checkpoint's weights lie, to name in a message: its model.safetensors, or itself when sharded."""
    return checkpoint if is_sharded(checkpoint) else checkpoint / MODEL_FILE


def _refuse_nonfinite(tensors: dict[str, torch.Tensor], checkpoint: Path, checkpoints: list[Path]) -> None:
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            earlier = [p for p in checkpoints if p.name < checkpoint.name]
            raise InputError(
                f"{weights_of(checkpoint)} holds weights that are not finite ({name} has NaN or infinity): "
                "the run had diverged when it was written. "
                + (f"Use an earlier checkpoint: `run` {earlier[-1]}" if earlier else "It has no earlier checkpoint")
            )


def run_windows(
    run: str | Path,
    tokenizer: Tokenizer,
    split: str,
    tokens: int | None = None,
    windows: int | None = None,
    data: str | Path | None = None,
) -> tuple[torch.Tensor, Path]:
    """(evenly spaced windows of the run's training length + 1 from ``split`` of its data, about ``tokens`` tokens
    or ``windows`` windows; the data directory): the data the run was trained on, or ``data``, which must use the
    run's tokenizer."""
    run = Path(run)
    train_config = read_json_object(run / TRAIN_CONFIG) if (run / TRAIN_CONFIG).is_file() else {}
    source = data if data is not None else train_config.get("data")
    if source is None:
        raise InputError(f"{run} does not say which data it was trained on (no {TRAIN_CONFIG}): name its data")
    data_dir = Path(source)
    if not data_dir.is_dir():
        raise FileNotFoundError(
            f"the data directory {data_dir} of {run} does not exist (moved or removed): name the data directory "
            "prepared with the run's tokenizer"
        )
    token_data = TokenData(data_dir, split)
    expected = token_data.manifest["tokenizer"]["fingerprint"]
    if tokenizer.fingerprint() != expected:
        raise InputError(
            f"{data_dir} was tokenised with {expected}, but {run} uses {tokenizer.fingerprint()}: name data prepared "
            "with the run's tokenizer"
        )
    seq_len = int(train_config.get("seq_len") or 256)
    return eval_windows(token_data, seq_len, tokens if tokens is not None else windows * seq_len), data_dir


def read_quantization(run: Path) -> dict | None:
    """A quantized run's quantization.json (checked), or None for a float run."""
    path = run / QUANTIZATION
    if not path.is_file():
        return None
    spec = check(read_json_object(path), QUANTIZATION_SCHEMA, str(path), "quantize its float run again")
    if spec["scheme"] not in SCHEMES:
        raise InputError(f"{path} names an unknown scheme {spec['scheme']!r}; it must be one of {list(SCHEMES)}")
    return spec


def refuse_quantized(run: Path, action: str) -> None:
    """A clear error when ``run`` is a quantized run and ``action`` needs float weights."""
    spec = read_quantization(run) if run.is_dir() else None
    if spec is not None:
        raise InputError(
            f"{run} is a quantized run ({spec['scheme']}), which cannot {action}; use its float source {spec['source']}"
        )
