"""The training loop: steps (training/step.py: AdamW, the schedule, the step on the device), periodic validation
(loss and bits per byte), JSONL metrics with lambda per layer, crash-safe checkpoints and exact resume, on one
process or many (torchrun, DDP or FSDP2). A step reads nothing on the host; what the steps did is read at log,
validation and checkpoint steps (``Trainer._fit``).

Guards: a step whose loss or gradient is not finite is skipped (logged, the weights untouched) and
``max_nonfinite_steps`` of them in a row stop the run (``TrainingDiverged``), as does a resume whose every step is
skipped. A checkpoint is written only when the state is healthy (training/health.py: finite weights, optimizer
state and probe loss); an unhealthy one stops the run instead, so that a diverged state never replaces a healthy
checkpoint, and loading one (resume, ``init_from``) is refused. A loss spike is noted. Each stop names the
checkpoint to start again from. SIGINT and SIGTERM finish the current step (many processes: the steps to the next
read step), write a checkpoint and raise ``Interrupted``. A run that fails before its first checkpoint removes the
directory it created. The data's checksums are verified at the start.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from difftransformer.core.attention.gqa_layout import own_layout
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.errors import ConfigError, InputError, Interrupted, TrainingDiverged
from difftransformer.fsutil import check_new_dir, shell, write_text_atomic
from difftransformer.progress import Progress
from difftransformer.store.checkpoint import (
    PREFIX,
    SHARDED_TAG,
    checkpoint_tmp_dir,
    clean_stale,
    list_checkpoints,
    load_checkpoint,
    load_model,
    lowest_val_loss,
    new_checkpoint_dir,
    newest_calm,
    pieces,
    publish_checkpoint,
    read_state,
    refuse_foreign_checkpoints,
    save_checkpoint,
    use_earlier,
    write_failed,
    write_pieces,
)
from difftransformer.store.data import TokenData, WindowSampler, data_identity, eval_windows, verify_data
from difftransformer.store.runs import (
    LOCK,
    METRICS,
    MODEL_CONFIG,
    TRAIN_CONFIG,
    RunLock,
    being_written,
    check_optimizer_state,
    check_recorded,
    check_weights,
    is_unstarted_run,
    read_metrics,
    refuse_changed,
    refuse_links,
    refuse_quantized,
    start_checkpoint,
    writer_of,
)
from difftransformer.store.tokenizer import load_tokenizer
from difftransformer.training.config import RESUMABLE, TrainConfig, resume_config
from difftransformer.training.distributed import (
    World,
    all_gather_objects,
    all_reduce_max,
    barrier,
    full_state,
    init_world,
    is_sharded,
    load_full_state,
    load_pieces,
    parallelize,
    sharded_pieces,
    unwrap,
)
from difftransformer.training.evaluate import loss_and_bits_per_byte
from difftransformer.training.health import PROBE_WINDOWS, SPIKE_FACTOR, LossWatch, state_flags, unhealthy_parts
from difftransformer.training.interrupts import StopSignals
from difftransformer.training.step import (
    StepResult,
    autocast_dtype,
    lambda_values,
    lr_at,
    make_optimizer,
    optimizer_step,
    read,
    rounded_lambdas,
    use_deterministic_algorithms,
    use_tf32,
)
from difftransformer.training.tracking import check_available, open_sinks, parse_sinks

__all__ = ["TrainConfig", "Trainer", "resume_config", "train"]

OVERFIT_PASSES = 4  # passes over the training tokens past which a run is told it may overfit


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
        >>> import tempfile
        >>> from difftransformer import TrainConfig, train
        >>> from difftransformer.store.data import prepare
        >>> from difftransformer.store.tokenizer import ByteTokenizer
        >>> tmp = tempfile.mkdtemp()
        >>> texts = ["To be, or not to be. " * 100] * 20
        >>> _ = prepare(texts, ByteTokenizer(), f"{tmp}/data", split="documents", val_every=10)
        >>> cfg = TrainConfig(data=f"{tmp}/data", out=f"{tmp}/run", max_steps=2, batch_size=2, seq_len=32,
        ...                   eval_tokens=64)
        >>> trainer = Trainer(cfg, quiet=True)
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
        self.lock: RunLock | None = None
        self.created_dir = False  # this process made the run directory: a failed start removes it
        self.saved_step: int | None = None
        self.nonfinite_in_a_row = 0
        self.watch = LossWatch()
        self.start: Path | None = None  # the checkpoint an init_from run starts from
        self.updated = False  # whether a step of this trainer has changed the weights (all skipped: diverged)
        self.probe_best = math.inf  # the lowest probe loss of the run so far (training/health.py)
        self._shown_loss: float | None = None  # the latest training loss read, for the progress line
        self.sinks: list = []  # where metrics go besides metrics.jsonl (training/tracking.py), on the main process
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
        if not resume and (pid := writer_of(self.run_dir)) is not None:  # not "remove it" while another writes it
            raise InputError(f"{being_written(self.run_dir, pid)}, or choose another `out`")
        if resume:
            self._open_existing_run()
        elif self.run_dir.exists() and is_unstarted_run(self.run_dir):
            raise FileExistsError(
                f"run directory {self.run_dir} holds a run that stopped before its first checkpoint; resume it "
                f"(difftx train --resume {shell(self.run_dir)}: it starts again from step 0) or remove it"
            )
        elif (newest := list_checkpoints(self.run_dir)) and (self.run_dir / TRAIN_CONFIG).is_file():
            step = int(newest[-1].name.removeprefix(PREFIX))
            raise FileExistsError(
                f"run directory {self.run_dir} holds a run (at step {step}); to train it further: difftx train "
                f"--resume {shell(self.run_dir)} --max-steps N; to start another run, choose another `out`"
            )
        else:
            check_new_dir(self.run_dir, "run directory")
        self.train_data = TokenData(cfg.data, "train")
        self.val_data = TokenData(cfg.data, "val")
        data_tok = self.train_data.manifest["tokenizer"]
        self.data_record = {"path": str(Path(cfg.data).resolve()), "id": data_identity(self.train_data.manifest)}
        self.tokenizer = self.train_data.tokenizer()
        if resume:
            run_tok = load_tokenizer(self.run_dir)
            if run_tok.fingerprint() != data_tok["fingerprint"]:
                raise InputError(
                    f"the data in {cfg.data} was tokenised with {data_tok['fingerprint']}, but the run {self.run_dir} "
                    f"uses {run_tok.fingerprint()}: resume with data prepared with the run's tokenizer"
                )
            self.model_config = ModelConfig.from_json(self.run_dir / MODEL_CONFIG)
        elif cfg.init_from:
            start_run, self.start = start_checkpoint(cfg.init_from)
            refuse_quantized(start_run, "start a run from it")
            self.model_config = ModelConfig.from_json(start_run / MODEL_CONFIG)
            self._take_model_from(start_run)
            start_tok = load_tokenizer(start_run)
            if start_tok.fingerprint() != data_tok["fingerprint"]:
                raise InputError(
                    f"the run {start_run} (init_from) uses the tokenizer {start_tok.fingerprint()}, the data in "
                    f"{cfg.data} {data_tok['fingerprint']}: prepare the data with that run's tokenizer"
                )
        else:
            self.model_config = cfg.model_config(data_tok["vocab_size"])
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
        self.checkpoints = list_checkpoints(self.run_dir) if resume else []
        if cfg.init_from and not self.checkpoints:
            self.start = self.start or start_checkpoint(cfg.init_from)[1]
            tensors, meta = load_model(self.start)
            check_recorded(self.start, meta, self.model_config, self.tokenizer)
            check_weights(model, tensors, str(self.start), str(self.start.parent.parent / MODEL_CONFIG))
            with own_layout():
                model.load_state_dict(tensors, strict=True)
        self.amp = autocast_dtype(cfg, self.world.device)
        self.tf32 = use_tf32(self.world.device, self.amp)
        self.model = parallelize(model, cfg.parallel, self.world, cfg.compile, cfg.checkpoint_activations, self.amp)
        self.optimizer = make_optimizer(self.model, cfg)
        self.step_idx = 0
        live = self.world.is_main and not self.quiet
        self.progress = Progress(cfg.max_steps, f"train {self.run_dir.name}", enabled=live, watch_pace=True)
        self.probe = self.val_windows[:PROBE_WINDOWS]
        if self.checkpoints:
            self._load_newest()
        else:
            self._check_start()
        self.first_step = self.step_idx
        if resume and not self.checkpoints:
            self._note(f"{self.run_dir} has no checkpoint yet: the run starts again from step 0")
            if self.world.is_main:
                write_text_atomic(self.run_dir / METRICS, "")
        if resume:
            self._write_train_config()
        else:
            self._start_run_dir()
        if self.world.is_main:
            self.sinks = open_sinks(parse_sinks(cfg.log_to), self.run_dir, self.metric_rows(), self._recipe())
        self._note_passes()

    def _note_passes(self) -> None:
        """A note when the run reads its training tokens more than OVERFIT_PASSES times: past a few passes a model
        memorises its data (validation loss rises while training loss falls)."""
        cfg = self.cfg
        have = self.train_data.n_tokens
        passes = cfg.max_steps * cfg.batch_size * cfg.seq_len / have
        if passes <= OVERFIT_PASSES:
            return
        keep = (
            "keep_best keeps the checkpoint with the lowest validation loss"
            if cfg.keep_best
            else "to keep the checkpoint with the lowest validation loss, set keep_best (difftx train --keep-best); "
            "or train on more data or for fewer steps"
        )
        self._note(
            f"this run reads its {have:,} training tokens {passes:.1f} times over ({cfg.max_steps:,} steps of "
            f"{cfg.batch_size} x {cfg.seq_len} tokens): after about {OVERFIT_PASSES} passes a model starts to "
            f"memorise its training text and its validation loss to rise; {keep}"
        )

    def best_checkpoint(self) -> tuple[Path, float] | None:
        """The kept checkpoint with the lowest validation loss and that loss (checkpoints record it with
        keep_best, which validates at each); None when none records one."""
        return lowest_val_loss(list_checkpoints(self.run_dir))

    # run directory -------------------------------------------------------------------------------------------
    def _start_run_dir(self) -> None:
        if self.world.is_main:
            try:
                self.run_dir.mkdir(parents=True)
                created = True
            except FileExistsError:
                created = False
            self.lock = RunLock(self.run_dir)
            self.created_dir = created
            check_new_dir(self.run_dir, "run directory", allow=(LOCK,))  # again, now that no one else can write
            self._write_train_config()
            self.model_config.to_json(self.run_dir / MODEL_CONFIG)
            self.tokenizer.save(self.run_dir)
            (self.run_dir / METRICS).write_text("")

    def _recipe(self) -> dict:
        """The training config as this run now trains (absolute paths, and what a resume changed): what
        train_config.json and every checkpoint's state.json record."""
        saved = self.cfg.to_dict()
        for name in ("data", "init_from"):
            if saved[name] is not None:
                saved[name] = str(Path(saved[name]).resolve())
        return saved

    def _write_train_config(self) -> None:
        if self.world.is_main:
            write_text_atomic(self.run_dir / TRAIN_CONFIG, json.dumps(self._recipe(), indent=2) + "\n")

    def _open_existing_run(self) -> None:
        """Lock the run (none of whose entries may be a link), tidy what killed writes left, and find its data."""
        if self.world.is_main:
            refuse_links(self.run_dir)
            refuse_foreign_checkpoints(self.run_dir)
            self.lock = RunLock(self.run_dir)
            for line in clean_stale(self.run_dir):
                self._note(line)
        barrier()
        data = Path(self.cfg.data)
        if not (data / "manifest.json").is_file():
            raise ConfigError(
                "TrainConfig",
                "data",
                f"{data} of the run {self.run_dir} is not there (moved or deleted?); give its new location with "
                "`data` (data prepared with the run's tokenizer)",
            )

    def _take_model_from(self, start_run: Path) -> None:
        """A run started from another's weights has that run's model: `model` overrides and another `attention`
        are refused (they would be ignored), and the config records what the run is (no preset)."""
        cfg = self.cfg
        source = f"`init_from` {cfg.init_from} is a {self.model_config.attention!r} model (its model_config.json)"
        if cfg.model:
            raise ConfigError("TrainConfig", "model", f"cannot be given with {source}: drop it")
        if cfg.attention != self.model_config.attention:
            raise ConfigError("TrainConfig", "attention", f"is {cfg.attention!r}, but {source}: drop it")
        cfg.preset = None

    def _health(self) -> tuple[list[float], float]:
        """(for weights, optimizer state and probe loss: 0 where any process found it non-finite, else 1; the
        probe loss), with one host synchronisation."""
        flags, loss = state_flags(self.model, self.optimizer, self.probe, self.world.device, self.amp)
        values = torch.cat([all_reduce_max(1 - flags), loss.detach().float().reshape(1)]).tolist()
        return [1 - v for v in values[:3]], values[3]

    def _check_start(self) -> None:
        """The weights a new run starts from give a finite loss (a checkpoint of a diverged run does not); their
        probe loss is the run's first lowest."""
        flags, loss = self._health()
        if min(flags) < 1:
            if self.start is None:  # fresh weights: a defect, not something the user can change
                raise RuntimeError(f"the initial weights are not healthy: {unhealthy_parts(flags)}")
            raise InputError(
                f"{self.start} (init_from) is not healthy: {unhealthy_parts(flags)} (that run "
                "diverged); give an earlier checkpoint of it as `init_from` (its checkpoints/step_N directory)"
            )
        self.probe_best = loss

    def _check_recipe(self, checkpoint: Path, recorded: dict | None) -> None:
        """train_config.json holds the recipe ``checkpoint`` was trained with (what a resume may change aside): one
        replaced by another run's would go on training these weights with another recipe."""
        if recorded is None:
            return
        now = self._recipe()
        skip = {*RESUMABLE, "init_from", *(set(recorded) - set(now))}  # init_from: used before the first checkpoint
        what = f"the recipe {checkpoint.name} was trained with"
        refuse_changed(self.run_dir / TRAIN_CONFIG, what, now, recorded, skip)

    def _load_newest(self) -> None:
        newest = self.checkpoints[-1]
        if is_sharded(self.model):  # FSDP: each process reads its part of every tensor, from pieces or whole files
            meta = read_state(newest)
            model_pieces, optim_pieces = pieces(newest, "model", meta), pieces(newest, "optimizer", meta)
            model_sd = {n: torch.empty(model_pieces.shape(n), device="meta") for n in model_pieces.names()}  # shapes
        else:  # one process or DDP: whole tensors (a sharded checkpoint's pieces assembled)
            model_sd, optim_sd, meta = load_checkpoint(newest)
        check_recorded(newest, meta, self.model_config, self.tokenizer)
        self._check_recipe(newest, meta.get("train_config"))
        check_weights(unwrap(self.model), model_sd, str(newest), str(self.run_dir / MODEL_CONFIG))
        if not is_sharded(self.model):
            groups = len(self.optimizer.param_groups)
            check_optimizer_state(unwrap(self.model), optim_sd, f"checkpoint {newest}", groups)
        with own_layout():
            if is_sharded(self.model):
                load_pieces(self.model, self.optimizer, model_pieces, optim_pieces, meta.pop("optimizer"))
            else:
                load_full_state(self.model, self.optimizer, model_sd, optim_sd)
        flags, loss = self._health()
        if min(flags) < 1:
            earlier = self.checkpoints[-2].name if len(self.checkpoints) > 1 else None
            raise TrainingDiverged(
                f"the newest checkpoint of {self.run_dir}, {newest.name}, is not healthy: {unhealthy_parts(flags)} "
                "(the run had diverged when it was written, by a version that did not check). "
                + (
                    f"To resume from the one before it ({earlier}), move it away: mv {shell(newest)} "
                    f"{shell(newest.parent / ('diverged-' + newest.name))}; or start a new run from an earlier "
                    "checkpoint with `init_from` and a lower `lr`"
                    if earlier
                    else f"It is the run's only checkpoint: start again with a lower `lr` (e.g. {self._lower_lr():g})"
                ),
                lr=None if earlier else self._lower_lr(),
            )
        self.probe_best = min(meta.get("probe_best", loss), loss)
        self.watch = LossWatch(meta.get("loss_watch"))
        self.step_idx = self.saved_step = meta["step"]
        self.nonfinite_in_a_row = meta.get("nonfinite_in_a_row", 0)
        torch.set_rng_state(_rng_state(meta, newest))
        if self.step_idx > self.cfg.max_steps:
            raise ConfigError(
                "TrainConfig",
                "max_steps",
                f"{self.cfg.max_steps} is below the step the run {self.run_dir} has reached, {self.step_idx}; give a "
                "larger one to train further",
            )
        recorded = meta.get("data", {}).get("id")
        if recorded is not None and recorded != self.data_record["id"]:
            self._note(
                f"the data in {self.cfg.data} differs from the data step {self.step_idx} was trained on (prepared "
                "again?); training goes on with it, so the run will differ from one that was never interrupted"
            )
        if self.world.is_main:  # drop metrics written after the checkpoint: they will be written again
            rows, torn = read_metrics(self.run_dir)
            if torn:
                self._note(f"{self.run_dir / METRICS} has lines that are not JSON (line {torn[0]}); they are dropped")
            kept = "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= self.step_idx)
            write_text_atomic(self.run_dir / METRICS, kept)

    def metric_rows(self) -> list[dict]:
        """The rows of metrics.jsonl (store/runs.read_metrics): the run's, from its first step."""
        return read_metrics(self.run_dir)[0]

    def _remove_failed_start(self) -> bool:
        """A run that fails before its first checkpoint leaves nothing behind in a directory it created; True when
        it removed the directory."""
        if self.created_dir and self.saved_step is None and self.world.is_main:
            self._close_sinks()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.created_dir = False
            return True
        return False

    def close(self) -> None:
        """Close the metric sinks and release the run directory (another trainer may then resume it)."""
        self._close_sinks()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _close_sinks(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def _note(self, text: str) -> None:
        if self.world.is_main:
            print(f"note: {text}", file=sys.stderr, flush=True)

    def save(self, val_loss: float | None = None) -> Path | None:
        """Write a checkpoint of the current step (once per step) if the state is healthy, else raise
        TrainingDiverged; returns its directory on the main process. ``val_loss``: the validation loss of these
        weights, recorded for keep_best."""
        flags, probe = self._health()
        if min(flags) < 1:
            raise self._diverged(f"at step {self.step_idx}, {unhealthy_parts(flags)}")
        calm = probe <= SPIKE_FACTOR * self.probe_best
        if not calm:
            self._note(
                f"step {self.step_idx}: this checkpoint is written during a loss spike (its probe loss {probe:.4g} is "
                f"over {SPIKE_FACTOR} times the run's lowest, {self.probe_best:.4g}); keep-last keeps the newest "
                "checkpoint from before the spike too"
            )
        self.probe_best = min(self.probe_best, probe)
        meta = self._checkpoint_meta(probe, calm, val_loss) if self.world.is_main else {}
        if is_sharded(self.model):
            path = self._save_pieces(meta)
        else:
            path = self._save_whole(meta)
        self.saved_step = self.step_idx
        return path

    def _checkpoint_meta(self, probe: float, calm: bool, val_loss: float | None) -> dict:
        """What a checkpoint's state.json records besides its files and the optimizer's settings."""
        meta = {
            "data_position": self.step_idx,  # the next global batch index
            "rng_torch": torch.get_rng_state().tolist(),
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "health": {"probe_loss": probe, "calm": calm},
            "probe_best": self.probe_best,
            "loss_watch": self.watch.state(),
            "model_config": self.model_config.to_dict(),
            "train_config": self._recipe(),
            "tokenizer": self.tokenizer.fingerprint(),
            "data": self.data_record,
        }
        if val_loss is not None:
            meta["val_loss"] = val_loss
        return meta

    def _save_whole(self, meta: dict) -> Path | None:
        """A checkpoint of whole tensors (one process, DDP): gathered, written by the main process."""
        model_sd, optim_sd = full_state(self.model, self.optimizer)
        if not self.world.is_main:
            return None
        return save_checkpoint(
            self.run_dir, self.step_idx, model_sd, optim_sd, meta, self.cfg.keep_last, self.cfg.keep_best
        )

    def _save_pieces(self, meta: dict) -> Path | None:
        """A sharded checkpoint (FSDP): every process writes its pieces of every tensor into the same temporary
        directory, nothing gathered; the main process then publishes it (state.json with every file's digest, the
        rename). A process that fails to write makes every process fail, with its error, and nothing is replaced."""
        world, step = self.world, self.step_idx
        if world.is_main:
            new_checkpoint_dir(self.run_dir, step, SHARDED_TAG)
        barrier()  # the directory exists before anyone writes into it
        tmp = checkpoint_tmp_dir(self.run_dir, step, SHARDED_TAG)
        files, failure = {}, None
        try:
            model_pieces, optim_pieces, optim_meta = sharded_pieces(self.model, self.optimizer, world.rank)
            for kind, pieces in (("model", model_pieces), ("optimizer", optim_pieces)):
                name, digest = write_pieces(tmp, kind, world.rank, world.size, pieces)
                files[name] = digest
        except OSError as err:
            failure = err
        gathered = all_gather_objects((files, None if failure is None else (failure.errno, str(failure))))
        failed = [(rank, err) for rank, (_, err) in enumerate(gathered) if err is not None]
        if failed:
            rank, (number, text) = failed[0]
            raise write_failed(self.run_dir, step, tmp, OSError(number, f"process {rank}: {text}"))
        path = None
        if world.is_main:
            every = {name: digest for done, _ in gathered for name, digest in done.items()}
            meta = {**meta, "optimizer": optim_meta, "sharded": {"processes": world.size}}
            path = publish_checkpoint(self.run_dir, step, tmp, every, meta, self.cfg.keep_last, self.cfg.keep_best)
        barrier()
        return path

    def log(self, row: dict) -> None:
        if self.world.is_main:
            with open(self.run_dir / METRICS, "a") as f:
                f.write(json.dumps(row) + "\n")
            for sink in self.sinks:
                sink.write(row)

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
            rows, signum = self._read(pending, signals, logs or evaluate, start, start_step)
            pending, val_loss = [], None
            for row in rows:
                self.updated = self.updated or "skipped" not in row
                self._guard(row)
                if row["step"] == step and evaluate:
                    row["val_loss"], row["val_bpb"] = self.validate()
                    val_loss = row["val_loss"]
                if row["step"] % cfg.log_interval == 0 or "val_loss" in row or "skipped" in row or "spike" in row:
                    self.log(row)
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
                path = self.save() if self.saved_step != step else list_checkpoints(self.run_dir)[-1]
                raise Interrupted(signum, f"stopped by {signals.name(signum)} at step {step}; checkpoint {path}")
        if self.step_idx == cfg.max_steps and self.step_idx > self.first_step and not self.updated:
            self.progress.close()
            raise self._diverged(
                f"every step from {self.first_step + 1} to {self.step_idx} had a non-finite loss or gradient and was "
                "skipped, so the weights never changed"
            )
        if self.step_idx == cfg.max_steps:
            self.progress.close()
        return logged

    def _read(
        self,
        pending: list[tuple[int, StepResult, float]],
        signals: StopSignals,
        lambdas: bool,
        start: float,
        start_step: int,
    ) -> tuple[list[dict], int]:
        """The rows of the ``pending`` (step, result, time dispatched) steps, with tokens/s since ``start_step``
        began at ``start`` (the last row with lambda per layer when ``lambdas``), and the stop signal every process
        agrees on (the largest), in one read; every process calls it at the same steps."""
        tokens_per_step = self.cfg.batch_size * self.cfg.seq_len
        lams = lambda_values(self.model) if lambdas else None
        flag = all_reduce_max(torch.tensor([signals.received or 0], device=self.world.device, dtype=torch.float32))
        extra = flag if lams is None else torch.cat([flag, lams.to(flag.device)])
        rows, values = read([result for _, result, _ in pending], extra)
        done = time.perf_counter()  # after the read: every step so far has finished on the device
        for (step, _, t), row in zip(pending, rows, strict=True):
            seconds = (done if step == pending[-1][0] else t) - start
            speed = (step - start_step) * tokens_per_step / seconds
            row.update(step=step, tokens=step * tokens_per_step, tokens_per_s=round(speed, 1))
        if lams is not None:
            rows[-1]["lambda"] = rounded_lambdas(values[1:])
        return rows, int(values[0])

    def _guard(self, row: dict) -> None:
        """Note a loss spike; count skipped steps in a row and stop the run when there are max_nonfinite_steps."""
        if self.watch.update(row["step"], row["loss"]):
            row["spike"] = True
            calm = newest_calm(self.run_dir) if self.world.is_main else None
            self._note(
                f"step {row['step']}: the training loss, smoothed over about four steps, has risen to "
                f"{self.watch.smoothed:.4g}, over {SPIKE_FACTOR} times its lowest ({self.watch.lowest:.4g} at step "
                f"{self.watch.lowest_step}): a loss spike, which often comes before divergence. If it keeps rising, "
                "stop the run and start a new one with a lower learning rate "
                + (
                    f"from {calm}, the newest checkpoint from before it"
                    if calm
                    else "(no checkpoint is from before it)"
                )
            )
        if "skipped" not in row:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_in_a_row += 1
        limit = self.cfg.max_nonfinite_steps
        self._note(
            f"step {row['step']}: {row['skipped']} (loss {row['loss']}, gradient norm {row['grad_norm']}): the update "
            f"was skipped ({self.nonfinite_in_a_row} in a row; the run stops at {limit})"
        )
        if self.nonfinite_in_a_row >= limit:
            raise self._diverged(f"{limit} steps in a row (to step {row['step']}) had a non-finite loss or gradient")

    def _lower_lr(self) -> float:
        """The learning rate a diverged run's message suggests: a tenth of its own, to 3 digits."""
        return float(f"{self.cfg.lr / 10:.3g}")

    def _diverged(self, reason: str) -> TrainingDiverged:
        """The error that stops a diverged run: what happened, which checkpoint is intact and how to go on."""
        checkpoints = list_checkpoints(self.run_dir)
        calm = newest_calm(self.run_dir)
        lr = self._lower_lr()
        if not checkpoints:
            removed = self.created_dir and self.saved_step is None  # fit() removes it
            state = f"it had written no checkpoint{f', so {self.run_dir} was removed' if removed else ''}"
        elif calm == checkpoints[-1]:
            state = f"its newest checkpoint, {calm}, is intact"
        else:
            state = f"its newest checkpoint, {checkpoints[-1]}, is intact but was written during a loss spike" + (
                f"; the newest from before the spike is {calm}" if calm else "; none is from before the spike"
            )
        restart = calm or (Path(self.cfg.init_from) if self.cfg.init_from else None)  # else from scratch
        remedy = f"start a new run from {restart} (`init_from`)" if restart else "start again"
        return TrainingDiverged(
            f"{reason}: the run stopped at step {self.step_idx} without saving; {state}. To go on, {remedy} with a "
            f"lower `lr` (e.g. {lr:g})",
            init_from=restart,
            lr=lr,
        )


def _rng_state(meta: dict, checkpoint: Path) -> torch.Tensor:
    """The generator state a checkpoint's state.json records, checked: a resume goes on only from the exact state
    it stopped in."""
    saved, size = meta.get("rng_torch"), torch.get_rng_state().numel()
    if not (isinstance(saved, list) and len(saved) == size and all(0 <= v < 256 for v in saved)):
        raise InputError(
            f"{checkpoint / 'state.json'} is damaged: rng_torch must be the {size} bytes of the random generator's "
            f"state; {use_earlier(checkpoint)}"
        )
    return torch.tensor(saved, dtype=torch.uint8)


def step_of(row: str) -> int | None:
    """The step of a metrics.jsonl line (None for a line that is not a metrics row)."""
    try:
        step = json.loads(row).get("step")
    except (json.JSONDecodeError, AttributeError):
        return None
    return step if isinstance(step, int) else None


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
        >>> import tempfile
        >>> from difftransformer import TrainConfig, train
        >>> from difftransformer.store.data import prepare
        >>> from difftransformer.store.tokenizer import ByteTokenizer
        >>> tmp = tempfile.mkdtemp()
        >>> texts = ["To be, or not to be. " * 100] * 20
        >>> _ = prepare(texts, ByteTokenizer(), f"{tmp}/data", split="documents", val_every=10)
        >>> cfg = TrainConfig(data=f"{tmp}/data", out=f"{tmp}/run", max_steps=2, batch_size=2, seq_len=32,
        ...                   eval_tokens=64)
        >>> rows = train(cfg, quiet=True)
        >>> rows[-1]["step"], "val_loss" in rows[-1]
        (2, True)
    """
    trainer = Trainer(cfg, resume=resume, quiet=quiet)
    try:
        return trainer.fit()
    finally:
        trainer.close()
