"""`difftx` with one fault injected into one process of a group, for the distributed-fault tests (run under torchrun
as a script: torchrun ... tests/faults.py train ...).

DIFFTX_FAULT_RANK=r and DIFFTX_FAULT_STEP=s: process r raises the error a damaged shard gives when it fetches the
batch of step s; the other processes do not see it. With DIFFTX_FAULT=hang it hangs there instead.
"""

import os
import sys
import time

from difftransformer.apps.cli import main
from difftransformer.errors import InputError
from difftransformer.store.data import WindowSampler

RANK, STEP = int(os.environ["DIFFTX_FAULT_RANK"]), int(os.environ["DIFFTX_FAULT_STEP"])
batch = WindowSampler.batch


def damaged(self, step: int, *args, **kwargs):
    if int(os.environ.get("RANK", "0")) == RANK and step + 1 == STEP:
        while os.environ.get("DIFFTX_FAULT") == "hang":
            time.sleep(1)
        raise InputError(f"shard train_000.bin of rank {RANK} is damaged (injected at step {STEP} by tests/faults.py)")
    return batch(self, step, *args, **kwargs)


WindowSampler.batch = damaged
sys.exit(main())
