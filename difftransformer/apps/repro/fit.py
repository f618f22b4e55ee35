"""Training matched DIFF / standard pairs on a synthetic task, in parallel worker processes.

A pair shares everything but the attention: the model config, the initialisation seed of the shared layers, the
data stream (one generator seeded with the run's seed) and the optimiser (AdamW with the library's weight-decay
groups, linear warmup then cosine, stepped by the training loop's ``optimizer_step``), except that the peak learning
rate may be each architecture's own (``FitSpec.lr`` as {attention: lr}, each from its own sweep). Each run records a
learning curve, accuracy on a fixed evaluation set against steps and against seconds, since a DIFF step costs more
than a standard one. Each trained model is saved as a run directory (``load_run`` reads it; its tokenizer reads and
writes token ids) under ``<out>/models/<task>-<attention>-seed<seed>``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from types import ModuleType

import torch

from difftransformer.apps.repro.tasks import VOCAB
from difftransformer.core.attention.logits import LogitQuantizer, check_bits, logit_probe
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.errors import InputError
from difftransformer.fsutil import write_failure, write_json
from difftransformer.progress import Progress
from difftransformer.store.runs import MODEL_CONFIG, load_run, save_run
from difftransformer.store.tokenizer import IdTokenizer
from difftransformer.training.step import lr_at, make_optimizer, optimizer_step

ATTENTIONS = ("diff", "standard")
CPU = torch.device("cpu")  # one thread per model, several models at a time
_steps_done = None  # while run_pairs shows progress: a shared count of the training steps of all its workers


@dataclass
class FitSpec:
    """One training run's setting (the model and optimiser; the task supplies the batches)."""

    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 8  # the standard model's heads; DIFF uses half, with values twice as wide
    seq_len: int = 64
    steps: int = 3000
    batch_size: int = 32
    lr: float | dict[str, float] = 3e-3  # the peak learning rate, or {attention: its peak learning rate}
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    init_std: float = 0.02  # the weights' initial standard deviation (ModelConfig.init_std)
    eval_every: int = 250
    task: dict = field(default_factory=dict)  # the task's own options (e.g. needle counts)
    logit_bits: int | None = (
        None  # the final evaluation's attention logits quantized to this many bits (training: float)
    )

    def for_attention(self, attention: str) -> FitSpec:
        """This spec with ``attention``'s own learning rate when ``lr`` gives one per attention."""
        if not isinstance(self.lr, dict):
            return self
        if attention not in self.lr:
            raise InputError(f"`lr` gives learning rates for {sorted(self.lr)}, not for {attention!r}: add one")
        return replace(self, lr=self.lr[attention])

    @property
    def max_steps(self) -> int:  # what train.lr_at reads
        return self.steps

    def model_config(self, attention: str) -> ModelConfig:
        return ModelConfig(
            vocab_size=VOCAB,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            max_seq_len=self.seq_len,
            attention=attention,
            tie_embeddings=True,
            init_std=self.init_std,
        )


def scaled_spec(
    scales: dict[str, FitSpec], scale: str, steps: int | None = None, logit_bits: int | None = None
) -> FitSpec:
    """The experiment's spec at ``scale``, with the number of steps overridden when given (quick checks) and the
    final evaluation's logit bits set when given."""
    if scale not in scales:
        raise InputError(f"unknown scale {scale!r}; choose one of {sorted(scales)}")
    spec = scales[scale]
    if steps is not None:
        if steps < 1:
            raise InputError(f"`steps` must be at least 1, got {steps}")
        spec = FitSpec(**{**asdict(spec), "steps": steps, "eval_every": max(1, min(spec.eval_every, steps))})
    if logit_bits is not None:
        spec = FitSpec(**{**asdict(spec), "logit_bits": check_bits(logit_bits)})
    return spec


@contextmanager
def final_evaluation(spec: FitSpec) -> Iterator[None]:
    """The context of a model's final evaluation: attention logits quantized when ``spec.logit_bits`` says so."""
    if spec.logit_bits is None:
        yield
        return
    with logit_probe(LogitQuantizer(spec.logit_bits)):
        yield


def fit(
    attention: str,
    seed: int,
    spec: FitSpec,
    sample: Callable[[torch.Generator, int], tuple[torch.Tensor, torch.Tensor]],
    score: Callable[[TransformerLM], float],
    threads: int = 1,
    stop: int | None = None,
) -> tuple[dict, TransformerLM]:
    """Train one model; returns its record {attention, seed, seconds, curve [{step, seconds, loss, accuracy}]} and
    the trained model in eval mode. ``stop``: end after that many steps of ``spec``'s schedule (the learning rate of
    a run of ``spec.steps``, so that the model is that run's at step ``stop``)."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    spec = spec.for_attention(attention)
    model = TransformerLM(spec.model_config(attention))
    optimizer = make_optimizer(model, spec)
    data = torch.Generator().manual_seed(seed)
    curve, seconds, losses = [], 0.0, []
    last = spec.steps if stop is None else min(stop, spec.steps)
    for step in range(last + 1):
        if step % spec.eval_every == 0 or step == last:
            model.eval()
            curve.append({"step": step, "seconds": round(seconds, 2), "loss": _mean(losses), "accuracy": score(model)})
            model.train()
            losses = []
        if step == last:
            break
        start = time.perf_counter()
        row = optimizer_step(model, optimizer, [sample(data, spec.batch_size)], lr_at(step, spec), 1.0, CPU).row()
        seconds += time.perf_counter() - start
        losses.append(row["loss"])
        if _steps_done is not None:
            with _steps_done.get_lock():
                _steps_done.value += 1
    record = {
        "attention": attention,
        "seed": seed,
        "lr": spec.lr,
        "seconds": round(seconds, 1),
        "curve": curve,
        "config": model.config.to_dict(),
    }
    return record, model.eval()


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def run_pairs(
    job: Callable[[str, int], dict], seeds: list[int], workers: int, steps: int, label: str, title: str | None = None
) -> list[dict]:
    """job(attention, seed) for both attentions and every seed, ``workers`` at a time (one thread each), with a live
    progress line (``title``, by default one naming the experiment ``label``) counting the training steps of all of
    them (``steps`` per model).

    ``job`` must be picklable (a module-level function or functools.partial of one): workers are spawned.
    """
    tasks = [(attention, seed) for seed in seeds for attention in ATTENTIONS]
    ctx = get_context("spawn")
    try:
        counter = ctx.Value("q", 0)  # shared memory: a temporary file, which a full disk refuses
    except OSError as err:
        if (failure := write_failure(err, "the worker processes' step counter (a temporary file)")) is None:
            raise
        raise failure from err
    title = title or f"repro {label}: {len(tasks)} models, {min(workers, len(tasks))} at a time"
    progress = Progress(len(tasks) * steps, title)
    _count_steps(counter)
    try:
        with progress.watching(lambda: counter.value, after="training done; evaluating the models"):
            if workers <= 1:
                return [job(a, s) for a, s in tasks]
            pool = ProcessPoolExecutor(workers, ctx, initializer=_count_steps, initargs=(counter,))
            try:
                return list(pool.map(job, *zip(*tasks, strict=True)))
            except BaseException:  # a signal or a failed model: the others stop now (the pool would run them all)
                _stop_workers(pool)
                raise
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
    finally:
        _count_steps(None)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """End the workers of ``pool`` at once: its queued models are cancelled, the ones training are killed (SIGTERM)."""
    pool.shutdown(wait=False, cancel_futures=True)
    for process in list((pool._processes or {}).values()):  # the executor has no public way to end running work
        process.terminate()


def _count_steps(counter) -> None:
    """Make fit() count its steps in ``counter`` (None: stop counting); a worker process's initializer."""
    global _steps_done
    _steps_done = counter


def model_dir(out: Path, task: str, attention: str, seed: int) -> Path:
    """Where an experiment saves one trained model (a run directory)."""
    return out / "models" / f"{task}-{attention}-seed{seed}"


def save_model(model: TransformerLM, record: dict, out: Path, task: str, spec: FitSpec) -> Path:
    """``model`` as the run directory model_dir(out, task, ...), with its checkpoint at the last step."""
    meta = {"experiment": task, "seed": record["seed"], "spec": asdict(spec)}
    path = model_dir(out, task, record["attention"], record["seed"])
    return save_run(model, IdTokenizer(VOCAB), path, meta, spec.steps)


def find_models(folder: Path, task: str) -> dict[tuple[str, int], Path]:
    """{(attention, seed): run directory} of the models an experiment saved under folder/models."""
    found = {}
    for path in sorted((folder / "models").glob(f"{task}-*-seed*")):
        if path.suffix == ".pt":
            raise InputError(
                f"{path} is a model file of difftransformer 0.1 (the experiments now save run directories); run "
                "the experiment again to retrain its models"
            )
        if not (path / MODEL_CONFIG).is_file():
            continue
        attention, seed = path.name.removeprefix(f"{task}-").rsplit("-seed", 1)
        found[(attention, int(seed))] = path
    return found


def saved_models(folder: Path, task: str, seeds: list[int], hint: str) -> dict[tuple[str, int], Path]:
    """find_models of ``folder``, refusing (with ``hint``, the way out) when a seed lacks either model."""
    found = find_models(Path(folder), task)
    missing = [s for s in seeds if any((a, s) not in found for a in ATTENTIONS)]
    if missing:
        raise FileNotFoundError(f"{folder}/models lacks the {task} models of seed(s) {missing}; {hint}")
    return found


def save_and_evaluate(
    record: dict, model: TransformerLM, out: Path, task: str, spec: FitSpec, evaluate: Callable
) -> dict:
    """Save a trained model under out/models and return its record with ``eval``: evaluate(model, spec) under
    the final evaluation's settings (called in the worker, so evaluations run in parallel too)."""
    save_model(model, record, out, task, spec)
    with final_evaluation(spec):
        return {**record, "eval": evaluate(model, spec)}


def curves_to_tensorboard(result: dict, out: Path) -> list[Path]:
    """One TensorBoard run per model a synthetic study trained (``out/tensorboard/<task>-<attention>-seed<k>``):
    its learning curve's training loss (``train/loss``) and accuracy on the fixed set (``eval/accuracy``) against
    steps, at the training seconds as wall time. Written from the result's curves, after the models trained in
    their worker processes; returns the run directories."""
    from torch.utils.tensorboard import SummaryWriter

    written = []
    for run in result["runs"]:
        path = out / "tensorboard" / f"{result['experiment']}-{run['attention']}-seed{run['seed']}"
        writer = SummaryWriter(log_dir=str(path))
        for point in run["curve"]:
            for tag, key in (("train/loss", "loss"), ("eval/accuracy", "accuracy")):
                value = point.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):  # a step-0 point has no loss yet
                    writer.add_scalar(tag, value, point["step"], walltime=point["seconds"])
        writer.close()
        written.append(path)
    return written


def train_pairs(out: Path, task: str, scale: str, spec: FitSpec, job, seeds: list[int], workers: int) -> dict:
    """Train, save (under out/models) and evaluate every pair (``job(attention, seed)`` returns fit()'s record
    plus an ``eval``), and return the common part of the experiment's result record."""
    runs = run_pairs(job, seeds, workers, spec.steps, task)
    return {
        "experiment": task,
        "scale": scale,
        "seeds": seeds,
        "spec": asdict(spec),
        "runs": [{k: v for k, v in r.items() if k != "eval"} for r in runs],
        "evals": [{"attention": r["attention"], "seed": r["seed"], **r["eval"]} for r in runs],
    }


def run_task(
    study: ModuleType,
    out: Path,
    scale: str,
    seeds: list[int],
    workers: int,
    steps: int | None = None,
    logit_bits: int | None = None,
    models: Path | None = None,
) -> dict:
    """A synthetic task's study, which ``study`` (its module) declares: its task (``TASK``, ``SCALES``,
    ``train_job``, ``evaluate`` and ``EVAL_OPTIONS``), what its results record beside the measurements (``RECORDED``),
    its figure (``draw``) and its section (``markdown``). train_pairs into ``out``; or, given ``models`` (an earlier
    report directory of the task), evaluate_pairs (no training). Writes out/results.json, the figure and
    out/section.md; returns the results."""
    spec = scaled_spec(study.SCALES, scale, steps, logit_bits)
    if models is None:
        job = partial(study.train_job, spec=spec, out=out)
        result = train_pairs(out, study.TASK, scale, spec, job, seeds, workers)
    else:
        result = evaluate_pairs(models, study.TASK, scale, spec, seeds, study.evaluate, study.EVAL_OPTIONS)
    result.update(study.RECORDED)
    write_json(out / "results.json", result)
    study.draw(result, out)
    (out / "section.md").write_text(study.markdown(result))
    return result


def evaluate_pairs(
    source: Path, task: str, scale: str, spec: FitSpec, seeds: list[int], evaluate: Callable, eval_options: tuple
) -> dict:
    """train_pairs' record for the models an earlier run of ``task`` saved in ``source`` (a report directory),
    evaluated again by ``evaluate`` (as the current code and ``spec`` say) without training anything: the learning
    curves and seconds are the earlier run's. ``spec`` must be the one they were trained with in every option but
    the evaluation's (``eval_options``, the task options only the evaluation reads, and ``logit_bits``)."""
    path = Path(source) / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: `models` must be a report directory of `difftx repro {task}`")
    trained = json.loads(path.read_text())
    if trained.get("experiment") != task:
        raise InputError(f"{source} holds a {trained.get('experiment')!r} report, not a {task} one")
    mine, theirs = _training_options(asdict(spec), eval_options), _training_options(trained["spec"], eval_options)
    for key in sorted(set(mine) | set(theirs)):
        if mine.get(key) != theirs.get(key):
            raise InputError(
                f"{source}'s models were trained with {key} = {theirs.get(key)}, the {scale} scale has "
                f"{mine.get(key)}: pass the scale they were trained at, without `steps`"
            )
    found = saved_models(source, task, seeds, "pass fewer seeds")
    evals = []
    for seed in seeds:
        for attention in ATTENTIONS:
            model = load_run(found[(attention, seed)])[0]
            with final_evaluation(spec):
                evals.append({"attention": attention, "seed": seed, **evaluate(model, spec)})
    runs = [r for r in trained["runs"] if r["seed"] in seeds]
    return {
        "experiment": task,
        "scale": scale,
        "seeds": seeds,
        "spec": asdict(spec),
        "runs": sorted(runs, key=lambda r: (r["seed"], ATTENTIONS.index(r["attention"]))),
        "evals": evals,
        "models": str(source),
    }


def _training_options(spec: dict, eval_options: tuple) -> dict:
    """A spec's options that shape training, in JSON form (tuples as lists), for comparing two specs."""
    spec = json.loads(json.dumps(spec))
    spec.pop("logit_bits", None)
    spec["task"] = {k: v for k, v in spec["task"].items() if k not in eval_options}
    return {k: v for k, v in spec.items() if k != "task"} | {f"task.{k}": v for k, v in spec["task"].items()}
