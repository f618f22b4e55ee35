"""RMSNorm and SwiGLU on hand-computed values, and their lean training paths under torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from difftransformer.core.config import ModelConfig
from difftransformer.core.layers import RMSNorm, SwiGLU
from difftransformer.core.model import TransformerLM


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


def plain_rms_norm(x, weight, eps):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def grads(fn, inputs, grad):
    out = fn()
    return out, torch.autograd.grad(out, inputs, grad)


def test_lean_rms_norm_and_swiglu_have_the_plain_expressions_gradients():
    """The training paths save less (recompute in backward) but compute the same values and gradients (float64)."""
    torch.manual_seed(0)
    norm, ffn = RMSNorm(8).double(), SwiGLU(8, 12).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 8, dtype=torch.float64)
    params = [x, norm.weight]
    out, lean = grads(lambda: norm(x, scale=0.7), params, g)
    ref, plain = grads(lambda: plain_rms_norm(x, norm.weight * 0.7, norm.eps), params, g)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(lean, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    params = [x, *ffn.parameters()]
    out, lean = grads(lambda: ffn(x), params, g)
    ref, plain = grads(lambda: ffn.down_proj(F.silu(ffn.gate_proj(x)) * ffn.up_proj(x)), params, g)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(lean, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_head_norm_project_has_the_plain_gradients_with_and_without_a_norm_weight():
    from difftransformer.core.layers import head_norm_project

    torch.manual_seed(1)
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)  # (B, H, T, e)
    proj = torch.nn.Linear(12, 6, bias=False).double()
    g = torch.randn(2, 5, 6, dtype=torch.float64)
    for norm in (RMSNorm(4).double(), RMSNorm(4, elementwise_affine=False).double()):
        if norm.weight is not None:
            with torch.no_grad():
                norm.weight.uniform_(0.5, 1.5)
        params = [x, proj.weight] + ([norm.weight] if norm.weight is not None else [])
        weight = norm.weight * 0.4 if norm.weight is not None else torch.full((4,), 0.4, dtype=torch.float64)
        out, lean = grads(lambda n=norm: head_norm_project(x, n, 0.4, proj), params, g)
        ref, plain = grads(
            lambda w=weight: proj(plain_rms_norm(x, w, 1e-5).transpose(1, 2).reshape(2, 5, 12)), params, g
        )
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for a, b in zip(lean, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        with torch.no_grad():  # inference calls the modules themselves
            torch.testing.assert_close(head_norm_project(x, norm, 0.4, proj), ref)


def test_lean_layers_save_only_what_they_cannot_recompute():
    """Bytes autograd saves, against counts by hand: the norm keeps x and 1/rms per row, SwiGLU its input (for the
    projections' weight gradients) and the gate and up outputs, not silu(gate) or the product."""
    from difftransformer.apps.bench import saved_activation_bytes

    b, t, d, f = 2, 7, 8, 12
    x = torch.randn(b, t, d, requires_grad=True)
    assert saved_activation_bytes(lambda: RMSNorm(d)(x).sum()) == 4 * (b * t * d + b * t)
    assert saved_activation_bytes(lambda: SwiGLU(d, f)(x).sum()) == 4 * (b * t * d + 2 * b * t * f)


def test_lean_layers_under_bfloat16_autocast_match_the_plain_expressions():
    from difftransformer.core.layers import head_norm_project

    torch.manual_seed(2)
    ffn, norm, proj = SwiGLU(16, 24), RMSNorm(8), torch.nn.Linear(16, 16, bias=False)
    x = torch.randn(2, 6, 16, requires_grad=True)
    heads = torch.randn(2, 2, 6, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        ref = [ffn(x), head_norm_project(heads, norm, 0.5, proj)]
    # one autocast region each: torch 2.6 keeps a weight's bfloat16 cast made without a history (under no_grad, or
    # inside the lean layers' autograd functions) for the rest of the region, and a later use of the weight in the
    # same region then has no gradient
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lean = [ffn(x), head_norm_project(heads, norm, 0.5, proj)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = [
            ffn.down_proj(F.silu(ffn.gate_proj(x)) * ffn.up_proj(x)),
            proj(norm(heads, scale=0.5).transpose(1, 2).reshape(2, 6, 16)),
        ]
    for out, r, p in zip(lean, ref, plain, strict=True):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, r)
        torch.testing.assert_close(out, p)
    params = [x, heads, *ffn.parameters(), *norm.parameters(), proj.weight]
    got = torch.autograd.grad(sum(o.float().square().sum() for o in lean), params, allow_unused=True)
    want = torch.autograd.grad(sum(o.float().square().sum() for o in plain), params, allow_unused=True)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


@pytest.mark.parametrize("seq", [64, 200])
def test_diff_model_saves_no_more_for_backward_than_the_standard_model(seq):
    """The issue-15 target on activations: DIFF at or below the standard model (same width and depth), both lean."""
    from difftransformer.apps.bench import _lm_loss, saved_activation_bytes
    from difftransformer.core.config import ModelConfig
    from difftransformer.core.model import TransformerLM

    x = torch.randint(0, 256, (2, seq + 1))
    saved = {}
    for attention in ("diff", "standard"):
        model = TransformerLM(ModelConfig.preset("small", attention=attention, n_layers=2, vocab_size=256))
        saved[attention] = saved_activation_bytes(lambda m=model: _lm_loss(m, x))
    assert saved["diff"] <= saved["standard"], saved


def test_lean_paths_leave_hooked_or_wrapped_modules_to_their_forward():
    """A forward hook on down_proj or out_proj still fires in training: such modules take the plain path."""
    from difftransformer.core.attention import MultiheadDiffAttn

    ffn, attn = SwiGLU(8, 12), MultiheadDiffAttn(16, 2, 0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    seen = []
    ffn.down_proj.register_forward_hook(lambda *_: seen.append("down_proj"))
    attn.out_proj.register_forward_pre_hook(lambda *_: seen.append("out_proj"))
    attn.subln.register_forward_hook(lambda *_: seen.append("subln"))
    ffn(x).sum().backward()
    attn(torch.randn(2, 5, 16, requires_grad=True)).sum().backward()
    assert seen == ["down_proj", "subln", "out_proj"]
    assert type(SwiGLU(8, 12)(x).grad_fn).__name__ == "_LeanSwiGLUDownBackward"  # unhooked: the lean path


@pytest.mark.slow  # torch.compile
@pytest.mark.parametrize("attention", ["diff", "standard"])
def test_compiled_blocks_give_every_weight_its_gradient(attention):
    """Each block under torch.compile (dynamo's tracing, the eager backend: no code generation) gives every weight
    the eager gradient. In torch 2.11, the GPU machine's, tracing the lean RMSNorm, whose forward returned a tensor
    multiplied in place, gave the norms' weights no gradient at all (make test-gpu-image runs this there)."""
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", n_layers=2, attention=attention)
    eager, compiled = TransformerLM(cfg), TransformerLM(cfg)
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.layers:
        block.compile(backend="eager")
    x = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    for model in (eager, compiled):
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    for (name, got), want in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        assert want.grad.abs().max() > 0, name
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6, msg=name)
