"""Parallelism applied from outside the model, in one place (torchtitan's ``parallelize``).

Order: activation checkpointing per block, ``torch.compile`` per block, then data parallelism (DDP, or
FSDP2's ``fully_shard`` per block and at the root). Under ``torchrun`` the process group is set up from the
environment: NCCL on CUDA, gloo on CPU. State dicts go through ``torch.distributed.checkpoint.state_dict`` so
that one checkpoint format (full, name-keyed tensors) serves a single process, DDP and FSDP alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from difftransformer.errors import InputError

PARALLEL_MODES = ("none", "ddp", "fsdp")


@dataclass
class World:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(device: str = "auto") -> World:
    """Join the torchrun process group when there is one; pick the device."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return World(rank, size, torch.device("cuda", local))
    return World(rank, size, torch.device(device))


def parallelize(
    model: nn.Module, mode: str, world: World, compile: bool = False, checkpoint_activations: bool = False
) -> nn.Module:
    """Wrap ``model`` for training: checkpoint and compile its blocks, then DDP or FSDP2. Returns the module to call.

    Activation checkpointing keeps only each block's input for backward and recomputes the block; the wrapper
    leaves parameter names (and so checkpoints) unchanged."""
    if mode not in PARALLEL_MODES:
        raise InputError(f"`parallel` must be one of {PARALLEL_MODES}, got {mode!r}")
    if mode != "none" and not dist.is_initialized():
        raise InputError(f"`parallel` {mode} needs a process group: launch with torchrun --nproc-per-node N")
    if checkpoint_activations:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    if compile:
        for block in model.layers:
            block.compile()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [world.device.index] if world.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full, name-keyed model and optimizer state dicts (gathered on every rank under FSDP)."""
    inner = unwrap(model)
    return get_model_state_dict(inner, options=_FULL), get_optimizer_state_dict(inner, optimizer, options=_FULL)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    inner = unwrap(model)
    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(inner, model_sd, options=options)
    set_optimizer_state_dict(inner, optimizer, optim_sd, options=options)


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    """The largest of every process's value (the value itself on one process)."""
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value
