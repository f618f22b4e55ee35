"""`difftx` with every collective's tensors checked against the world's device, for the collective-device test (run
under torchrun as a script: torchrun ... tests/collective_devices.py train ...).

NCCL, the process group of a CUDA world, refuses a CPU tensor; gloo, the one these CPU tests have, takes any. So that
the check bites on CPU too, training (``Trainer.fit``) runs with ``meta`` as the default device: a tensor made
without a device (``torch.tensor(flag)``, as the stop flag was), which on a GPU world would be a CPU tensor, is then
a meta tensor, and the wrapped ``torch.distributed`` collectives fail on it. The collectives of the set-up (the
start's health check) are checked against the world's device as they are. At exit each process prints how many
collectives of each kind it checked.
"""

import atexit
import collections
import functools
import os
import sys

import torch
import torch.distributed as dist

from difftransformer.apps.cli import main
from difftransformer.training import loop

CHECKED = collections.Counter()
WORLD = {}
NAMES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all_single", "reduce", "gather", "scatter",
)  # fmt: skip


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _checked(name, collective):
    @functools.wraps(collective)
    def wrapper(*args, **kwargs):
        expected = WORLD["device"]
        for tensor in _tensors([*args, *kwargs.values()]):
            if tensor.device != expected:
                raise AssertionError(
                    f"dist.{name} got a tensor on {tensor.device}, the world's device is {expected} "
                    "(NCCL would refuse it)"
                )
        CHECKED[name] += 1
        return collective(*args, **kwargs)

    return wrapper


for _name in NAMES:
    setattr(dist, _name, _checked(_name, getattr(dist, _name)))

_init_world = loop.init_world


def _recording_init_world(*args, **kwargs):
    world = _init_world(*args, **kwargs)
    WORLD["device"] = world.device
    return world


loop.init_world = _recording_init_world
_fit = loop.Trainer.fit


def _fit_without_a_default_device(self, until=None):
    with torch.device("meta"):
        return _fit(self, until)


loop.Trainer.fit = _fit_without_a_default_device


def _report():
    # one write of the whole line: print writes the text and its newline apart, and the two processes' lines then
    # interleave on the shared stderr pipe (a write this short to a pipe is atomic)
    sys.stderr.write(f"rank {os.environ.get('RANK')} checked collectives: {dict(sorted(CHECKED.items()))}\n")
    sys.stderr.flush()


atexit.register(_report)
sys.exit(main())
