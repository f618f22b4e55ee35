"""A run's checkpoint policy: how the trainer writes a checkpoint (whole tensors from one process or DDP, pieces
from every FSDP process), reads the newest back with every check a resume needs, and what it says when a run
diverges (which checkpoint is intact, where to start again, at what rate). The files themselves are
store/checkpoint.py's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from difftransformer.core.attention.gqa_layout import own_layout
from difftransformer.core.config import ModelConfig
from difftransformer.errors import InputError, TrainingDiverged
from difftransformer.fsutil import shell
from difftransformer.store.checkpoint import (
    SHARDED_TAG,
    checkpoint_tmp_dir,
    list_checkpoints,
    load_checkpoint,
    load_model,
    new_checkpoint_dir,
    newest_calm,
    pieces,
    publish_checkpoint,
    read_state,
    save_checkpoint,
    use_earlier,
    write_failed,
    write_pieces,
)
from difftransformer.store.runs import (
    MODEL_CONFIG,
    TRAIN_CONFIG,
    check_optimizer_state,
    check_recorded,
    check_weights,
    refuse_changed,
)
from difftransformer.training.config import RESUMABLE
from difftransformer.training.distributed import (
    World,
    all_gather_objects,
    barrier,
    full_state,
    is_sharded,
    load_full_state,
    load_pieces,
    sharded_pieces,
    unwrap,
)
from difftransformer.training.health import unhealthy_parts


def lower_lr(lr: float) -> float:
    """The learning rate a diverged run's message suggests: a tenth of its own, to 3 digits."""
    return float(f"{lr / 10:.3g}")


class Checkpoints:
    """The checkpoints of the run in ``run_dir``, written and read by every process of ``world``; ``keep_last``
    and ``keep_best`` say which ones a new checkpoint leaves (store/checkpoint.py)."""

    def __init__(self, run_dir: Path, world: World, keep_last: int, keep_best: bool) -> None:
        self.run_dir, self.world, self.keep_last, self.keep_best = Path(run_dir), world, keep_last, keep_best

    def listed(self) -> list[Path]:
        return list_checkpoints(self.run_dir)

    def calm(self) -> Path | None:
        """The newest checkpoint written while the loss was calm (the main process reads it; others get None)."""
        return newest_calm(self.run_dir) if self.world.is_main else None

    # writing -------------------------------------------------------------------------------------------------
    def write(self, model, optimizer, step: int, meta: dict) -> Path | None:
        """A checkpoint of ``step``; its directory on the main process."""
        if is_sharded(model):
            return self._write_pieces(model, optimizer, step, meta)
        model_sd, optim_sd = full_state(model, optimizer)  # gathered, written by the main process
        if not self.world.is_main:
            return None
        return save_checkpoint(self.run_dir, step, model_sd, optim_sd, meta, self.keep_last, self.keep_best)

    def _write_pieces(self, model, optimizer, step: int, meta: dict) -> Path | None:
        """A sharded checkpoint (FSDP): every process writes its pieces of every tensor into the same temporary
        directory, nothing gathered; the main process then publishes it (state.json with every file's digest, the
        rename). A process that fails to write makes every process fail, with its error, and nothing is replaced."""
        world = self.world
        if world.is_main:
            new_checkpoint_dir(self.run_dir, step, SHARDED_TAG)
        barrier()  # the directory exists before anyone writes into it
        tmp = checkpoint_tmp_dir(self.run_dir, step, SHARDED_TAG)
        files, failure = {}, None
        try:
            model_pieces, optim_pieces, optim_meta = sharded_pieces(model, optimizer, world.rank)
            for kind, kind_pieces in (("model", model_pieces), ("optimizer", optim_pieces)):
                name, digest = write_pieces(tmp, kind, world.rank, world.size, kind_pieces)
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
            path = publish_checkpoint(self.run_dir, step, tmp, every, meta, self.keep_last, self.keep_best)
        barrier()
        return path

    # reading -------------------------------------------------------------------------------------------------
    def load(self, checkpoint: Path, model, optimizer, model_config: ModelConfig, tokenizer, recipe: dict) -> dict:
        """Load ``checkpoint`` into ``model`` and ``optimizer`` after checking that it is this run's (its model
        config, tokenizer and recipe: ``recipe`` is the one the run trains with now, what a resume may change
        aside) and that its tensors fit; returns its state.json. The generator state is checked, not set."""
        if is_sharded(model):  # FSDP: each process reads its part of every tensor, from pieces or whole files
            meta = read_state(checkpoint)
            model_pieces, optim_pieces = pieces(checkpoint, "model", meta), pieces(checkpoint, "optimizer", meta)
            model_sd = {n: torch.empty(model_pieces.shape(n), device="meta") for n in model_pieces.names()}  # shapes
        else:  # one process or DDP: whole tensors (a sharded checkpoint's pieces assembled)
            model_sd, optim_sd, meta = load_checkpoint(checkpoint)
        check_recorded(checkpoint, meta, model_config, tokenizer)
        if (recorded := meta.get("train_config")) is not None:  # another run's train_config.json: refused
            skip = {*RESUMABLE, "init_from", *(set(recorded) - set(recipe))}  # init_from: used before the first one
            what = f"the recipe {checkpoint.name} was trained with"
            refuse_changed(self.run_dir / TRAIN_CONFIG, what, recipe, recorded, skip)
        check_weights(unwrap(model), model_sd, str(checkpoint), str(self.run_dir / MODEL_CONFIG))
        if not is_sharded(model):
            check_optimizer_state(unwrap(model), optim_sd, f"checkpoint {checkpoint}", len(optimizer.param_groups))
        rng_state(meta, checkpoint)
        with own_layout():
            if is_sharded(model):
                load_pieces(model, optimizer, model_pieces, optim_pieces, meta.pop("optimizer"))
            else:
                load_full_state(model, optimizer, model_sd, optim_sd)
        return meta

    def unhealthy(self, flags: list[float], lr: float) -> TrainingDiverged:
        """The error for a newest checkpoint whose state ``check_health`` found ``flags``."""
        checkpoints = self.listed()
        newest = checkpoints[-1]
        earlier = checkpoints[-2].name if len(checkpoints) > 1 else None
        return TrainingDiverged(
            f"the newest checkpoint of {self.run_dir}, {newest.name}, is not healthy: {unhealthy_parts(flags)} "
            "(the run had diverged when it was written, by a version that did not check). "
            + (
                f"To resume from the one before it ({earlier}), move it away: mv {shell(newest)} "
                f"{shell(newest.parent / ('diverged-' + newest.name))}; or start a new run from an earlier "
                "checkpoint with `init_from` and a lower `lr`"
                if earlier
                else f"It is the run's only checkpoint: start again with a lower `lr` (e.g. {lower_lr(lr):g})"
            ),
            lr=None if earlier else lower_lr(lr),
        )

    def diverged(self, reason: str, step: int, lr: float, init_from: str | None, removed: bool) -> TrainingDiverged:
        """The error that stops a diverged run at ``step``: what happened, which checkpoint is intact and how to go
        on (``removed``: the run had written no checkpoint and its directory is removed)."""
        checkpoints, calm = self.listed(), newest_calm(self.run_dir)
        if not checkpoints:
            state = f"it had written no checkpoint{f', so {self.run_dir} was removed' if removed else ''}"
        elif calm == checkpoints[-1]:
            state = f"its newest checkpoint, {calm}, is intact"
        else:
            state = f"its newest checkpoint, {checkpoints[-1]}, is intact but was written during a loss spike" + (
                f"; the newest from before the spike is {calm}" if calm else "; none is from before the spike"
            )
        restart = calm or (Path(init_from) if init_from else None)  # else from scratch
        remedy = f"start a new run from {restart} (`init_from`)" if restart else "start again"
        return TrainingDiverged(
            f"{reason}: the run stopped at step {step} without saving; {state}. To go on, {remedy} with a "
            f"lower `lr` (e.g. {lower_lr(lr):g})",
            init_from=restart,
            lr=lower_lr(lr),
        )


def load_start(model, start: Path, model_config: ModelConfig, tokenizer) -> None:
    """Load into a new run's ``model`` the weights of ``start``, the checkpoint its ``init_from`` names, after
    checking that they were trained with ``model_config`` and ``tokenizer``."""
    tensors, meta = load_model(start)
    check_recorded(start, meta, model_config, tokenizer)
    check_weights(model, tensors, str(start), str(start.parent.parent / MODEL_CONFIG))
    with own_layout():
        model.load_state_dict(tensors, strict=True)


def rng_state(meta: dict, checkpoint: Path) -> torch.Tensor:
    """The generator state a checkpoint's state.json records, checked: a resume goes on only from the exact state
    it stopped in."""
    saved, size = meta.get("rng_torch"), torch.get_rng_state().numel()
    if not (isinstance(saved, list) and len(saved) == size and all(0 <= v < 256 for v in saved)):
        raise InputError(
            f"{checkpoint / 'state.json'} is damaged: rng_torch must be the {size} bytes of the random generator's "
            f"state; {use_earlier(checkpoint)}"
        )
    return torch.tensor(saved, dtype=torch.uint8)
