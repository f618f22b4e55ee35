"""A run directory's lifecycle: refused when it already holds something (a new run), locked and tidied (a resume),
created with the files a run starts with, and removed again when the run fails before its first checkpoint.

Only the main process writes; on many processes the others wait at ``open_existing``'s barrier. The lock
(store/runs.RunLock) is held from ``open_existing`` or ``create`` to ``release``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from difftransformer.core.config import ModelConfig
from difftransformer.errors import ConfigError, InputError
from difftransformer.fsutil import check_new_dir, shell, write_text_atomic
from difftransformer.store.checkpoint import PREFIX, clean_stale, list_checkpoints, refuse_foreign_checkpoints
from difftransformer.store.runs import (
    LOCK,
    METRICS,
    MODEL_CONFIG,
    TRAIN_CONFIG,
    RunLock,
    being_written,
    is_unstarted_run,
    refuse_links,
    refuse_quantized,
    start_checkpoint,
    writer_of,
)
from difftransformer.store.tokenizer import load_tokenizer
from difftransformer.training.config import TrainConfig
from difftransformer.training.distributed import World, barrier


class RunDirectory:
    """The directory ``path`` of one run, written by ``world``'s main process."""

    def __init__(self, path: Path, world: World) -> None:
        self.path, self.world = Path(path), world
        self.lock: RunLock | None = None
        self.created = False  # this process made the directory: a failed start removes it

    def note(self, text: str) -> None:
        """A note on standard error, from the main process only."""
        if self.world.is_main:
            print(f"note: {text}", file=sys.stderr, flush=True)

    def check_new(self) -> None:
        """Refuse, for a new run, a directory being written, holding a run, or holding anything else."""
        path = self.path
        if (pid := writer_of(path)) is not None:  # not "remove it" while another process writes it
            raise InputError(f"{being_written(path, pid)}, or choose another `out`")
        if path.exists() and is_unstarted_run(path):
            raise FileExistsError(
                f"run directory {path} holds a run that stopped before its first checkpoint; resume it "
                f"(difftx train --resume {shell(path)}: it starts again from step 0) or remove it"
            )
        if (newest := list_checkpoints(path)) and (path / TRAIN_CONFIG).is_file():
            step = int(newest[-1].name.removeprefix(PREFIX))
            raise FileExistsError(
                f"run directory {path} holds a run (at step {step}); to train it further: difftx train "
                f"--resume {shell(path)} --max-steps N; to start another run, choose another `out`"
            )
        check_new_dir(path, "run directory")

    def open_existing(self, data: Path) -> None:
        """Lock the run (none of whose entries may be a link), tidy what killed writes left, and find its data."""
        if self.world.is_main:
            refuse_links(self.path)
            refuse_foreign_checkpoints(self.path)
            self.lock = RunLock(self.path)
            for line in clean_stale(self.path):
                self.note(line)
        barrier()
        if not (Path(data) / "manifest.json").is_file():
            raise ConfigError(
                "TrainConfig",
                "data",
                f"{data} of the run {self.path} is not there (moved or deleted?); give its new location with "
                "`data` (data prepared with the run's tokenizer)",
            )

    def create(self, recipe: dict, model_config: ModelConfig, tokenizer) -> None:
        """Make and lock the directory of a new run and write what it starts with: its recipe, model config,
        tokenizer and an empty metrics.jsonl."""
        if not self.world.is_main:
            return
        try:
            self.path.mkdir(parents=True)
            created = True
        except FileExistsError:
            created = False
        self.lock = RunLock(self.path)
        self.created = created
        check_new_dir(self.path, "run directory", allow=(LOCK,))  # again, now that no one else can write
        self.write_recipe(recipe)
        model_config.to_json(self.path / MODEL_CONFIG)
        tokenizer.save(self.path)
        (self.path / METRICS).write_text("")

    def write_recipe(self, recipe: dict) -> None:
        """train_config.json: the recipe the run trains with now."""
        if self.world.is_main:
            write_text_atomic(self.path / TRAIN_CONFIG, json.dumps(recipe, indent=2) + "\n")

    def remove_created(self) -> bool:
        """Remove the directory if this process created it (a run that failed before its first checkpoint leaves
        nothing behind); True when it did."""
        if not (self.created and self.world.is_main):
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        self.created = False
        return True

    def release(self) -> None:
        """Release the lock: another trainer may then resume the run."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def run_model(cfg: TrainConfig, run_dir: Path, resume: bool, fingerprint: str, vocab_size: int):
    """(the model config a run trains, the checkpoint its ``init_from`` names or None): the run's own on a resume,
    the start run's for ``init_from``, else the config's at ``vocab_size``; the run or start run must use the data's
    tokenizer (``fingerprint``)."""
    if resume:
        if (run_tok := load_tokenizer(run_dir).fingerprint()) != fingerprint:
            raise InputError(
                f"the data in {cfg.data} was tokenised with {fingerprint}, but the run {run_dir} uses {run_tok}: "
                "resume with data prepared with the run's tokenizer"
            )
        return ModelConfig.from_json(run_dir / MODEL_CONFIG), None
    if not cfg.init_from:
        return cfg.model_config(vocab_size), None
    start_run, start = start_checkpoint(cfg.init_from)
    refuse_quantized(start_run, "start a run from it")
    model_config = ModelConfig.from_json(start_run / MODEL_CONFIG)
    cfg.take_model_from(model_config)
    if (start_tok := load_tokenizer(start_run).fingerprint()) != fingerprint:
        raise InputError(
            f"the run {start_run} (init_from) uses the tokenizer {start_tok}, the data in {cfg.data} {fingerprint}: "
            "prepare the data with that run's tokenizer"
        )
    return model_config, start
