"""TrainConfig: one training run's settings, every field range-checked once, and what a resume may change."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from difftransformer.core.config import ATTENTION_KINDS, PRESETS, ModelConfig
from difftransformer.devices import device_problem
from difftransformer.errors import ConfigError, Fields, InputError
from difftransformer.fsutil import parse_json_object, read_text
from difftransformer.training.distributed import PARALLEL_MODES
from difftransformer.training.tracking import parse_sinks

OVERFIT_PASSES = 4  # passes over the training tokens past which a run is told it may overfit
# What a resume may change: the length of the run, where its data lies, and how it runs (none of these changes the
# optimisation up to the step it stopped at). Everything else is part of the run's recipe.
RESUMABLE = (
    "max_steps",
    "data",
    "device",
    "threads",
    "parallel",
    "grad_accum",
    "compile",
    "checkpoint_activations",
    "deterministic",
    "eval_interval",
    "log_interval",
    "log_to",
    "ckpt_interval",
    "keep_last",
    "keep_best",
    "max_nonfinite_steps",
    "collective_timeout",
)


def _help(
    text: str, default: str | None = None, choices: tuple[str, ...] | None = None, path: str | None = None
) -> dict:
    """A field's description for the CLI, which builds `difftx train`'s flags from the fields: the help text, the
    default as it should read when the field's own default is None (computed later), the allowed values, and for a
    path whether it is read (``input``) or written (``output``): the CLI's path rule (difftransformer/paths.py)."""
    return {"help": text, "default": default, "choices": choices, "path": path}


@dataclass
class TrainConfig:
    """One training run: every flag of ``difftx train`` is one of its fields, with the same name. The defaults follow
    the paper (AdamW (0.9, 0.98), lr 1.5e-3, wd 0.05, 375 warmup steps) scaled to short runs: warmup is capped at a
    tenth of the steps. Every field is checked when the config is made; `difftx train --help` describes each.

    Examples:
        >>> cfg = TrainConfig(data="data/mine", out="runs/mine", max_steps=1000, model={"n_layers": 4})
        >>> cfg.warmup_steps, cfg.lr, cfg.keep_best
        (100, 0.0015, False)
        >>> TrainConfig(data="data/mine", out="runs/mine", lr=2.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        difftransformer.errors.ConfigError: TrainConfig.lr must be a finite number in (0, 1] (the peak learning ...
    """

    data: str = field(
        metadata=_help(
            "a directory made by `difftx data prepare`; when resuming, where the run's data lies now", path="input"
        )
    )
    out: str = field(
        metadata=_help("the run directory (not saved in it: a run directory is wherever it is)", path="output")
    )
    preset: str | None = field(
        default="tiny",
        metadata=_help("model preset (see `difftx presets`)", choices=tuple(PRESETS)),
    )
    attention: str = field(default="diff", metadata=_help("the attention kind", choices=ATTENTION_KINDS))
    model: dict[str, Any] = field(default_factory=dict, metadata=_help('ModelConfig overrides, e.g. {"n_layers": 4}'))
    init_from: str | None = field(
        default=None,
        metadata=_help(
            "a run whose newest weights (and model config) start this run, e.g. a converted model", path="input"
        ),
    )
    seq_len: int | None = field(
        default=None, metadata=_help("tokens per training window", default="min(max_seq_len, 256)")
    )
    batch_size: int = field(default=16, metadata=_help("sequences per optimizer step, all processes together"))
    grad_accum: int = field(default=1, metadata=_help("micro-steps per optimizer step; divides `batch_size`"))
    max_steps: int = field(
        default=2000, metadata=_help("optimizer steps of the run; when resuming, a larger value trains further")
    )
    lr: float = field(default=1.5e-3, metadata=_help("peak learning rate, in (0, 1]"))
    min_lr_ratio: float = field(
        default=0.1, metadata=_help("the cosine schedule's final learning rate, as a fraction of lr")
    )
    warmup_steps: int | None = field(
        default=None, metadata=_help("linear warmup steps", default="min(375, max_steps / 10)")
    )
    betas: tuple[float, float] = field(default=(0.9, 0.98), metadata=_help("AdamW betas"))
    weight_decay: float = field(default=0.05, metadata=_help("AdamW weight decay, in [0, 1]"))
    grad_clip: float = field(default=1.0, metadata=_help("largest gradient norm kept, > 0"))
    eval_interval: int = field(default=200, metadata=_help("steps between validations"))
    eval_tokens: int = field(default=1 << 16, metadata=_help("validation tokens per evaluation"))
    log_interval: int = field(default=10, metadata=_help("steps between rows of metrics.jsonl"))
    log_to: str = field(
        default="jsonl",
        metadata=_help(
            "where the metrics go, comma-separated: jsonl (RUN/metrics.jsonl, always written), tensorboard "
            "(RUN/tensorboard), wandb (RUN/wandb, offline unless WANDB_MODE is set); tensorboard and wandb need the "
            "[track] extra"
        ),
    )
    ckpt_interval: int = field(default=500, metadata=_help("steps between checkpoints"))
    keep_last: int = field(default=3, metadata=_help("checkpoints kept, 0 for all"))
    keep_best: bool = field(
        default=False,
        metadata=_help(
            "validate at every checkpoint and keep the one with the lowest validation loss besides the newest "
            "`keep_last` (the end summary names it)"
        ),
    )
    seed: int = field(default=0, metadata=_help("seed of the initialisation and the data order"))
    device: str = field(default="auto", metadata=_help("auto, cpu, cuda, cuda:N or mps"))
    dtype: str = field(
        default="auto",
        metadata=_help(
            "auto: bfloat16 autocast on GPUs that support it, else float32", choices=("auto", "float32", "bfloat16")
        ),
    )
    compile: bool = field(default=False, metadata=_help("torch.compile each block"))
    checkpoint_activations: bool = field(
        default=False, metadata=_help("recompute each block in backward instead of keeping its activations")
    )
    deterministic: bool = field(
        default=False,
        metadata=_help(
            "deterministic algorithms only (torch.use_deterministic_algorithms): on a GPU a resumed run then repeats "
            "an uninterrupted one bit for bit, at some cost in speed; an operation without such an algorithm stops "
            "the run with an error naming it"
        ),
    )
    parallel: str = field(default="none", metadata=_help("data parallelism, under torchrun", choices=PARALLEL_MODES))
    threads: int | None = field(default=None, metadata=_help("CPU threads", default="torch's"))
    max_nonfinite_steps: int = field(
        default=5,
        metadata=_help("steps in a row with a NaN/Inf loss or gradient that are skipped before the run stops"),
    )
    collective_timeout: int = field(
        default=600,
        metadata=_help(
            "seconds a process waits for the others in a collective before the run fails (a process that hangs); more "
            "than the slowest checkpoint write"
        ),
    )

    def __post_init__(self) -> None:
        if isinstance(self.betas, list):
            self.betas = tuple(self.betas)
        check = Fields(self)
        check.integer("max_steps", 1, 1 << 40)
        if self.warmup_steps is None:
            self.warmup_steps = min(375, self.max_steps // 10)
        check.text("data")
        check.text("out")
        check.text("init_from", optional=True)
        check.choice("preset", (*PRESETS, None) if self.init_from else PRESETS)
        check.choice("attention", ATTENTION_KINDS)
        self._check_model_overrides(check)
        check.integer("seq_len", 1, 1 << 22, optional=True)
        check.integer("batch_size", 1, 1 << 20)
        check.integer("grad_accum", 1, self.batch_size)
        if self.batch_size % self.grad_accum:
            check.fail("batch_size", f"{self.batch_size} is not divisible by `grad_accum` {self.grad_accum}")
        check.number("lr", 0, 1, low_open=True, hint=" (the peak learning rate; the paper uses 1.5e-3)")
        check.number("min_lr_ratio", 0, 1)
        check.integer("warmup_steps", 0, self.max_steps)
        if not (isinstance(self.betas, tuple) and len(self.betas) == 2):
            check.fail("betas", f"must be two numbers in [0, 1), got {self.betas!r}")
        for i, beta in enumerate(self.betas):
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
                check.fail("betas", f"must be two numbers in [0, 1); entry {i} is {beta!r}")
        check.number("weight_decay", 0, 1)
        check.number(
            "grad_clip", 0, low_open=True, hint=" (the largest gradient norm kept; 1.0 by default, 1e9 for no clipping)"
        )
        for name in ("eval_interval", "log_interval", "ckpt_interval"):
            check.integer(name, 1, 1 << 40)
        if isinstance(self.log_to, (list, tuple)) and all(isinstance(name, str) for name in self.log_to):
            self.log_to = ",".join(self.log_to)  # a list in a config file
        sinks = parse_sinks(self.log_to)
        if isinstance(sinks, str):
            check.fail("log_to", sinks)
        self.log_to = ",".join(sinks)
        check.integer("eval_tokens", 1, 1 << 40)
        check.integer("keep_last", 0, 1 << 20)
        check.boolean("keep_best")
        check.integer("seed", 0, (1 << 63) - 1)
        if (problem := device_problem(self.device)) is not None:
            check.fail("device", problem)
        check.choice("dtype", ("auto", "float32", "bfloat16"))
        check.boolean("compile")
        check.boolean("checkpoint_activations")
        check.boolean("deterministic")
        check.choice("parallel", PARALLEL_MODES)
        check.integer("threads", 1, 1024, optional=True)
        check.integer("max_nonfinite_steps", 1, 1 << 20)
        check.integer("collective_timeout", 1, 7 * 24 * 3600)

    def _check_model_overrides(self, check: Fields) -> None:
        if not isinstance(self.model, dict):
            check.fail("model", f"must be a JSON object of ModelConfig fields, got {self.model!r}")
        known = [f.name for f in dataclasses.fields(ModelConfig)]
        for name in self.model:
            if name == "attention":
                check.fail("model", "must not set attention; use `attention`")
            if name not in known:
                check.fail("model", f"has {name!r}, which is not a ModelConfig field; known: {', '.join(known)}")

    def model_config(self, vocab_size: int) -> ModelConfig:
        overrides = dict(self.model)
        if "vocab_size" in overrides and overrides["vocab_size"] != vocab_size:
            raise ConfigError(
                "TrainConfig",
                "model",
                f"sets vocab_size {overrides['vocab_size']}, but the data's tokenizer has {vocab_size} tokens; drop "
                "the vocab_size override or prepare the data with the matching tokenizer",
            )
        return ModelConfig.preset(self.preset, attention=self.attention, **{**overrides, "vocab_size": vocab_size})

    def resolve_seq_len(self, model_config: ModelConfig) -> None:
        """Default the window length to min(max_seq_len, 256); refuse one longer than the model's context."""
        if self.seq_len is None:
            self.seq_len = min(model_config.max_seq_len, 256)
        if self.seq_len > model_config.max_seq_len:
            raise ConfigError(
                "TrainConfig",
                "seq_len",
                f"{self.seq_len} exceeds the model's max_seq_len {model_config.max_seq_len}; train on shorter windows "
                "or raise max_seq_len in `model`",
            )

    def take_model_from(self, start: ModelConfig) -> None:
        """A run started from another's weights (``init_from``, whose model is ``start``) has that run's model:
        `model` overrides and another `attention` are refused (they would be ignored), and no preset is recorded."""
        source = f"`init_from` {self.init_from} is a {start.attention!r} model (its model_config.json)"
        if self.model:
            raise ConfigError("TrainConfig", "model", f"cannot be given with {source}: drop it")
        if self.attention != start.attention:
            raise ConfigError("TrainConfig", "attention", f"is {self.attention!r}, but {source}: drop it")
        self.preset = None

    def passes_note(self, have: int) -> str | None:
        """A note when the run reads its ``have`` training tokens more than OVERFIT_PASSES times: past a few passes
        a model memorises its data (validation loss rises while training loss falls)."""
        passes = self.max_steps * self.batch_size * self.seq_len / have
        if passes <= OVERFIT_PASSES:
            return None
        keep = (
            "keep_best keeps the checkpoint with the lowest validation loss"
            if self.keep_best
            else "to keep the checkpoint with the lowest validation loss, set keep_best (difftx train --keep-best); "
            "or train on more data or for fewer steps"
        )
        return (
            f"this run reads its {have:,} training tokens {passes:.1f} times over ({self.max_steps:,} steps of "
            f"{self.batch_size} x {self.seq_len} tokens): after about {OVERFIT_PASSES} passes a model starts to "
            f"memorise its training text and its validation loss to rise; {keep}"
        )

    def recipe(self) -> dict[str, Any]:
        """The config as the run trains with it (absolute paths, and what a resume changed): what
        train_config.json and every checkpoint's state.json record."""
        saved = self.to_dict()
        for name in ("data", "init_from"):
            if saved[name] is not None:
                saved[name] = str(Path(saved[name]).resolve())
        return saved

    def to_dict(self) -> dict[str, Any]:
        """The fields saved with a run: all but ``out``."""
        data = dataclasses.asdict(self)
        del data["out"]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, out: str, where: str = "train config") -> TrainConfig:
        """A saved config (``out`` is the directory it now lies in; an ``out`` saved by older versions is ignored)."""
        return _build(_saved_fields(text, where), out, where, changed=())


def _saved_fields(text: str, where: str) -> dict[str, Any]:
    data = parse_json_object(text, where)
    data.pop("out", None)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for name in data:
        if name not in known:
            raise InputError(f"{where} has an unknown field {name!r}; it was written by another version")
    if "data" not in data:
        raise InputError(f"{where} has no 'data' field")
    return data


def _build(fields: dict[str, Any], out: str, where: str, changed) -> TrainConfig:
    """TrainConfig(**fields); an error in a saved (unchanged) field names the file it came from."""
    try:
        return TrainConfig(**fields, out=out)
    except ConfigError as err:
        if err.field in changed:
            raise
        raise InputError(f"{where}: {err}") from None


def resume_config(run_dir: str | Path, max_steps: int | None = None, **changes: Any) -> TrainConfig:
    """The TrainConfig saved in a run directory, with ``changes`` applied: the fields in RESUMABLE may change,
    the others only be repeated with their saved value. The run is resumed where it lies (``out`` = run_dir)."""
    from difftransformer.store.runs import TRAIN_CONFIG, refuse_quantized

    refuse_quantized(Path(run_dir), "train further")
    path = Path(run_dir) / TRAIN_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory ({TRAIN_CONFIG} is missing)")
    saved = _saved_fields(read_text(path), str(path))
    _build(dict(saved), str(run_dir), str(path), changed=())  # the file as written, checked before any change
    if changes.pop("out", None) not in (None, str(run_dir)):
        raise ConfigError(
            "TrainConfig",
            "out",
            "cannot be given when resuming: a resume writes into the run directory itself. To branch a run, copy "
            "its directory (cp -r RUN NEW) and resume the copy",
        )
    changes["max_steps"] = max_steps
    changed = []
    for name, value in changes.items():
        if value is None or value == saved.get(name, _DEFAULTS.get(name)):
            continue
        if name in ("data", "init_from") and saved.get(name) and Path(value).resolve() == Path(saved[name]).resolve():
            continue  # the same directory, named another way
        if name not in _DEFAULTS:
            raise ConfigError("TrainConfig", name, "is not a TrainConfig field")
        if name not in RESUMABLE:
            raise ConfigError(
                "TrainConfig",
                name,
                f"cannot change when resuming (the run has {saved.get(name, _DEFAULTS[name])!r}): it is part of the "
                "run's recipe. To train these weights with another value, start a new run from them with `init_from`",
            )
        saved[name] = str(Path(value).resolve()) if name == "data" else value
        changed.append(name)
    warmup = saved.get("warmup_steps")
    if "max_steps" in changed and isinstance(warmup, int) and saved["max_steps"] < warmup:
        raise ConfigError(
            "TrainConfig",
            "max_steps",
            f"{saved['max_steps']} is below the run's warmup of {warmup} steps ({path} records it; unless given, it "
            f"is min(375, max_steps / 10) of the run's first max_steps): give at least {warmup}",
        )
    return _build(saved, str(run_dir), str(path), changed)


_DEFAULTS = {
    f.name: f.default if f.default is not dataclasses.MISSING else None
    for f in dataclasses.fields(TrainConfig)
    if f.name != "out"
}
