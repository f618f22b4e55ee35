"""Parallelism applied from outside the model, in one place (torchtitan's ``parallelize``).

Order: activation checkpointing per block, ``torch.compile`` per block, then data parallelism (DDP, or
FSDP2's ``fully_shard`` per block and at the root). Under ``torchrun`` the process group is set up from the
environment: NCCL on CUDA, gloo on CPU, with a collective timeout (``TrainConfig.collective_timeout``): a process
that waits longer than that for the others fails instead of hanging (a process that died is seen at once: its
connections close, and torchrun stops the rest of the group). State dicts go through
``torch.distributed.checkpoint.state_dict`` so that one checkpoint format (full, name-keyed tensors) serves a single
process, DDP and FSDP alike.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta

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
from torch.distributed.tensor import DTensor

from difftransformer.devices import choices, resolve_device
from difftransformer.errors import InputError
from difftransformer.store.checkpoint import flatten_optimizer, unflatten_optimizer

PARALLEL_MODES = ("none", "ddp", "fsdp")


@dataclass
class World:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(device: str | torch.device = "auto", timeout: float = 600) -> World:
    """Pick the device (``devices.resolve_device``: ``cuda`` is LOCAL_RANK's GPU), make it this process's current
    GPU, then join the torchrun process group when launched by it (the device's backend, ``devices.choices``: NCCL on
    a GPU, gloo elsewhere and in the GPU rehearsal; collectives time out after ``timeout`` seconds). The caller leaves
    the group with ``leave_world`` before it exits."""
    device = resolve_device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the group: NCCL binds each process to its current GPU
    size = int(os.environ.get("WORLD_SIZE", "1"))
    launched = size > 1 or "TORCHELASTIC_RUN_ID" in os.environ  # torchrun: a group even of one process (whose
    # collectives communicate nothing; benchmarks/gpu.sh checks that such a group starts, trains and resumes)
    if launched and not dist.is_initialized():
        backend = choices(device).backend
        wait = timedelta(seconds=timeout)
        store = _attempt_store(wait)
        if store is None:
            dist.init_process_group(backend, timeout=wait)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=size, timeout=wait)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return World(rank, size, device)


def leave_world() -> None:
    """Destroy the process group, if this process joined one (``init_world``). A program that joins one must call
    this before it exits (``difftx`` does, whatever the outcome): left to the interpreter's shutdown, gloo's worker
    threads could still hold tensors while Python was torn down, and a run that had finished and saved everything
    then died by SIGABRT ("terminate called without an active exception"), failing its torchrun group."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _attempt_store(timeout: timedelta):
    """Under torchrun, whose agent's store outlives a restart of the group, that store with a prefix of its own for
    this attempt (None elsewhere: the default rendezvous). Without it, a restarted group found the addresses its
    dead processes had left in the store, and connecting to them failed or hung (gloo's connectFullMesh)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]), False, timeout
    )
    return dist.PrefixStore(f"difftx/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def fsdp_policy(amp: torch.dtype | None):
    """FSDP2's mixed precision for a run under autocast to ``amp``: parameters gathered in ``amp`` (bfloat16: half
    the all-gather traffic and the forward's memory), gradients reduced in float32 (a sum of bfloat16 gradients over
    many processes loses their low bits); the sharded weights and the optimizer stay float32. None: float32."""
    if amp is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32)


def parallelize(
    model: nn.Module,
    mode: str,
    world: World,
    compile: bool = False,
    checkpoint_activations: bool = False,
    amp: torch.dtype | None = None,
) -> nn.Module:
    """Wrap ``model`` for training: checkpoint and compile its blocks, then DDP or FSDP2 (with ``fsdp_policy(amp)``).
    Returns the module to call.

    Activation checkpointing keeps only each block's input for backward and recomputes the block; the wrapper
    leaves parameter names (and so checkpoints) unchanged."""
    if mode not in PARALLEL_MODES:
        raise InputError(f"`parallel` must be one of {PARALLEL_MODES}, got {mode!r}")
    if mode == "fsdp" and world.device.type == "cpu" and torch_version() < (2, 7):
        raise InputError(
            f"`parallel` fsdp on CPU needs torch 2.7 or newer (FSDP2 in torch {torch.__version__} calls CUDA streams "
            "and fails on CPU); use `parallel` ddp, or upgrade torch"
        )
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

        policy = fsdp_policy(amp)
        options = {} if policy is None else {"mp_policy": policy}
        for block in model.layers:
            fully_shard(block, **options)
        fully_shard(model, **options)
    return model


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed PyTorch."""
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return int(major), int(minor)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full, name-keyed model and optimizer state dicts (gathered on every rank under FSDP)."""
    inner = unwrap(model)
    return get_model_state_dict(inner, options=_FULL), get_optimizer_state_dict(inner, optimizer, options=_FULL)


_SHARDED = StateDictOptions(full_state_dict=False)


def is_sharded(model: nn.Module) -> bool:
    """Whether the model's parameters are sharded over the processes (FSDP2: DTensors)."""
    return any(isinstance(p, DTensor) for p in unwrap(model).parameters())


def _piece(tensor: torch.Tensor, rank: int) -> tuple[torch.Tensor, tuple, tuple] | None:
    """(local tensor on the CPU, global shape, offset) of what this process holds of ``tensor``: its shard of a
    DTensor, or for a tensor every process holds alike (the optimizer's step count) the whole tensor on process 0
    only (None elsewhere)."""
    if isinstance(tensor, DTensor):
        (chunk,) = _chunks(tensor)
        local = tensor.to_local().detach().contiguous().cpu()
        return local, tuple(tensor.shape), tuple(chunk.offsets)
    if rank != 0:
        return None
    return tensor.detach().contiguous().cpu(), tuple(tensor.shape), (0,) * tensor.dim()


def _chunks(tensor: DTensor) -> list:
    """Where this process's shard lies in the DTensor (offsets and sizes: torch.distributed.checkpoint's own
    description), computed on the host whatever the default device (DTensor builds index tensors without one)."""
    with torch.device("cpu"):
        return tensor.__create_chunk_list__()


def sharded_pieces(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> tuple[dict, dict, dict]:
    """What this process writes of a sharded checkpoint: its pieces of the model's and the optimizer's tensors
    ({name: (local tensor, global shape, offset)}, the optimizer's keyed ``<param name>/<state name>``) and the
    optimizer's other state ({param_groups, scalars}, the same on every process), from
    torch.distributed.checkpoint's sharded state dicts: nothing is gathered."""
    inner = unwrap(model)
    model_sd = get_model_state_dict(inner, options=_SHARDED)
    optim_sd = get_optimizer_state_dict(inner, optimizer, options=_SHARDED)
    model_pieces = {name: p for name, t in model_sd.items() if (p := _piece(t, rank)) is not None}
    optim_pieces, optim_meta = flatten_optimizer(optim_sd, lambda tensor: _piece(tensor, rank))
    return model_pieces, optim_pieces, optim_meta


def load_pieces(model: nn.Module, optimizer: torch.optim.Optimizer, model_reader, optim_reader, optim_meta: dict):
    """Load a checkpoint stored in pieces (or whole: store/shards.PieceReader reads either) into a sharded model and
    its optimizer: each process reads only the part of every tensor that it holds, whatever the number of processes
    that wrote it."""
    inner = unwrap(model)
    model_sd = get_model_state_dict(inner, options=_SHARDED)
    optim_sd = get_optimizer_state_dict(inner, optimizer, options=_SHARDED)  # the state made where there is none
    model_sd = {name: _filled(t, model_reader, name) for name, t in model_sd.items()}
    shards, _ = flatten_optimizer(optim_sd, lambda tensor: tensor)  # this process's tensors, as they are
    saved = unflatten_optimizer({flat: _filled(t, optim_reader, flat) for flat, t in shards.items()}, optim_meta)
    options = StateDictOptions(full_state_dict=False, strict=True)
    set_model_state_dict(inner, model_sd, options=options)
    set_optimizer_state_dict(inner, optimizer, _for_this_optimizer(optimizer, saved), options=options)


def _filled(like: torch.Tensor, reader, name: str) -> torch.Tensor:
    """``like`` (a DTensor shard, or a whole tensor) with its values read from ``reader``."""
    if not isinstance(like, torch.Tensor):
        return like
    if name not in reader.pieces or reader.shape(name) != tuple(like.shape):
        found = reader.shape(name) if name in reader.pieces else "nothing"
        raise InputError(f"the checkpoint holds {found} for {name}, the model needs {tuple(like.shape)}")
    if isinstance(like, DTensor):
        (chunk,) = _chunks(like)
        local = reader.read(name, tuple(chunk.offsets), tuple(chunk.sizes)).to(like.device, like.dtype)
        return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())
    return reader.read(name).to(like.device, like.dtype)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    inner = unwrap(model)
    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(inner, model_sd, options=options)
    set_optimizer_state_dict(inner, optimizer, _for_this_optimizer(optimizer, optim_sd), options=options)


def _for_this_optimizer(optimizer: torch.optim.Optimizer, optim_sd: dict) -> dict:
    """A saved optimizer state as this optimizer loads it: each param group takes every setting from this optimizer's
    group of the same place, made from the run's recipe (which the checkpoint's record is checked against): how it
    steps (fused or foreach: chosen by device and version, not by a checkpoint from another machine, or from before
    AdamW was fused here) and what it does (betas, weight decay, amsgrad: never a value edited into state.json, or
    a setting another PyTorch wrote that this one refuses). The saved groups give which parameters each holds, and
    the state its moments and steps; the learning rate is set at every step."""
    groups = [
        {**{k: v for k, v in current.items() if k != "params"}, "params": saved["params"]}
        for current, saved in zip(optimizer.param_groups, optim_sd["param_groups"], strict=True)
    ]
    return {**optim_sd, "param_groups": groups}


def group_failure(err: BaseException) -> str | None:
    """When ``err`` says that the process group broke (a process of it died, or a collective timed out), what
    happened in a line, with this process's rank; None for any other error (a defect keeps its traceback)."""
    if not dist.is_initialized() or not isinstance(err, RuntimeError):
        return None
    text = str(err)
    broken = isinstance(err, getattr(dist, "DistError", ())) or any(
        mark in text for mark in ("third_party/gloo", "Connection closed by peer", "Connection reset", "NCCL")
    )
    if not broken:
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    detail = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # without the source location and the advice
    return f"process {dist.get_rank()} of {dist.get_world_size()} stopped: the process group failed ({detail})"


def all_reduce_max(value: torch.Tensor) -> torch.Tensor:
    """The largest of every process's value (the value itself on one process)."""
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def all_gather_objects(value: object) -> list:
    """Every process's ``value`` (picklable, made by this program), in rank order; ``[value]`` on one process."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value
