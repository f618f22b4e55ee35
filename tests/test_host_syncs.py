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


@pytest.mark.parametrize("attention", ["diff", "standard", "diff_v2"])
def test_decode_steps_on_the_compiled_path_read_nothing_on_the_host(monkeypatch, attention):
    """bench decode's loop (tokens and slots on the device, each step fed the last one's most likely token) as
    torch.compile traces it (torch.compiler.is_compiling() true: the branches the compiled graph takes) reads nothing
    on the host, so a GPU never waits between steps. Eager, each step checks its token ids and positions on the host
    (by design: the counter sees them)."""
    import torch

    from difftransformer import ModelConfig, TransformerLM
    from difftransformer.apps import bench

    model = TransformerLM(ModelConfig.preset("tiny", attention=attention, n_layers=2, max_seq_len=32)).eval()
    with HostSyncs() as eager:
        bench._decode_seconds(model, context=8, tokens=4)
    assert len(eager.found) >= 4, eager.found  # the prefill's and every step's checks
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with HostSyncs() as traced:
        bench._decode_seconds(model, context=8, tokens=4)
    assert traced.found == []
