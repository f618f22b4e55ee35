"""Counting host synchronisations on CPU: the reads that, on a GPU, would make the host wait for the device.

``HostSyncs`` records, while it is active, every ``aten._local_scalar_dense`` (what ``.item()``, ``float(t)``,
``int(t)``, ``bool(t)`` and ``if t:`` run) and every ``.tolist()``, ``.numpy()`` and ``.cpu()`` of a tensor (on a
CPU tensor these copy nothing, so the dispatcher never sees them; the function mode does). Each record keeps the
innermost frame of the project's code that asked, so a failing test says where the read is.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READS = {"tolist", "numpy", "cpu"}


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        if "/difftransformer/" in frame.filename:
            return f"{frame.filename.split('/difftransformer/')[-1]}:{frame.lineno} {frame.line}"
    return "outside difftransformer"


class _Dispatch(TorchDispatchMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.found.append(f"item: {_caller()}")
        return func(*args, **(kwargs or {}))


class _Function(TorchFunctionMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in READS and args and isinstance(args[0], torch.Tensor):
            self.found.append(f"{func.__name__}: {_caller()}")
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """``with HostSyncs() as syncs: ...``; then ``syncs.found`` lists each read (where it was asked)."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self._modes = (_Function(self.found), _Dispatch(self.found))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
