"""The Triton differential-attention kernels (forward and backward), run in Triton's interpreter on CPU.

TRITON_INTERPRET must be set before triton_diff is imported (Triton before 3.4 decides at decoration time):
tests/conftest.py sets it when no GPU is present, before any test module is imported.
"""

import pytest
import torch
from conftest import randomize_diff_params
from reference import diff_attn_v1

from difftransformer import MultiheadDiffAttn, TransformerLM
from difftransformer.core.attention import kernels, triton_diff
from difftransformer.core.attention.diff import differential_attention
from difftransformer.core.config import ModelConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.gpu  # on CUDA tensors where there is a GPU (benchmarks/gpu.sh part 1)


def _inputs(b, h, hkv, tq, tk, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 2, tq, d, generator=gen)
    k = torch.randn(b, hkv, 2, tk, d, generator=gen)
    v = torch.randn(b, hkv, tk, 2 * d, generator=gen)
    lam = torch.tensor(0.37)
    return [t.to(DEVICE).requires_grad_() for t in (q, k, v, lam)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "b, h, hkv, tq, tk, d, causal",
    [
        (1, 2, 2, 40, 40, 16, True),  # blocks of 16: the last one partly out of range
        (2, 4, 2, 33, 33, 32, True),  # GQA: dK and dV sum over the two query heads of each group
        (1, 2, 1, 48, 48, 16, False),  # MQA, full attention
        (1, 2, 2, 7, 50, 16, True),  # queries are the last 7 positions (continuing from a cache)
        (1, 2, 2, 20, 37, 16, False),  # cross-length, no mask
    ],
)
def test_forward_and_backward_match_plain_path(b, h, hkv, tq, tk, d, causal):
    q, k, v, lam = _inputs(b, h, hkv, tq, tk, d)
    out = kernels.diff_attention(q, k, v, lam, scale=d**-0.5, causal=causal, impl="triton")
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, lam), grad)
    ref = differential_attention(q, k, v, lam, scale=d**-0.5, causal=causal)[0]
    ref_grads = torch.autograd.grad(ref, (q, k, v, lam), grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)
    for name, got, want in zip("qkv", grads[:3], ref_grads[:3], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"d{name}")
    torch.testing.assert_close(grads[3], ref_grads[3], rtol=1e-5, atol=1e-4)


def test_causal_rows_ignore_future_keys():
    q, k, v, lam = _inputs(1, 2, 2, 32, 32, 16)
    out = kernels.diff_attention(q, k, v, lam, scale=0.25, causal=True, impl="triton")
    with torch.no_grad():
        k2, v2 = k.clone(), v.clone()
        k2[..., 20:, :] += 5.0
        v2[:, :, 20:] -= 3.0
    out2 = kernels.diff_attention(q, k2, v2, lam, scale=0.25, causal=True, impl="triton")
    torch.testing.assert_close(out[:, :, :20], out2[:, :, :20], rtol=0, atol=0)
    assert (out[:, :, 20:] - out2[:, :, 20:]).abs().max() > 0.1


@pytest.mark.parametrize("num_kv_heads", [None, 1])
def test_layer_matches_reference_equations(num_kv_heads):
    torch.manual_seed(0)
    attn = MultiheadDiffAttn(64, 2, 3, num_kv_heads, impl="triton")
    randomize_diff_params(attn)
    params = {name: t.detach() for name, t in attn.state_dict().items()}
    x = torch.randn(2, 24, 64)
    expected, _ = diff_attn_v1(x.double(), {n: t.double() for n, t in params.items()}, 2, num_kv_heads or 2, 3)
    torch.testing.assert_close(attn.to(DEVICE)(x.to(DEVICE)).cpu().double(), expected, rtol=1e-4, atol=1e-5)


def test_masked_inputs_take_the_exact_pytorch_path():
    q, k, v, lam = _inputs(2, 2, 2, 12, 12, 16)
    mask = torch.ones(2, 1, 12, 12, dtype=torch.bool, device=DEVICE)
    mask[0, :, :, :3] = False  # left padding of the first sequence
    mask[0, :, :3] = False
    assert not triton_diff.supported(q, k, v, lam, True, mask)
    out = kernels.diff_attention(q, k, v, lam, scale=0.25, causal=True, mask=mask, impl="triton")
    ref = differential_attention(q, k, v, lam, scale=0.25, causal=True, mask=mask)[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_supported_shapes():
    q, k, v, lam = _inputs(1, 2, 2, 8, 8, 16)
    assert triton_diff.supported(q, k, v, lam, True, None)
    assert not triton_diff.supported(q.double(), k.double(), v.double(), lam, True, None)  # no float64 kernel
    assert not triton_diff.supported(q[..., :12], k[..., :12], v[..., :24], lam, True, None)  # head size 12
    assert not triton_diff.supported(q, k[:, :, :, :4], v[:, :, :4], lam, True, None)  # causal, more queries than keys


def test_every_operand_must_share_the_queries_dtype_and_device():
    q, k, v, lam = _inputs(1, 2, 2, 8, 8, 16)
    bf16 = [t.detach().bfloat16() for t in (q, k, v)]
    assert triton_diff.supported(*bf16, lam, True, None)
    assert not triton_diff.supported(bf16[0], k, v, lam, True, None)  # bfloat16 queries, a float32 KV cache
    assert not triton_diff.supported(q, k, v.bfloat16(), lam, True, None)
    assert not triton_diff.supported(q, k, v, lam.to(torch.int64), True, None)
    assert not triton_diff.supported(q, k, v, torch.tensor([0.3, 0.4], device=q.device), True, None)
    assert not triton_diff.supported(q, k.to("meta"), v, lam, True, None)  # another device
    assert not triton_diff.supported(q, k, v, lam.to("meta"), True, None)


def test_mixed_dtypes_fall_back_to_the_exact_path():
    """Under autocast, bfloat16 queries read a float32 KV cache: impl triton takes the auto path, not a mixed tl.dot."""
    q, k, v, lam = (t.detach() for t in _inputs(1, 2, 2, 1, 12, 16))
    with torch.autocast(DEVICE, dtype=torch.bfloat16), torch.no_grad():
        out = kernels.diff_attention(q.bfloat16(), k, v, lam, scale=0.25, causal=True, impl="triton")
    ref = differential_attention(q.bfloat16().float(), k, v, lam, scale=0.25, causal=True)[0]
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_model_training_step_matches_block_path():
    cfg = dict(vocab_size=50, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**cfg, attn_impl="triton")).to(DEVICE)
    reference = TransformerLM(ModelConfig(**cfg, attn_impl="block")).to(DEVICE)
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 50, (2, 24), device=DEVICE)
    losses = []
    for m in (model, reference):
        logits = m(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_cpu_tensors_without_the_interpreter_get_a_clear_error(monkeypatch):
    q, k, v, lam = (t.detach().cpu() for t in _inputs(1, 2, 2, 8, 8, 16))
    monkeypatch.setattr(triton_diff, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_diff.diff_attention_triton(q, k, v, lam, 0.25, True)


BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.slow
@pytest.mark.parametrize(
    "t, d, tile_dtype",
    [(t, 64, dtype) for t in (1, 63, 65, 130, 300) for dtype in (BF16, FP32)]
    + [(65, 128, BF16), (300, 128, BF16), (65, 128, FP32), (130, 128, FP32)],
)
def test_gpu_tiles_at_lengths_that_are_not_multiples_of_them(monkeypatch, tile_dtype, t, d):
    """The tiles a GPU launches with (triton_diff.TILES, bfloat16's and float32's), run in the interpreter on float32
    inputs at lengths off every tile boundary, forward and backward, against the float64 equations; GQA (two query
    heads per group) so that dK and dV sum over a group."""
    monkeypatch.setattr(triton_diff, "_launch_tiles", lambda kernel, d_, _: triton_diff.tiles(kernel, d_, tile_dtype))
    q, k, v, lam = _inputs(1, 2, 1, t, t, d, seed=t)
    out = triton_diff.diff_attention_triton(q, k, v, lam, d**-0.5, True)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, lam), grad)
    wide = [x.detach().double().requires_grad_() for x in (q, k, v, lam)]
    ref = differential_attention(*wide, scale=d**-0.5, causal=True)[0]
    ref_grads = torch.autograd.grad(ref, wide, grad.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("dq", "dk", "dv", "dlambda"), grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=name)
