"""Devices, decided once: a name ('auto', 'cpu', 'cuda', 'cuda:N', 'mps') becomes a ``torch.device`` here, and
everything after passes the device itself, never the name; what the library does differently on a device (the
attention and decode methods ``auto`` runs, the autocast dtype, the AdamW, pinning, the process group's backend) is
``choices(device)``, also here, which the GPU rehearsal (``DIFFTX_REHEARSE=cuda``) points at the CUDA branch on CPU
tensors.

``cuda`` without an index is this process's GPU: under torchrun, the one its ``LOCAL_RANK`` names (process 1 of a
machine takes GPU 1), elsewhere the current one (GPU 0 unless changed). ``cuda:N`` is GPU N, for one process; under
torchrun with several processes per machine an index would put them all on one GPU, so it is refused there.
"""

from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass, replace

import torch

from difftransformer.errors import InputError

NAMES = "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"


def device_problem(device: object) -> str | None:
    """What is wrong with a device name on this machine (None when it can be used).

    Args:
        device: a name (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``) or a ``torch.device``.

    Returns:
        The problem in words, starting after the setting's name, or None.

    Examples:
        >>> device_problem("cpu") is None, device_problem("tpu")
        (True, "must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got 'tpu'")
    """
    if device == "auto":
        return None
    try:
        parsed = torch.device(device) if isinstance(device, (str, torch.device)) else None
    except (RuntimeError, TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda", "mps"):
        return f"must be {NAMES}, got {device!r}"
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            return f"is {device!r}, but no CUDA GPU is available here (or torch is a CPU build); use cpu or auto"
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            return f"is {device!r}, but this machine has {torch.cuda.device_count()} GPU(s)"
        if parsed.index is not None and _local_processes() > 1:
            return (
                f"is {device!r}, but torchrun started {_local_processes()} processes on this machine, which would "
                "all use that one GPU; give cuda (each process takes the GPU of its LOCAL_RANK)"
            )
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        return f"is {device!r}, but MPS is not available here; use cpu or auto"
    return None


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """The ``torch.device`` a name means in this process (see the module docstring); an index is always set for a GPU.

    Args:
        device: ``auto`` (the GPU when there is one, else the CPU), ``cpu``, ``cuda``, ``cuda:N``, ``mps``, or a
            ``torch.device``.

    Returns:
        The device.

    Raises:
        InputError: a name that is not a device, or one this machine does not have.

    Examples:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if (problem := device_problem(device)) is not None:
        raise InputError(f"`device` {problem}")
    parsed = torch.device(device)
    if parsed.type != "cuda" or parsed.index is not None:
        return parsed
    local = os.environ.get("LOCAL_RANK")
    index = int(local) if local is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise InputError(
            f"torchrun gave this process LOCAL_RANK {index}, but this machine has {torch.cuda.device_count()} GPU(s): "
            "start at most that many processes per machine (--nproc-per-node)"
        )
    return torch.device("cuda", index)


def _local_processes() -> int:
    """How many processes torchrun started on this machine (1 outside torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


# --- what each device's branch decides ------------------------------------------------------------------------------

REHEARSE = "DIFFTX_REHEARSE"  # set to "cuda": CPU tensors take the CUDA branch's choices (the GPU rehearsal)


@dataclass(frozen=True)
class Choices:
    """Every decision the library takes from the device, in one place. ``choices(device)`` gives them; the code that
    acts on one asks here, never ``device.type`` itself, so that the GPU rehearsal (``REHEARSE``) runs the CUDA
    branch's code on CPU tensors.

    Attributes:
        branch: whose choices these are: ``cuda``, ``cpu`` or ``other`` (MPS, meta).
        attention: what ``impl="auto"`` runs for rows with a gradient or a prefill: ``sdpa`` (the padded SDPA method:
            twice the attention core's work of the standard model, by construction), ``triton`` (the Triton kernels
            where installed and applicable, else ``sdpa``) or ``by-size`` (the CPU's choice between the fused block
            kernel and SDPA by head size and length). CUDA's is ``sdpa`` until a GPU has timed both
            (benchmarks/gpu_bench.py prints the choice and the command that changes it).
        decode: what ``auto`` runs for a few query rows without a gradient (decoding from a cache): ``torch`` (the
            PyTorch decode path) or ``kernel`` (the fused CPU decode kernel where it is built, else ``torch``).
        autocast: the autocast dtype that ``dtype: auto`` trains in (None: float32).
        fused_adamw: whether AdamW is PyTorch's fused one (one kernel, a non-finite step skipped on the device).
        pin_batches: whether a host batch is pinned and copied without waiting.
        backend: the process group's backend under torchrun.
    """

    branch: str
    attention: str
    decode: str
    autocast: torch.dtype | None
    fused_adamw: bool
    pin_batches: bool
    backend: str


CPU_CHOICES = Choices("cpu", "by-size", "kernel", None, True, False, "gloo")
CUDA_CHOICES = Choices("cuda", "sdpa", "torch", torch.bfloat16, True, True, "nccl")
OTHER_CHOICES = Choices("other", "sdpa", "torch", None, False, False, "gloo")  # mps, meta: no fused AdamW
# the CUDA branch on CPU tensors: NCCL needs a GPU, so the rehearsal's process group is gloo (GPU_ONLY)
REHEARSAL_CHOICES = replace(CUDA_CHOICES, backend="gloo")

# What only a GPU can run, and what the rehearsal runs in its place on the CPU (each covered by a unit test with a
# fake: tests/test_device_choices.py). gpu_check.py --cpu prints this list.
GPU_ONLY = {
    "pinning a host batch for a CUDA copy": "the rehearsal's pin checks that the batch was made on the host "
    "(host_batch) and copies it",
    "NCCL": "gloo, the same collectives through torchrun",
    "CUDA memory statistics": "the peak-memory check is skipped; bench train counts saved activations instead",
    "TF32 matrix products": "float32 (TF32 applies to a CUDA GPU of capability 8 or newer only)",
    "the Triton kernels compiled for the GPU": "Triton's interpreter at the GPU's tiles, in float32, at shorter "
    "lengths than the GPU's parity check",
    "the Triton kernels in bfloat16": "not run: Triton's interpreter multiplies bfloat16 tl.dot operands as their raw "
    "16-bit integers (it stores bfloat16 as uint16), so its bfloat16 results are meaningless",
    "bfloat16 support of the GPU": "bfloat16 autocast on the CPU",
}

_rehearsed: str | None = os.environ.get(REHEARSE) or None
if _rehearsed not in (None, "cuda"):
    warnings.warn(f"{REHEARSE}={_rehearsed!r} is ignored: the rehearsal is {REHEARSE}=cuda", stacklevel=1)
    _rehearsed = None


def rehearsing() -> bool:
    """Whether this process rehearses the CUDA branch on the CPU (``DIFFTX_REHEARSE=cuda``, read at import)."""
    return _rehearsed == "cuda"


def rehearse(branch: str | None) -> None:
    """Start (``"cuda"``) or stop (None) the rehearsal in this process; children inherit it through ``REHEARSE``."""
    global _rehearsed
    if branch not in (None, "cuda"):
        raise ValueError(f"{REHEARSE} must be 'cuda' or unset, got {branch!r}")
    _rehearsed = branch
    if branch is None:
        os.environ.pop(REHEARSE, None)
    else:
        os.environ[REHEARSE] = branch


def choices(device: torch.device) -> Choices:
    """The decisions for tensors on ``device`` (a ``torch.device``): the CUDA branch's on a GPU, and on the CPU
    while rehearsing; the CPU's on the CPU; SDPA, the PyTorch decode path and a foreach AdamW elsewhere (MPS, meta)."""
    if device.type == "cuda":
        return CUDA_CHOICES
    if device.type == "cpu":
        return REHEARSAL_CHOICES if _rehearsed == "cuda" else CPU_CHOICES
    return OTHER_CHOICES


_host_batches: dict[int, weakref.ref] = {}  # id -> the marked tensor (by identity: a tensor's == is elementwise)


def _root(x: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``x`` views (``x`` itself when it is no view)."""
    return x if x._base is None else x._base


def _marked(x: torch.Tensor) -> bool:
    ref = _host_batches.get(id(x))
    return ref is not None and ref() is x


def host_batch(x: torch.Tensor) -> torch.Tensor:
    """Mark ``x`` as a batch made in host memory (a loader's batch), the only kind a CUDA copy may pin; ``x`` itself.
    Only the rehearsal keeps the mark (its pin refuses an unmarked tensor, as PyTorch refuses to pin a CUDA one)."""
    if _rehearsed == "cuda":
        root = _root(x)
        key = id(root)
        _host_batches[key] = weakref.ref(root, lambda _: _host_batches.pop(key, None))
    return x


def pin(x: torch.Tensor) -> torch.Tensor:
    """``x`` in pinned host memory; in the rehearsal a stand-in that refuses what PyTorch would refuse on a GPU
    machine (a tensor not made on the host) and returns ``x``."""
    if _rehearsed != "cuda":
        return x.pin_memory()
    if not _marked(_root(x)):  # a view of a marked batch is one too
        raise RuntimeError(
            "cannot pin a tensor that was not made on the host (the rehearsal's stand-in for PyTorch's refusal to "
            "pin a CUDA tensor): make batches on the CPU and mark them with devices.host_batch, or pass a batch "
            "that is already on the device"
        )
    return x
