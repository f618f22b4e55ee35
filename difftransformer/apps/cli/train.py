"""`difftx train`: flags, --config files, --print-config, resume, and what to do after a divergence."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from difftransformer.apps.cli.parsing import INPUT, command, config_flags
from difftransformer.fsutil import shell

if TYPE_CHECKING:
    from difftransformer.training.config import TrainConfig


def train_command(sub) -> None:
    from difftransformer.training.config import RESUMABLE, TrainConfig

    tr = command(
        sub,
        "train",
        _train,
        "train a model on prepared data (or resume a run)",
        "difftx train --data data/mine --preset tiny --out runs/diff-mine --max-steps 2000 --keep-best\n"
        "difftx train --resume runs/diff-mine --max-steps 4000\n"
        "difftx train --config configs/small.toml --lr 3e-3 --out runs/small",
    )
    tr.add_argument(
        "--resume",
        type=INPUT,
        metavar="RUN",
        help="continue the run in this directory from its last checkpoint; it may change "
        + ", ".join("--" + name.replace("_", "-") for name in RESUMABLE),
    )
    tr.add_argument(
        "--config",
        type=INPUT,
        metavar="FILE",
        help="settings from a TOML, YAML or JSON file (keys: these flags' names, a [model] table of ModelConfig "
        "overrides, betas; a run's train_config.json is one); flags given beside it override it",
    )
    tr.add_argument(
        "--print-config", action="store_true", help="print the effective settings as TOML (a --config file) and exit"
    )
    config_flags(tr, TrainConfig, skip=("betas",), defaults={"out": "runs/<attention>-<preset>"})
    tr.add_argument("--quiet", action="store_true", help="no live progress line (the summaries still print)")


def _train(args: argparse.Namespace) -> int:
    from difftransformer.core.config import ModelConfig
    from difftransformer.errors import ConfigError, Interrupted, TrainingDiverged
    from difftransformer.fsutil import parse_json_object
    from difftransformer.training.config import RESUMABLE, TrainConfig
    from difftransformer.training.config_file import file_error, read_config_file, to_toml
    from difftransformer.training.distributed import unwrap
    from difftransformer.training.loop import Trainer
    from difftransformer.training.step import precision

    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in ("out", "model", "betas")]
    given = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    from_file = read_config_file(args.config) if args.config else {}
    flag_model = parse_json_object(args.model, "--model") if args.model is not None else {}
    _drop_the_files_norm_rule(from_file, given.get("attention"), flag_model, args.config)
    if args.model is not None:  # the flag's keys override the file's model table, key by key
        given["model"] = {**from_file.get("model", {}), **flag_model}
    if args.out is not None:
        given["out"] = args.out
    try:
        cfg, resume = _train_config(args, {**from_file, **given}, flags=set(given))
        if not resume and cfg.preset is not None:  # the model's fields too, before any data is read
            ModelConfig.preset(cfg.preset, attention=cfg.attention, **cfg.model)
    except ConfigError as err:
        model_key = err.field in from_file.get("model", {}) and err.field not in flag_model
        if model_key or (err.field in from_file and err.field not in given):  # the file's value: its key, its file
            raise file_error(args.config, err) from None
        raise
    if args.print_config:
        print(to_toml(dataclasses.asdict(cfg) | ({} if cfg.data != _NO_DATA else {"data": None})), end="")
        return 0
    try:
        # the model config is read here first: its errors take the same path as the Trainer's below
        said = None if resume or cfg.init_from else _measure_collision(cfg)
        if said and os.environ.get("RANK", "0") == "0":
            print(said, flush=True)
        trainer = Trainer(cfg, resume=resume, quiet=args.quiet)
    except TrainingDiverged as err:  # the run's newest checkpoint is not healthy
        return _diverged(err, cfg, main=os.environ.get("RANK", "0") == "0")
    except ConfigError as err:  # a recipe's value no flag gave: name the file it came from, not a flag
        if err.field in given or err.field in RESUMABLE:  # (a resume's flag for the latter is the way to fix it)
            raise
        if err.field in from_file:
            raise file_error(args.config, err) from None
        if resume:
            raise file_error(Path(cfg.out) / "train_config.json", err) from None
        raise
    main = trainer.world.is_main
    try:
        if trainer.step_idx >= cfg.max_steps:
            if main:
                print(
                    f"difftx train: {cfg.out} is complete (step {trainer.step_idx} of {cfg.max_steps}); nothing to do. "
                    f"To train further, resume with --max-steps larger than {trainer.step_idx}"
                )
            return 0
        if main:
            n = unwrap(trainer.model).num_parameters()
            steps = cfg.max_steps - trainer.step_idx
            tokens, have = steps * cfg.batch_size * cfg.seq_len, trainer.train_data.n_tokens
            print(
                f"difftx train: {trainer.model_config.attention} model, {n:,} parameters "
                f"({f'{cfg.preset} preset' if cfg.preset else f'from {trainer.start}'}); "
                f"{'resuming at step ' + str(trainer.step_idx + 1) + ', ' if trainer.step_idx else ''}{steps:,} steps "
                f"of {cfg.batch_size} x {cfg.seq_len} tokens = {tokens:,} tokens ({tokens / have:.2f} passes over the "
                f"{have:,} training tokens of {cfg.data}) on {trainer.world.device}{_cpu_threads(trainer)}"
                f"{f' ({trainer.world.size} processes)' if trainer.world.size > 1 else ''} in "
                f"{precision(trainer.amp, trainer.tf32, cfg.parallel)}; writing to {cfg.out}",
                flush=True,
            )
        rows = trainer.fit()
    except Interrupted as err:
        if not main:  # the main process says it, once
            return 128 + err.signum
        err.args = (f"{err}. Resume with: difftx train --resume {shell(cfg.out)}",)
        raise
    except TrainingDiverged as err:
        return _diverged(err, cfg, main)
    finally:
        trainer.close()
    if main:
        _summary(trainer, rows)
    return 0


def _cpu_threads(trainer) -> str:
    """', 2 threads (OpenMP waits passively; ...)' on the CPU; '' on a GPU."""
    import torch

    from difftransformer.threads import describe

    return f", {describe(torch.get_num_threads())}" if trainer.world.device.type == "cpu" else ""


def _summary(trainer, rows: list[dict]) -> None:
    """The end of a run: its last losses and checkpoint, the checkpoint keep_best kept (or a note when validation
    loss has risen from its lowest without it), and what to do next."""
    from difftransformer.store.checkpoint import list_checkpoints

    cfg = trainer.cfg
    last = next((r for r in reversed(rows) if "val_loss" in r), {})
    train_loss = rows[-1]["loss"] if rows else float("nan")
    newest = list_checkpoints(trainer.run_dir)[-1]
    print(
        f"difftx train: done: {cfg.out} at step {trainer.step_idx}; training loss {train_loss:.4f}, validation "
        f"loss {last.get('val_loss', float('nan')):.4f} nats per token ({last.get('val_bpb', float('nan')):.3f} "
        f"bits per byte); checkpoint {newest}"
    )
    best = trainer.best_checkpoint() if cfg.keep_best else None
    sample = cfg.out
    if best is not None and best[0] != newest:
        sample = best[0]
        print(f"difftx train: lowest validation loss {best[1]:.4f} at {best[0].name}, kept by --keep-best: {best[0]}")
    elif best is None:
        validated = [(r["val_loss"], r["step"]) for r in trainer.metric_rows() if "val_loss" in r]
        lowest, at = min(validated, default=(None, None))
        if lowest is not None and at < validated[-1][1] and validated[-1][0] > lowest * 1.01:
            print(
                f"note: the validation loss was lowest at step {at} ({lowest:.4f}) and is {validated[-1][0]:.4f} now "
                "(overfitting, when a run passes over its data many times); --keep-best keeps the checkpoint with "
                "the lowest validation loss",
                file=sys.stderr,
            )
    print(
        f"next: difftx generate --run {shell(sample)} --prompt 'Your text' (to train further: difftx train --resume "
        f"{shell(cfg.out)} --max-steps N)"
    )


COLLISION_WINDOWS = 64  # windows of the model's context the matched gain's token statistic is measured on, at most


def _measure_collision(cfg: TrainConfig) -> str | None:
    """With the per-head norm's matched gain and no ``head_norm_collision`` given, the rule's one input measured on
    the training data: ``token_collision`` over up to COLLISION_WINDOWS evenly spaced windows of the model's context
    (the library's default, Zipf's law, is a guess that can be 2 times off). Set into ``cfg.model``, so the run's
    model_config.json records it and a resume, an export or a load rebuilds the same gains. Returns the line that
    says so; None when there is nothing to measure."""
    from difftransformer.core.head_norm_gain import token_collision, zipf_collision
    from difftransformer.store.data import TokenData, eval_windows

    data = TokenData(cfg.data, "train")
    model = cfg.model_config(data.manifest["tokenizer"]["vocab_size"])
    if model.head_norm_gain != "matched" or model.head_norm_collision is not None:
        return None
    length = min(model.max_seq_len, data.n_tokens - 1)
    windows = eval_windows(data, length - 1, COLLISION_WINDOWS * (length - 1))
    collision = token_collision(windows)
    cfg.model = {**cfg.model, "head_norm_collision": collision}
    return (
        f"difftx train: the matched gain's token statistic (head_norm_collision) is {collision:.4f}, measured on "
        f"{len(windows)} windows of {length} tokens of {cfg.data}'s training split (Zipf's law would give "
        f"{zipf_collision(model.vocab_size):.4f}); the run records it"
    )


_NO_DATA = "<no data>"  # --print-config without a data directory: the printed config says it is required


NORM_RULE = ("head_norm_gain", "head_norm_gain_fixed", "head_norm_collision")  # the per-head norm's initial weight


def _drop_the_files_norm_rule(from_file: dict, attention: str | None, flag_model: dict, path) -> None:
    """A config file's per-head norm rule ([model] head_norm_gain and its companions) left out, with a note, when
    the --attention flag picks a model without that norm (the file's example, ``--attention standard`` for the
    baseline, otherwise failed on a key the user never gave)."""
    model = {**from_file.get("model", {}), **flag_model}
    if attention is None or (attention == "diff" and model.get("head_norm") is not False):
        return
    if attention == "standard" and model.get("head_norm") is True:
        return
    dropped = [key for key in NORM_RULE if key in from_file.get("model", {}) and key not in flag_model]
    if not dropped:
        return
    for key in dropped:
        del from_file["model"][key]
    keep = "; --model '{\"head_norm\": true}' gives the standard model one" if attention == "standard" else ""
    print(
        f"difftx train: note: --attention {attention} has no per-head norm, so {path}'s [model] {', '.join(dropped)} "
        f"(the norm's starting weight) is left out{keep}",
        file=sys.stderr,
    )


def _train_config(args: argparse.Namespace, settings: dict, flags: set[str]):
    """The run's TrainConfig from the settings (the config file's, then the flags', whose names are ``flags``) and
    whether it resumes."""
    from difftransformer.errors import InputError
    from difftransformer.training.config import TrainConfig
    from difftransformer.training.loop import resume_config

    out = settings.pop("out", None)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    default_out = out or f"runs/{settings.get('attention', 'diff')}-{settings.get('preset', 'tiny')}"
    if not args.resume and restarts and (Path(default_out) / "train_config.json").is_file():
        args.resume = out = default_out  # torchrun restarted the group after a failure: the run goes on
        if os.environ.get("RANK", "0") == "0":
            print(f"difftx train: torchrun restart {restarts}: resuming {out}", file=sys.stderr, flush=True)
    if args.resume:
        return resume_config(args.resume, out=out, **settings), True
    # A model from init_from: a flag that sets it is refused, and a file's preset or model (a run started so records
    # neither; the trainer checks a file's attention against the model's)
    clash = [f"`{n}`" for n in ("preset", "attention", "model") if n in flags]
    clash = clash or [f"{args.config}: {n}" for n in ("preset", "model") if settings.get(n)]
    if settings.get("init_from") and clash:
        with_ = "`init_from`" if clash[0].startswith("`") else "init_from"  # a flag's name, or the file's key
        raise InputError(
            f"{clash[0]} cannot be given with {with_}: the model (its config and weights) comes from "
            f"{settings['init_from']}; drop it"
        )
    if settings.get("init_from") and "attention" not in settings:  # the model's own, not the default's
        settings["attention"] = _attention_of(settings["init_from"])
    if not settings.get("data"):
        if not args.print_config:
            raise InputError("difftx train needs --data (a directory made by 'difftx data prepare') or --resume RUN")
        settings["data"] = _NO_DATA
    return TrainConfig(**settings, out=default_out), False


def _attention_of(init_from: str) -> str:
    """The attention kind of the run (or checkpoint) a run starts from, as its model_config.json records it ('diff' when
    it cannot be read: the trainer then names what is wrong with init_from)."""
    from difftransformer.core.config import ModelConfig
    from difftransformer.store.runs import MODEL_CONFIG, run_and_checkpoint

    try:
        return ModelConfig.from_json(run_and_checkpoint(init_from)[0] / MODEL_CONFIG).attention
    except (OSError, ValueError):
        return "diff"


def _diverged(err, cfg: TrainConfig, main: bool) -> int:
    """A diverged run, said once (every process stops on it; the main one says it): the error, re-raised with the
    command that starts again appended when it suggests a learning rate."""
    if not main:
        return 3
    if err.lr is not None:
        err.args = (f"{err}: {_restart_command(cfg, err)}",)
    raise err


def _restart_command(cfg: TrainConfig, err) -> str:
    """The `difftx train` command that starts again after a divergence: from the checkpoint the error names (or from
    scratch) with its lower learning rate and the rest of the run's recipe."""
    import shlex

    from difftransformer.training.config import TrainConfig

    fresh = err.init_from is None
    out = cfg.out if fresh and not Path(cfg.out).exists() else f"{cfg.out}-lr{err.lr:g}"
    line = ["difftx", "train", "--data", cfg.data]
    line += ["--out", out, "--lr", f"{err.lr:g}"] + ([] if fresh else ["--init-from", str(err.init_from)])
    skip = {"data", "out", "lr", "init_from", "betas"} | (set() if fresh else {"preset", "attention", "model"})
    defaults = TrainConfig(data=cfg.data, out=cfg.out)
    derived_warmup = TrainConfig(data=cfg.data, out=cfg.out, max_steps=cfg.max_steps).warmup_steps
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        default = derived_warmup if f.name == "warmup_steps" else getattr(defaults, f.name)
        if f.name in skip or value == default or value is None or value is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        line += [flag] if value is True else [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return shlex.join(line)
