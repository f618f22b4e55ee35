"""What a GPU run gets by default, checked on CPU where it can be: the optimizer's implementation chosen by device
and its on-device skip of a non-finite step, FSDP2's mixed-precision policy, TF32 for float32 runs on Ampere and
newer (batches copied from pinned memory: tests/test_device_choices.py)."""

from __future__ import annotations

import pytest
import torch

from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.training.config import TrainConfig
from difftransformer.training.distributed import fsdp_policy
from difftransformer.training.step import (
    make_optimizer,
    optimizer_flags,
    optimizer_step,
    precision,
    tf32_applies,
)


def test_adamw_is_fused_on_cuda_and_cpu_and_foreach_elsewhere():
    assert optimizer_flags(torch.device("cuda", 1)) == {"fused": True}
    assert optimizer_flags(torch.device("cpu")) == {"fused": True}
    assert optimizer_flags(torch.device("meta")) == {"foreach": True}
    model = TransformerLM(ModelConfig.preset("tiny", n_layers=1))
    assert make_optimizer(model, TrainConfig(data=".", out=".")).defaults["fused"] is True


def _model_and_batch():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny", n_layers=1))
    x = torch.randint(0, 256, (2, 9))
    return model, [(x[:, :-1], x[:, 1:])]


@pytest.mark.parametrize("flags", [{"fused": True}, {"foreach": True}], ids=["fused", "foreach"])
def test_a_non_finite_step_changes_neither_weights_nor_optimizer_state(flags):
    """A gradient norm that is not finite (one weight set to inf): the fused optimizer skips on the device, the
    foreach one after a read; either way no weight, moment or step count moves, and the next finite step applies."""
    model, batch = _model_and_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, **flags)
    first = optimizer_step(model, optimizer, batch, 1e-2, 1.0, torch.device("cpu"))
    assert not bool(first.skipped)
    with torch.no_grad():
        model.norm.weight[0] = float("inf")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() for s in optimizer.state.values() for k, v in s.items()}
    result = optimizer_step(model, optimizer, batch, 1e-2, 1.0, torch.device("cpu"))
    row = result.row()
    assert row["skipped"] in ("non-finite loss", "non-finite gradient")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    after = {k: v for s in optimizer.state.values() for k, v in s.items()}
    assert all(torch.equal(after[k], v) for k, v in state.items())
    assert {float(s["step"]) for s in optimizer.state.values()} == {1.0}
    with torch.no_grad():
        model.norm.weight[0] = 1.0
    assert "skipped" not in optimizer_step(model, optimizer, batch, 1e-2, 1.0, torch.device("cpu")).row()
    assert {float(s["step"]) for s in optimizer.state.values()} == {2.0}


def test_fsdp_mixed_precision_gathers_bf16_and_reduces_in_float32():
    policy = fsdp_policy(torch.bfloat16)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_policy(None) is None


def test_tf32_for_float32_runs_on_ampere_and_newer_only():
    cuda = torch.device("cuda", 0)
    assert tf32_applies(cuda, None, (8, 0)) and tf32_applies(cuda, None, (9, 0))
    assert not tf32_applies(cuda, None, (7, 5))  # Volta, Turing: no TF32
    assert not tf32_applies(cuda, torch.bfloat16, (9, 0))  # autocast: the products are bfloat16 already
    assert not tf32_applies(torch.device("cpu"), None, None)
    assert precision(None, True, "none") == "float32 with TF32 matrix products"
    assert precision(None, False, "ddp") == "float32"
    assert precision(torch.bfloat16, False, "ddp") == "bfloat16 autocast (float32 weights)"
    assert precision(torch.bfloat16, False, "fsdp").startswith("bfloat16 (FSDP2 mixed precision")
