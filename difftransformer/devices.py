"""Devices, decided once: a name ('auto', 'cpu', 'cuda', 'cuda:N', 'mps') becomes a ``torch.device`` here, and
everything after compares ``device.type`` and passes the device itself, never the name.

``cuda`` without an index is this process's GPU: under torchrun, the one its ``LOCAL_RANK`` names (process 1 of a
machine takes GPU 1), elsewhere the current one (GPU 0 unless changed). ``cuda:N`` is GPU N, for one process; under
torchrun with several processes per machine an index would put them all on one GPU, so it is refused there.
"""

from __future__ import annotations

import os

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
