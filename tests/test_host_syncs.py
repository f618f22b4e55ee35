"""No host synchronisation per training step outside logging, evaluation and checkpoint steps (issue 29): on a GPU
each one stalls the pipeline. Counted on CPU with tests/host_syncs.py; the count must be 0."""

from __future__ import annotations

import pytest
from conftest import small_config
from host_syncs import HostSyncs

from difftransformer.training.loop import Trainer


def trainer(prepared, tmp_path, **overrides) -> Trainer:
    cfg = small_config(prepared, tmp_path / "run", max_steps=40, log_interval=20, eval_interval=20, ckpt_interval=20)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    return Trainer(cfg, quiet=True)


@pytest.mark.parametrize("attention", ["diff", "standard", "diff_v2"])
def test_a_training_step_reads_nothing_on_the_host(prepared, tmp_path, attention):
    """The step itself: forward (token ids not checked per step: the shards were checked when opened), backward,
    clipping, the non-finite guard and the optimizer step all stay on the device."""
    t = trainer(prepared, tmp_path, attention=attention)
    try:
        t.train_step()  # the first step builds optimizer state; the second is the steady state
        with HostSyncs() as syncs:
            t.train_step()
        assert syncs.found == []
    finally:
        t.close()


def test_steps_between_log_steps_read_nothing_on_the_host(prepared, tmp_path):
    """The loop around the step (rows, lambda, the loss watch, the stop flag): the reads of a stretch of steps
    are those of its one read step, whatever the stretch's length."""
    t = trainer(prepared, tmp_path)
    try:
        t.fit(until=1)
        with HostSyncs() as short:
            t.fit(until=3)  # steps 2, 3: one read, at 3 (the end of the stretch)
        with HostSyncs() as long:
            t.fit(until=13)  # steps 4-13: one read, at 13
        assert len(long.found) == len(short.found) > 0, (short.found, long.found)
    finally:
        t.close()
