"""The training loop: steps (training/step.py: AdamW, the schedule, the step on the device), periodic validation
(loss and bits per byte), JSONL metrics with lambda per layer, crash-safe checkpoints and exact resume, on one
process or many (torchrun, DDP or FSDP2). A step reads nothing on the host; what the steps did is read at log,
validation and checkpoint steps (``Trainer._fit``).

``Trainer`` composes the run's parts, each tested alone: the run directory's lifecycle (training/run_dir.py), the
health guard (training/health.py: non-finite steps skipped and counted, loss spikes noted, a checkpoint written only
from a healthy state), the checkpoint policy (training/checkpointing.py: whole or sharded, the checks of a resume,
what a diverged run is told), the metrics (training/metrics.py, training/tracking.py) and the stop signals
(training/interrupts.py: SIGINT and SIGTERM finish the current step, or on many processes the steps to the next read
step, write a checkpoint and raise ``Interrupted``). A run that fails before its first checkpoint removes the
directory it created. The data's checksums are verified at the start.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from difftransformer.core.model import TransformerLM
from difftransformer.errors import ConfigError, InputError, Interrupted
from difftransformer.progress import Progress
from difftransformer.store.checkpoint import lowest_val_loss
from difftransformer.store.data import TokenData, WindowSampler, data_identity, eval_windows, verify_data
from difftransformer.store.runs import start_checkpoint
from difftransformer.training.checkpointing import Checkpoints, load_start, rng_state
from difftransformer.training.config import TrainConfig, resume_config
from difftransformer.training.distributed import World, all_reduce_max, init_world, parallelize
from difftransformer.training.evaluate import loss_and_bits_per_byte
from difftransformer.training.health import PROBE_WINDOWS, HealthGuard, check_health, unhealthy_parts
from difftransformer.training.interrupts import StopSignals
from difftransformer.training.metrics import MetricsLog
from difftransformer.training.run_dir import RunDirectory, run_model
from difftransformer.training.step import (
    StepResult,
    autocast_dtype,
    lr_at,
    make_optimizer,
    optimizer_step,
    read_steps,
    use_deterministic_algorithms,
    use_tf32,
)
from difftransformer.training.tracking import check_available, parse_sinks

__all__ = ["TrainConfig", "Trainer", "resume_config", "train"]


class Trainer:
    """Holds one run: model, optimizer, data, and the run directory. ``train_step()`` trains one optimizer step,
    ``fit()`` trains with logging, validation and checkpoints. ``close()`` releases the run directory.

    A new run refuses a directory that already holds something; ``resume=True`` continues the run in ``cfg.out``
    from its newest checkpoint (or from step 0 if it stopped before its first), writing only into that directory.

    Args:
        cfg: the run.
        resume: continue the run in ``cfg.out``.
        world: the process group (default: torchrun's when launched by it, else one process).
        quiet: no live progress line.
        on_step: called with every row read (step, loss, ...), e.g. for a live display.

    Examples:
        >>> from difftransformer import TrainConfig
        >>> from difftransformer.store.examples import example_data
        >>> data = example_data()  # a short text, prepared in a new temporary directory
        >>> trainer = Trainer(
        ...     TrainConfig(data=str(data), out=f"{data}-run", max_steps=2, batch_size=2, seq_len=32, eval_tokens=64),
        ...     quiet=True,
        ... )
        >>> try:
        ...     rows = trainer.fit(until=1)  # one step; fit() again trains on to max_steps
        ... finally:
        ...     trainer.close()
        >>> trainer.step_idx
        1
    """

    def __init__(
        self,
        cfg: TrainConfig,
        resume: bool = False,
        world: World | None = None,
        quiet: bool = False,
        on_step: Callable[[dict], None] | None = None,
    ):
        self.cfg, self.quiet, self.on_step = cfg, quiet, on_step
        self.world = world or init_world(cfg.device, cfg.collective_timeout)
        self.run_dir = Path(cfg.out)
        self.directory = RunDirectory(self.run_dir, self.world)
        self.note = self.directory.note
        self.metrics = MetricsLog(self.run_dir, self.world.is_main)
        self.checkpoints = Checkpoints(self.run_dir, self.world, cfg.keep_last, cfg.keep_best)
        self.guard = HealthGuard(cfg.max_nonfinite_steps, self.note, self.checkpoints.calm)
        self.saved_step: int | None = None
        self.start: Path | None = None  # the checkpoint an init_from run starts from
        self._shown_loss: float | None = None  # the latest training loss read, for the progress line
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.deterministic:
            use_deterministic_algorithms()
        try:
            self._setup(resume)
        except BaseException:
            self._remove_failed_start()
            self.close()
            raise

    def _setup(self, resume: bool) -> None:
        cfg = self.cfg
        if self.world.is_main:
            check_available(parse_sinks(cfg.log_to))
        if resume:
            self.directory.open_existing(Path(cfg.data))
        else:
            self.directory.check_new()
        self.train_data, self.val_data = TokenData(cfg.data, "train"), TokenData(cfg.data, "val")
        data_tok = self.train_data.manifest["tokenizer"]["fingerprint"]
        self.data_record = {"path": str(Path(cfg.data).resolve()), "id": data_identity(self.train_data.manifest)}
        self.tokenizer = self.train_data.tokenizer()
        vocab = self.train_data.manifest["tokenizer"]["vocab_size"]
        self.model_config, self.start = run_model(cfg, self.run_dir, resume, data_tok, vocab)
        cfg.resolve_seq_len(self.model_config)
        if cfg.batch_size % (cfg.grad_accum * self.world.size):
            raise InputError(
                f"batch_size {cfg.batch_size} does not split into grad_accum {cfg.grad_accum} x "
                f"{self.world.size} processes"
            )
        self.sampler = WindowSampler(self.train_data, cfg.seq_len, cfg.batch_size, cfg.seed)
        self.val_windows = eval_windows(self.val_data, cfg.seq_len, cfg.eval_tokens)
        self.token_bytes = torch.from_numpy(self.tokenizer.token_bytes())
        if self.world.is_main:
            verify_data(cfg.data)
        torch.manual_seed(cfg.seed)
        with torch.device(self.world.device):
            model = TransformerLM(self.model_config)
        saved = self.checkpoints.listed() if resume else []
        if cfg.init_from and not saved:
            self.start = self.start or start_checkpoint(cfg.init_from)[1]
            load_start(model, self.start, self.model_config, self.tokenizer)
        self.amp = autocast_dtype(cfg, self.world.device)
        self.tf32 = use_tf32(self.world.device, self.amp)
        self.model = parallelize(model, cfg.parallel, self.world, cfg.compile, cfg.checkpoint_activations, self.amp)
        self.optimizer = make_optimizer(self.model, cfg)
        self.step_idx = 0
        live = self.world.is_main and not self.quiet
        self.progress = Progress(cfg.max_steps, f"train {self.run_dir.name}", enabled=live, watch_pace=True)
        self.probe = self.val_windows[:PROBE_WINDOWS]
        if saved:
            self._load_newest(saved[-1])
        else:
            self.guard.begin(*self._health(), self.start)
        self.first_step = self.step_idx
        if resume and not saved:
            self.note(f"{self.run_dir} has no checkpoint yet: the run starts again from step 0")
            self.metrics.restart()
        if resume:
            self.directory.write_recipe(cfg.recipe())
        else:
            self.directory.create(cfg.recipe(), self.model_config, self.tokenizer)
        self.metrics.open(cfg.log_to, cfg.recipe())
        if (note := cfg.passes_note(self.train_data.n_tokens)) is not None:
            self.note(note)

    def _health(self) -> tuple[list[float], float]:
        return check_health(self.model, self.optimizer, self.probe, self.world, self.amp)

    def _load_newest(self, newest: Path) -> None:
        """Go on from the run's newest checkpoint: weights, optimizer, guard, step, generator and metrics."""
        cfg = self.cfg
        model, optimizer = self.model, self.optimizer
        meta = self.checkpoints.load(newest, model, optimizer, self.model_config, self.tokenizer, cfg.recipe())
        flags, loss = self._health()
        if min(flags) < 1:
            raise self.checkpoints.unhealthy(flags, cfg.lr)
        self.guard.restore(meta, loss)
        self.step_idx = self.saved_step = meta["step"]
        torch.set_rng_state(rng_state(meta, newest))
        if self.step_idx > cfg.max_steps:
            raise ConfigError(
                "TrainConfig",
                "max_steps",
                f"{cfg.max_steps} is below the step the run {self.run_dir} has reached, {self.step_idx}; give a "
                "larger one to train further",
            )
        if (recorded := meta.get("data", {}).get("id")) is not None and recorded != self.data_record["id"]:
            self.note(
                f"the data in {cfg.data} differs from the data step {self.step_idx} was trained on (prepared "
                "again?); training goes on with it, so the run will differ from one that was never interrupted"
            )
        self.metrics.keep_to(self.step_idx, self.note)  # the rows after the checkpoint will be written again

    def metric_rows(self) -> list[dict]:
        """The rows of metrics.jsonl (store/runs.read_metrics): the run's, from its first step."""
        return self.metrics.rows()

    def best_checkpoint(self) -> tuple[Path, float] | None:
        """The kept checkpoint with the lowest validation loss and that loss (checkpoints record it with
        keep_best, which validates at each); None when none records one."""
        return lowest_val_loss(self.checkpoints.listed())

    def _remove_failed_start(self) -> bool:
        """A run that fails before its first checkpoint leaves nothing behind in a directory it created."""
        if self.saved_step is not None or not (self.directory.created and self.world.is_main):
            return False
        self.metrics.close()
        return self.directory.remove_created()

    def close(self) -> None:
        """Close the metric sinks and release the run directory (another trainer may then resume it)."""
        self.metrics.close()
        self.directory.release()

    def log(self, row: dict) -> None:
        self.metrics.write(row)

    def save(self, val_loss: float | None = None) -> Path | None:
        """Write a checkpoint of the current step (once per step) if the state is healthy, else raise
        TrainingDiverged; returns its directory on the main process. ``val_loss``: the validation loss of these
        weights, recorded for keep_best."""
        flags, probe = self._health()
        if min(flags) < 1:
            raise self._diverged(f"at step {self.step_idx}, {unhealthy_parts(flags)}")
        calm = self.guard.calm_at(self.step_idx, probe)
        meta = {}
        if self.world.is_main:  # what state.json records besides the files and the optimizer's settings
            meta = {
                "data_position": self.step_idx,  # the next global batch index
                "rng_torch": torch.get_rng_state().tolist(),
                **self.guard.state(),
                "health": {"probe_loss": probe, "calm": calm},
                "model_config": self.model_config.to_dict(),
                "train_config": self.cfg.recipe(),
                "tokenizer": self.tokenizer.fingerprint(),
                "data": self.data_record,
                **({} if val_loss is None else {"val_loss": val_loss}),
            }
        path = self.checkpoints.write(self.model, self.optimizer, self.step_idx, meta)
        self.saved_step = self.step_idx
        return path

    def _diverged(self, reason: str):
        removed = self.directory.created and self.saved_step is None  # fit() removes it
        return self.checkpoints.diverged(reason, self.step_idx, self.cfg.lr, self.cfg.init_from, removed)

    # training ------------------------------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        """One optimizer step, left on the device (``.row()`` reads it). A non-finite loss or gradient norm skips
        the update."""
        cfg, parts = self.cfg, self.world.size * self.cfg.grad_accum
        micro_batches = [
            self.sampler.batch(self.step_idx, self.world.rank * cfg.grad_accum + micro, parts)
            for micro in range(cfg.grad_accum)
        ]
        lr = lr_at(self.step_idx, cfg)
        result = optimizer_step(
            self.model, self.optimizer, micro_batches, lr, cfg.grad_clip, self.world.device, self.amp
        )
        self.step_idx += 1
        return result

    def validate(self) -> tuple[float, float]:
        return loss_and_bits_per_byte(
            self.model, self.val_windows, self.token_bytes, amp=self.amp, device=self.world.device
        )

    def fit(self, until: int | None = None) -> list[dict]:
        """Train to ``until`` (default max_steps), logging, validating and checkpointing on the configured
        intervals; returns the logged rows. Raises TrainingDiverged or, after a checkpoint, Interrupted."""
        try:
            with StopSignals() as signals:
                return self._fit(until, signals)
        except BaseException as err:
            if not isinstance(err, Interrupted):
                removed = self._remove_failed_start()
                if removed and isinstance(err, OSError) and err.errno is not None:  # a first checkpoint not written
                    raise OSError(
                        err.errno, f"{err.strerror}; {self.run_dir}, which held no checkpoint, was removed: start again"
                    ) from err
            raise

    def _fit(self, until: int | None, signals: StopSignals) -> list[dict]:
        """The steps run on the device without a read on the host; what they did is read at a **read step**: a
        log, evaluation or checkpoint step, the last step of this call, and (on one process) a step after a stop
        signal. Each read is one synchronisation for every step since the last (losses, gradient norms, skips),
        lambda per layer, and, on many processes, the agreed stop flag (a signal stops the run at the next read
        step, the same step on every process)."""
        cfg = self.cfg
        stop = cfg.max_steps if until is None else min(until, cfg.max_steps)
        tokens_per_step = cfg.batch_size * cfg.seq_len
        start, start_step, logged = time.perf_counter(), self.step_idx, []
        self.progress.begin(start_step, start_step * tokens_per_step)
        pending: list[tuple[int, StepResult, float]] = []
        while self.step_idx < stop:
            result = self.train_step()
            step = self.step_idx
            pending.append((step, result, time.perf_counter()))
            checkpoint = step % cfg.ckpt_interval == 0 or step == cfg.max_steps
            evaluate = step % cfg.eval_interval == 0 or step == cfg.max_steps or (checkpoint and cfg.keep_best)
            logs = step % cfg.log_interval == 0
            signalled = self.world.size == 1 and bool(signals.received)  # a host flag: reading it costs nothing
            if not (evaluate or checkpoint or logs or signalled or step == stop):
                self.progress.update(step, step * tokens_per_step, self._shown_loss)
                continue
            flag = torch.tensor([signals.received or 0], device=self.world.device, dtype=torch.float32)
            lambdas = self.model if logs or evaluate else None
            rows, signum = read_steps(pending, all_reduce_max(flag), lambdas, tokens_per_step, start, start_step)
            pending, val_loss = [], None
            for row in rows:
                if (reason := self.guard.observe(row)) is not None:
                    raise self._diverged(reason)
                if row["step"] == step and evaluate:
                    row["val_loss"], row["val_bpb"] = self.validate()
                    val_loss = row["val_loss"]
                if row["step"] % cfg.log_interval == 0 or "val_loss" in row or "skipped" in row or "spike" in row:
                    self.metrics.write(row)
                    logged.append(row)
                if "val_loss" in row and self.progress.enabled:
                    self.progress.write(f"step {step}: validation loss {row['val_loss']:.4f}", stream=sys.stderr)
                self._shown_loss = row["loss"]
                if self.on_step is not None:
                    self.on_step(row)
            self.progress.update(step, step * tokens_per_step, self._shown_loss)
            if checkpoint:
                self.save(val_loss)
            if signum:
                self.progress.close()
                path = self.save() if self.saved_step != step else self.checkpoints.listed()[-1]
                raise Interrupted(signum, f"stopped by {signals.name(signum)} at step {step}; checkpoint {path}")
        if self.step_idx == cfg.max_steps and self.step_idx > self.first_step and not self.guard.updated:
            self.progress.close()
            raise self._diverged(
                f"every step from {self.first_step + 1} to {self.step_idx} had a non-finite loss or gradient and was "
                "skipped, so the weights never changed"
            )
        if self.step_idx == cfg.max_steps:
            self.progress.close()
        return logged


def train(cfg: TrainConfig, resume: bool = False, quiet: bool = False) -> list[dict]:
    """Train (or resume) the run ``cfg`` describes to its end, as ``difftx train`` does.

    Args:
        cfg: the run: its data, output directory, model and recipe.
        resume: continue the run in ``cfg.out`` from its newest checkpoint (``resume_config`` gives its config).
        quiet: no live progress line.

    Returns:
        The rows logged to metrics.jsonl by this call (step, loss, learning rate, validation loss, ...).

    Raises:
        TrainingDiverged: too many steps in a row with a non-finite loss or gradient, or an unhealthy state; the
            message names the checkpoint to start again from.
        Interrupted: SIGINT or SIGTERM, after a checkpoint was written.

    Examples:
        >>> from difftransformer import TrainConfig, train
        >>> from difftransformer.store.examples import example_data
        >>> data = example_data()  # a short text, prepared in a new temporary directory
        >>> cfg = TrainConfig(data=str(data), out=f"{data}-run", max_steps=2, batch_size=2, seq_len=32, eval_tokens=64)
        >>> rows = train(cfg, quiet=True)
        >>> rows[-1]["step"], "val_loss" in rows[-1]
        (2, True)
    """
    trainer = Trainer(cfg, resume=resume, quiet=quiet)
    try:
        return trainer.fit()
    finally:
        trainer.close()
