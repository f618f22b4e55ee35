"""RMSNorm and SwiGLU on hand-computed values."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from difftransformer.core.layers import RMSNorm, SwiGLU


def test_rms_norm_divides_by_the_root_mean_square():
    norm = RMSNorm(2, eps=0.0).double()
    out = norm(torch.tensor([[3.0, 4.0]], dtype=torch.float64))  # rms = sqrt((9 + 16) / 2) = sqrt(12.5)
    torch.testing.assert_close(out, torch.tensor([[3.0, 4.0]], dtype=torch.float64) / 12.5**0.5)


def test_rms_norm_weight_scale_and_eps():
    norm = RMSNorm(2, eps=0.5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([2.0, -1.0]))
    x = torch.tensor([[1.0, 1.0]], dtype=torch.float64)  # mean square 1, + eps 0.5
    torch.testing.assert_close(norm(x, scale=0.25), torch.tensor([[0.5, -0.25]], dtype=torch.float64) / 1.5**0.5)
    assert RMSNorm(2, elementwise_affine=False).weight is None


def test_rms_norm_runs_in_float32_for_half_precision_inputs():
    x = torch.tensor([[1e-3, 2e-3, 3e-3, 4e-3]], dtype=torch.bfloat16)
    out = RMSNorm(4)(x)
    assert out.dtype == torch.bfloat16
    exact = x.float() / x.float().pow(2).mean().add(1e-5).sqrt()
    torch.testing.assert_close(out.float(), exact, rtol=1e-2, atol=0)


def test_swiglu_is_down_of_silu_gate_times_up_without_biases():
    ffn = SwiGLU(2, 3)
    with torch.no_grad():
        ffn.gate_proj.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        ffn.up_proj.weight.copy_(torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, -1.0]]))
        ffn.down_proj.weight.copy_(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 1.0]]))
    x = torch.tensor([[1.0, 2.0]])
    hidden = F.silu(torch.tensor([1.0, 2.0, 3.0])) * torch.tensor([2.0, 4.0, -1.0])
    torch.testing.assert_close(ffn(x)[0], torch.stack([hidden.sum(), hidden[2]]))
    assert all(m.bias is None for m in (ffn.gate_proj, ffn.up_proj, ffn.down_proj))
