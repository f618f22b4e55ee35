"""`difftx repro lm`: the paper's language-modeling claims, measured with the project's own training loop.

A study directory holds the prepared corpus (``data/``, a BPE tokenizer trained on the training documents only,
documents split whole between train and validation), one ordinary run directory per trained model (``runs/``,
resumable with ``difftx train --resume``), one measurement file per finished run (``measures/``) and the report
(``results.json``, ``section.md``, figures). Running the same command again continues an interrupted study: a
finished and measured run is skipped, an unfinished one resumes from its newest checkpoint.

Three parts, each with its own budget (see ``Scale``):

- ``sweep``: at the reference size and the long budget, both architectures at every learning rate of the scale;
  each architecture then trains at its own best learning rate (DIFF V2 and the DIFF ablations at DIFF's, the
  standard ablation at the standard model's).
- ``grid``: every size at both token budgets, DIFF and standard, seed 0; the reference size at the long budget
  with more seeds; DIFF V2 at the reference size. Fits loss against non-embedding parameters and against tokens.
- ``ablations``: the paper's Table 6 at the reference size and the short budget, every seed: no per-head norm,
  constant lambda_init 0.8 and 0.5, the standard model with the per-head norm, DIFF with as many differential heads
  as the standard model has heads, and both baselines.

Matched pairs share the model config (but the attention), the initialisation seed, the data order (the window
sampler's seed) and the optimiser.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import wait
from pathlib import Path

import torch

from difftransformer.apps.repro import lm_measure
from difftransformer.core.model import count_parameters
from difftransformer.errors import InputError, Interrupted, TrainingDiverged
from difftransformer.fsutil import open_plan, read_json_object, write_text_atomic
from difftransformer.progress import Progress
from difftransformer.store import corpus
from difftransformer.store.data import TokenData, eval_windows, is_val_document, prepare, read_manifest
from difftransformer.store.runs import METRICS, TRAIN_CONFIG
from difftransformer.training.config import TrainConfig, resume_config
from difftransformer.training.evaluate import token_losses
from difftransformer.training.interrupts import StopSignals
from difftransformer.training.loop import Trainer
from difftransformer.training.metrics import step_of
from difftransformer.training.step import layer_lambdas

PARTS = ("sweep", "grid", "ablations")
STUDY = "study.json"
TIMINGS = "timings.json"
LONG_PLAN = "long.json"  # the long part's plan (lm_long), beside STUDY in the same directory
RUN_SECONDS = "seconds.json"  # in a run directory: the seconds every invocation spent on the run, added up
DEFAULT_CORPORA = ("data/shakespeare", "data/sotu")
FETCH = {
    "shakespeare": "difftx data fetch shakespeare --out data/shakespeare",
    "sotu": "difftx data fetch sotu --out data/sotu",
}

# name: (attention, ModelConfig options, the architecture whose best learning rate it trains at)
VARIANTS: dict[str, tuple[str, dict, str]] = {
    "diff": ("diff", {}, "diff"),
    "standard": ("standard", {}, "standard"),
    "diff_v2": ("diff_v2", {}, "diff"),
    "diff-no-head-norm": ("diff", {"head_norm": False}, "diff"),
    "diff-lambda-0.8": ("diff", {"lambda_init": 0.8}, "diff"),
    "diff-lambda-0.5": ("diff", {"lambda_init": 0.5}, "diff"),
    "standard-head-norm": ("standard", {"head_norm": True}, "standard"),
    "diff-all-heads": ("diff", {"diff_heads": "all"}, "diff"),
}
ABLATIONS = ("diff-no-head-norm", "diff-lambda-0.8", "diff-lambda-0.5", "standard-head-norm", "diff-all-heads")


@dataclass(frozen=True)
class Scale:
    """One study's sizes and budgets. Sizes are (d_model, n_layers, n_heads of the standard model)."""

    name: str
    sizes: dict[str, tuple[int, int, int]]
    reference: str  # the size with seeds, the learning-rate sweep and the ablations
    seq_len: int
    batch_size: int
    steps: tuple[int, int]  # the long and the short token budget, in optimizer steps
    lrs: tuple[float, ...]
    vocab_size: int
    eval_tokens: int
    device: str
    workers: int  # default models trained at once
    threads: int | None  # per worker
    val_every: int = 20  # every 20th document is validation (5%)
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    ckpt_every: int = 60

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch_size

    @classmethod
    def from_record(cls, record: dict) -> Scale:
        """The plan that ``dataclasses.asdict`` wrote (a study's plan file)."""
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items()}
        return cls(**{**values, "sizes": {k: tuple(v) for k, v in record["sizes"].items()}})

    # what a plan of another kind (the long part's, ``lm_long.LongScale``) does otherwise
    def attention(self, variant: str) -> str:
        return VARIANTS[variant][0]

    def model_options(self, variant: str) -> dict:
        """The ModelConfig options that make ``variant`` in this plan."""
        return dict(VARIANTS[variant][1])

    def schedule(self, steps: int) -> dict:
        """How a run of ``steps`` steps is validated during training: once, at its end."""
        return {"eval_interval": steps, "eval_tokens": 1 << 14}

    def fit(self, trainer: Trainer) -> None:
        """Train ``trainer``'s run to its end."""
        trainer.fit()

    def extra_measures(self, run_dir: Path) -> dict:
        """What a finished run's measurement records besides ``measure_run``'s (nothing here)."""
        return {}


# What the CPU and GPU plans of every study share: the rates tried, the vocabulary, the device, how many models train
# at once and their threads.
ON_CPU = dict(
    lrs=(1.5e-3, 3e-3, 6e-3, 1.2e-2), vocab_size=2048, eval_tokens=1 << 16, device="cpu", workers=2, threads=1
)
ON_GPU = dict(lrs=(7.5e-4, 1.5e-3, 3e-3, 6e-3), vocab_size=8192, device="cuda", workers=1, threads=None)

SCALES = {
    # About 80 minutes for the grid, 45 for the sweep and 60 for the ablations on 2 cores, two models at a time.
    "cpu": Scale(
        name="cpu",
        sizes={"S": (64, 4, 8), "M": (96, 6, 8), "L": (128, 8, 8)},
        reference="M",
        seq_len=1024,
        batch_size=4,
        steps=(240, 120),
        **ON_CPU,
    ),
    # One GPU, bf16, one model at a time; the top size has about 169M parameters (152M without embeddings).
    "gpu": Scale(
        name="gpu",
        sizes={"S": (384, 6, 12), "M": (512, 8, 16), "L": (1024, 12, 16)},
        reference="M",
        seq_len=2048,
        batch_size=32,
        steps=(300, 150),
        eval_tokens=1 << 20,
        **ON_GPU,
        ckpt_every=100,
    ),
}


@dataclass(frozen=True, order=True)
class Run:
    size: str
    steps: int
    variant: str
    lr: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.size}-{self.steps}-{self.variant}-lr{self.lr:g}-s{self.seed}"

    def model_overrides(self, scale: Scale) -> dict:
        d_model, n_layers, n_heads = scale.sizes[self.size]
        options = scale.model_options(self.variant)
        return dict(d_model=d_model, n_layers=n_layers, n_heads=n_heads, max_seq_len=scale.seq_len, **options)

    def train_config(self, scale: Scale, data: Path, out: Path, log_to: str = "jsonl") -> TrainConfig:
        return TrainConfig(
            data=str(data),
            out=str(out),
            preset="tiny",
            attention=scale.attention(self.variant),
            model=self.model_overrides(scale),
            seq_len=scale.seq_len,
            batch_size=scale.batch_size,
            max_steps=self.steps,
            lr=self.lr,
            warmup_steps=max(1, round(scale.warmup_fraction * self.steps)),
            betas=scale.betas,
            weight_decay=scale.weight_decay,
            **scale.schedule(self.steps),
            log_interval=max(1, self.steps // 24),
            ckpt_interval=scale.ckpt_every,
            keep_last=1,
            seed=self.seed,
            device=scale.device,
            threads=scale.threads,
            log_to=log_to,
        )


# the plan ----------------------------------------------------------------------------------------------------------
def sweep_runs(scale: Scale) -> list[Run]:
    return [Run(scale.reference, scale.steps[0], v, lr, 0) for v in ("diff", "standard") for lr in scale.lrs]


def grid_runs(scale: Scale, best: dict[str, float], seeds: list[int]) -> list[Run]:
    runs = [
        Run(size, steps, v, best[v], 0) for size in scale.sizes for steps in scale.steps for v in ("diff", "standard")
    ]
    runs += [Run(scale.reference, scale.steps[0], v, best[v], s) for s in seeds[1:] for v in ("diff", "standard")]
    runs.append(Run(scale.reference, scale.steps[0], "diff_v2", best["diff"], 0))
    return runs


def ablation_runs(scale: Scale, best: dict[str, float], seeds: list[int]) -> list[Run]:
    variants = ("diff", "standard", *ABLATIONS)
    return [Run(scale.reference, scale.steps[1], v, best[VARIANTS[v][2]], s) for s in seeds for v in variants]


def best_lrs(scale: Scale, measures: dict[str, dict]) -> dict[str, float]:
    """Each architecture's learning rate with the lowest validation loss in the sweep."""
    missing = [r.name for r in sweep_runs(scale) if r.name not in measures]
    if missing:
        raise InputError(
            f"the learning-rate sweep is not complete ({len(missing)} runs missing, e.g. {missing[0]}); run "
            "`difftx repro lm --part sweep` with the same --out first (or --part all)"
        )
    best = {}
    for arch in ("diff", "standard"):
        runs = [r for r in sweep_runs(scale) if r.variant == arch]
        best[arch] = min(runs, key=lambda r: measures[r.name]["val"]["loss"]).lr
    return best


# the corpus --------------------------------------------------------------------------------------------------------
def study_documents(corpora: list[str | Path], read: bool = True) -> tuple[list[str], list[str]]:
    """(documents, sources): the built-in corpus, then each corpus directory's documents in sorted file order
    (with ``read=False`` only the check that every directory is there)."""
    for folder in map(Path, corpora):
        if not folder.is_dir():
            hint = FETCH.get(folder.name, "difftx data fetch shakespeare|sotu --out DIR")
            raise FileNotFoundError(f"corpus directory {folder} does not exist; fetch it with `{hint}`")
    if not read:
        return [], []
    docs = list(corpus.pydocs_documents())
    sources = [f"pydocs: {len(docs)} documents (CPython help topics and docstrings)"]
    for folder in map(Path, corpora):
        found = list(corpus.iter_documents(corpus.find_files([folder])))
        docs += found
        sources.append(f"{folder}: {len(found)} documents")
    return docs, sources


def ensure_data(out: Path, scale: Scale, corpora: list[str | Path]) -> Path:
    """out/data, prepared once: BPE trained on the training documents, then every document tokenised whole into
    its split (``split="documents"``)."""
    from difftransformer.store.tokenizer import train_bpe

    data = out / "data"
    if (data / "manifest.json").is_file():
        vocab = read_manifest(data)["tokenizer"]["vocab_size"]
        if vocab != scale.vocab_size:
            raise InputError(
                f"{data} was prepared with a {vocab}-token vocabulary, but the `scale` {scale.name} plan uses "
                f"{scale.vocab_size}: give a new `out` for this scale"
            )
        return data
    docs, sources = study_documents(corpora)
    size = sum(len(d.encode()) for d in docs)
    print(f"corpus: {len(docs)} documents, {size / 1e6:.1f} MB; training a {scale.vocab_size}-token BPE on the "
          "training documents", flush=True)  # fmt: skip
    train_docs = [d for i, d in enumerate(docs) if not is_val_document(i, scale.val_every)]
    tokenizer = train_bpe(iter(train_docs), scale.vocab_size, out / "tokenizer")
    prepare(docs, tokenizer, data, val_every=scale.val_every, sources=sources, split="documents")
    return data


# running -----------------------------------------------------------------------------------------------------------
def open_study(out: Path, scale: Scale, seeds: list[int]) -> dict:
    """Create out/study.json, or check that the study already in ``out`` is this one."""
    record = {"scale": dataclasses.asdict(scale), "seeds": seeds}
    return open_plan(
        out,
        STUDY,
        record,
        "study",
        lambda saved, path: (
            f"{out} holds a study with another plan ({path}: scale {saved.get('scale', {}).get('name')!r}, seeds "
            f"{saved.get('seeds')}); continue it with the same `scale`, `steps` and `seeds`, or give a new `out`"
        ),
        companions=(LONG_PLAN,),
    )


def read_measures(out: Path) -> dict[str, dict]:
    """Every measured run of the study, by name; all must have been measured on the same data."""
    found = {}
    for path in sorted((out / "measures").glob("*.json")):
        found[path.stem] = read_json_object(path)
    data = {m["data"] for m in found.values() if "data" in m}
    if len(data) > 1:
        raise InputError(
            f"the runs measured in {out / 'measures'} were trained on different data ({', '.join(sorted(data))}): "
            "their losses cannot be compared; keep the runs of one prepared corpus only"
        )
    return found


def execute(runs: list[Run], scale: Scale, out: Path, data: Path, workers: int, log_to: str = "jsonl") -> None:
    """Train (or resume) and measure every run not measured yet, ``workers`` at a time, the costliest first, each
    logging its metrics to ``log_to`` (TrainConfig.log_to: one TensorBoard run per model under out/runs)."""
    done = read_measures(out)
    todo = sorted({r for r in runs if r.name not in done}, key=lambda r: -_cost(r, scale))
    if not todo:
        return
    print(f"{len(todo)} runs to train ({len(set(runs)) - len(todo)} done), {workers} at a time", flush=True)
    jobs = [(r, scale, str(data), str(out), log_to) for r in todo]
    dirs = [out / "runs" / r.name for r in todo]
    progress = Progress(sum(r.steps for r in todo), f"repro lm: {len(todo)} runs")
    progress.begin(sum(map(_trained_steps, dirs)))
    with progress.watching(lambda: sum(map(_trained_steps, dirs)), every_s=2.0, after="measuring the last runs"):
        if workers <= 1:
            for job in jobs:
                _report(_train_and_measure(*job), progress)
            return
        _run_processes(jobs, workers, out, progress)


def _trained_steps(run_dir: Path) -> int:
    """The last step a run logged in its metrics.jsonl (0 before its first row; a row being written is skipped)."""
    try:
        with open(run_dir / METRICS, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return 0
    return next((step for step in map(step_of, reversed(tail)) if step is not None), 0)


def _run_processes(jobs: list[tuple], workers: int, out: Path, progress: Progress) -> None:
    """One spawned process per run, at most ``workers`` at once, each in its own session so that a Ctrl-C reaches
    this process only: the first SIGINT or SIGTERM is passed on once as SIGTERM (each run finishes its step, writes a
    checkpoint and stops; no new run starts), a second one stops the runs at once (their last checkpoints stay)."""
    ctx = get_context("spawn")
    pending, running, failed, passed_on = list(jobs), {}, [], False
    with StopSignals() as signals:
        try:
            while running or (pending and not failed and not signals.received):
                while pending and len(running) < workers and not failed and not signals.received:
                    job = pending.pop(0)
                    proc = ctx.Process(target=_job_process, args=job, name=job[0].name)
                    proc.start()
                    running[proc] = job[0]
                if signals.received and not passed_on:
                    for proc in running:
                        proc.terminate()
                    passed_on = True
                wait([proc.sentinel for proc in running], timeout=1.0)
                for proc in [p for p in running if p.exitcode is not None]:
                    run = running.pop(proc)
                    if proc.exitcode == 0:
                        _report(read_json_object(out / "measures" / f"{run.name}.json"), progress)
                    else:
                        failed.append((run, proc.exitcode))
        finally:
            for proc in running:  # only after a second signal (or a defect here): stop them now
                proc.terminate()
                proc.join()
    codes = {code for _, code in failed}
    if signals.received or codes & {128 + signal.SIGINT, 128 + signal.SIGTERM}:
        signum = signals.received or (signal.SIGINT if 128 + signal.SIGINT in codes else signal.SIGTERM)
        raise Interrupted(
            signum, "the study stopped; the runs in progress wrote checkpoints: run the same command to continue"
        )
    if failed:
        run, code = failed[0]
        how = f"was killed by signal {-code} (out of memory?)" if code < 0 else f"failed (exit code {code})"
        message = f"the run {out / 'runs' / run.name} {how}; its error, if any, is printed above"
        raise InputError(message) if code == 2 else RuntimeError(message)


def _job_process(run: Run, scale: Scale, data: str, out: str, log_to: str) -> None:
    """A spawned process's job: exit 0 when measured, 2 for a user error, 128 + signal when interrupted."""
    os.setsid()
    try:
        _train_and_measure(run, scale, data, out, log_to)
    except Interrupted as err:
        print(f"{run.name}: {err}", file=sys.stderr, flush=True)
        sys.exit(128 + err.signum)
    except (InputError, OSError) as err:
        print(f"{run.name}: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


def _report(measure: dict, progress: Progress) -> None:
    progress.write(f"  {measure['name']}: val loss {measure['val']['loss']:.4f} ({measure['train_seconds']:.0f} s)")


def _cost(run: Run, scale: Scale) -> float:
    d_model, n_layers, _ = scale.sizes[run.size]
    per_token = 12 * n_layers * d_model**2 + 2 * n_layers * scale.seq_len * d_model + 2 * d_model * scale.vocab_size
    return run.steps * per_token * (1.4 if scale.attention(run.variant) == "diff" else 1.0)


def _train_and_measure(run: Run, scale: Scale, data: str, out: str, log_to: str = "jsonl") -> dict:
    """Train the run to its end (resuming it when it was started), then measure it. Its seconds (training and
    measuring) are added up over the invocations that trained it in ``RUN_SECONDS`` (an invocation killed outright
    records none; its steps are trained again and counted in the next)."""
    if scale.threads:
        torch.set_num_threads(scale.threads)
    out_dir = Path(out)
    run_dir = out_dir / "runs" / run.name
    resume = (run_dir / TRAIN_CONFIG).is_file()
    if resume:
        cfg = resume_config(run_dir, data=data, log_to=log_to)
    else:
        cfg = run.train_config(scale, Path(data), run_dir, log_to)
    trainer = Trainer(cfg, resume=resume, quiet=True)
    first, start = trainer.step_idx, time.perf_counter()
    try:
        try:
            scale.fit(trainer)
            measure = measure_run(trainer, run, scale, Path(data))
        except TrainingDiverged as err:  # recorded as such (a sweep's high learning rate may diverge)
            measure = diverged(run, scale, trainer.model.config, str(err))
    finally:
        spent = _add_run_seconds(run_dir, time.perf_counter() - start, trainer.step_idx - first)
        trainer.close()
    measure.update(scale.extra_measures(run_dir))
    steps = spent["steps"]
    measure.update(train_seconds=spent["seconds"], seconds_per_step=spent["seconds"] / steps if steps else None)
    (out_dir / "measures").mkdir(exist_ok=True)
    write_text_atomic(out_dir / "measures" / f"{run.name}.json", json.dumps(measure) + "\n")
    return measure


def _add_run_seconds(run_dir: Path, seconds: float, steps: int) -> dict:
    """Add one invocation's seconds and trained steps to the run's RUN_SECONDS; the totals."""
    path = run_dir / RUN_SECONDS
    total = read_json_object(path) if path.is_file() else {"seconds": 0.0, "steps": 0, "invocations": 0}
    total = {"seconds": total["seconds"] + seconds, "steps": total["steps"] + steps,
             "invocations": total["invocations"] + 1}  # fmt: skip
    if run_dir.is_dir():  # a start that failed has removed it
        write_text_atomic(path, json.dumps(total) + "\n")
    return total


def _identity(run: Run, scale: Scale, cfg) -> dict:
    """What every measurement record starts with: the run, its size and its token budget."""
    return {
        "name": run.name,
        "run": dataclasses.asdict(run),
        "parameters": count_parameters(cfg),
        "non_embedding": count_parameters(cfg, exclude_embeddings=True),
        "tokens": run.steps * scale.tokens_per_step,
    }


def diverged(run: Run, scale: Scale, cfg, why: str) -> dict:
    """The record of a run that diverged: an infinite loss, so that no comparison picks it."""
    inf = float("inf")
    return {
        **_identity(run, scale, cfg),
        "diverged": why,
        "val": {"loss": inf, "recall_loss": inf, "other_loss": inf, "recall_tokens": 0, "other_tokens": 0},
        "per_position": [],
        "documents": 0,
        "lambda": None,
    }


def measure_run(trainer: Trainer, run: Run, scale: Scale, data: Path) -> dict:
    """Validation loss (all targets, recall hits, others) and the per-position loss of long documents."""
    model = trainer.model
    val = TokenData(data, "val")
    windows = eval_windows(val, scale.seq_len, scale.eval_tokens)
    device = next(model.parameters()).device
    losses = token_losses(model, windows.to(device), amp=trainer.amp).cpu()
    docs = lm_measure.document_windows(val, trainer.tokenizer.eot_id, scale.seq_len)
    doc_losses = token_losses(model, docs.to(device), amp=trainer.amp).cpu() if len(docs) else None
    cfg = model.config
    return {
        **_identity(run, scale, cfg),
        "data": trainer.data_record["id"],  # the shards' digest: every run of a study must share it
        "val": lm_measure.split_by_recall(losses, windows),
        "val_windows": len(windows),
        "per_position": lm_measure.per_position(doc_losses) if doc_losses is not None else [],
        "documents": len(docs),
        "lambda": layer_lambdas(model),
    }


def add_time(out: Path, part: str, seconds: float) -> float:
    """Add this invocation's wall-clock to the part's total in out/timings.json (a resumed study counts both)."""
    path = out / TIMINGS
    timings = read_json_object(path) if path.is_file() else {}
    timings[part] = timings.get(part, 0.0) + seconds
    write_text_atomic(path, json.dumps(timings, indent=1) + "\n")
    return timings[part]
