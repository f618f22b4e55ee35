"""Differential attention V1 against the paper's equations (tests/reference.py) and its properties."""

import warnings

import pytest
import torch
from conftest import LAMBDA_INIT, randomize_diff_params
from reference import diff_attn_v1

from difftransformer import MultiheadDiffAttn
from difftransformer.core.attention import kernels
from difftransformer.core.attention.diff import differential_attention, method_of

IMPLS = ("sdpa", "block", "plain")


def make_attn(embed_dim=64, num_heads=4, layer_idx=0, num_kv_heads=None, dtype=torch.float64, **kw):
    attn = MultiheadDiffAttn(embed_dim, num_heads, layer_idx, num_kv_heads, **kw).to(dtype)
    randomize_diff_params(attn)
    return attn


def params(attn):
    return {k: v.detach() for k, v in attn.state_dict().items()}


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1])
@pytest.mark.parametrize("layer_idx", [0, 3, 11])
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference_equations(num_kv_heads, layer_idx, impl):
    attn = make_attn(layer_idx=layer_idx, num_kv_heads=num_kv_heads, impl=impl)
    x = torch.randn(2, 23, 64, dtype=torch.float64)
    expected, expected_map = diff_attn_v1(x, params(attn), 4, num_kv_heads or 4, layer_idx)
    torch.testing.assert_close(attn(x), expected, rtol=1e-10, atol=1e-10)
    _, weights = attn(x, need_weights=True)
    torch.testing.assert_close(weights, expected_map, rtol=1e-10, atol=1e-10)


def test_lambda_far_from_zero_is_used():
    attn = make_attn(layer_idx=2)
    lam = attn.lambda_full().item()
    assert abs(lam - attn.lambda_init) > 0.05  # the randomised vectors moved lambda
    x = torch.randn(1, 9, 64, dtype=torch.float64)
    torch.testing.assert_close(attn(x), diff_attn_v1(x, params(attn), 4, 4, 2)[0])


def test_reference_state_dict_loads_strict_float32():
    """A state_dict with the reference code's names and layout loads as is and gives the same output."""
    torch.manual_seed(1)
    d, h = 16, 4
    sd = {
        "q_proj.weight": torch.randn(2 * h * d, 128) * 0.05,
        "k_proj.weight": torch.randn(2 * h * d, 128) * 0.05,
        "v_proj.weight": torch.randn(2 * h * d, 128) * 0.05,
        "out_proj.weight": torch.randn(128, 2 * h * d) * 0.05,
        "lambda_q1": torch.randn(d) * 0.3,
        "lambda_k1": torch.randn(d) * 0.3,
        "lambda_q2": torch.randn(d) * 0.3,
        "lambda_k2": torch.randn(d) * 0.3,
        "subln.weight": torch.rand(2 * d) + 0.5,
    }
    attn = MultiheadDiffAttn(128, h, layer_idx=5)
    attn.load_state_dict(sd, strict=True)
    assert sorted(attn.state_dict()) == sorted(sd)
    x = torch.randn(2, 40, 128)
    expected, _ = diff_attn_v1(x.double(), {k: v.double() for k, v in sd.items()}, h, h, 5)
    assert (attn(x).double() - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("layer_idx", range(13))
def test_lambda_init_schedule(layer_idx):
    attn = MultiheadDiffAttn(32, 2, layer_idx)
    assert attn.lambda_init == pytest.approx(LAMBDA_INIT[layer_idx], abs=5e-5)
    assert MultiheadDiffAttn(32, 2, 0).lambda_init == pytest.approx(0.2)


def test_lambda_starts_near_lambda_init_and_vectors_are_float32():
    attn = MultiheadDiffAttn(256, 4, 7)
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        p = getattr(attn, name)
        assert p.dtype == torch.float32 and p.shape == (32,)
        assert 0.03 < p.std().item() < 0.2  # N(0, 0.1)
    assert abs(attn.lambda_full().item() - attn.lambda_init) < 0.5


def test_rows_sum_to_one_minus_lambda_and_some_weights_negative():
    attn = MultiheadDiffAttn(64, 4, layer_idx=1).double()  # lambda at its initial value, about 0.36
    _, w = attn(torch.randn(3, 17, 64, dtype=torch.float64), need_weights=True)
    assert w.shape == (3, 4, 17, 17)
    lam = attn.lambda_full().item()
    assert 0 < lam < 1
    torch.testing.assert_close(w.sum(-1), torch.full_like(w[..., 0], 1 - lam))
    assert (w < 0).any()
    assert (w.triu(1) == 0).all()  # causal: nothing above the diagonal


@pytest.mark.parametrize("impl", IMPLS)
def test_causality(impl):
    attn = make_attn(impl=impl)
    x = torch.randn(1, 20, 64, dtype=torch.float64)
    y = attn(x)
    x2 = x.clone()
    x2[:, 12] += 1.0
    y2 = attn(x2)
    torch.testing.assert_close(y[:, :12], y2[:, :12], rtol=0, atol=1e-12)
    assert (y[:, 12:] - y2[:, 12:]).abs().max() > 1e-3


def test_non_causal_sees_the_future():
    attn = make_attn(causal=False)
    x = torch.randn(1, 10, 64, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 9] += 1.0
    assert (attn(x)[:, 0] - attn(x2)[:, 0]).abs().max() > 1e-3
    expected, _ = diff_attn_v1(x, params(attn), 4, 4, 0, causal=False)
    torch.testing.assert_close(attn(x), expected)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_fast_paths_equal_plain_path_float32(causal, num_kv_heads):
    """One module per impl, built from one state dict (so each runs its own method)."""
    torch.manual_seed(3)
    state = make_attn(embed_dim=128, num_kv_heads=num_kv_heads, dtype=torch.float32, causal=causal).state_dict()
    x = torch.randn(2, 77, 128, requires_grad=True)
    outs, grads = {}, {}
    for impl in IMPLS:
        attn = make_attn(embed_dim=128, num_kv_heads=num_kv_heads, dtype=torch.float32, causal=causal, impl=impl)
        attn.load_state_dict(state)
        assert attn.method is method_of(impl)
        outs[impl] = attn(x)
        grads[impl] = torch.autograd.grad(outs[impl].square().sum(), [x, *attn.parameters()])
    for impl in ("sdpa", "block"):
        assert (outs[impl] - outs["plain"]).abs().max().item() < 1e-5
        for g, g_plain in zip(
            grads[impl], grads["plain"], strict=True
        ):  # float32 rounding, relative to the gradient's scale
            assert (g - g_plain).abs().max() <= 2e-5 * g_plain.abs().max()


def test_block_kernel_with_many_blocks_and_a_mask():
    """Several query blocks, GQA and a padding mask: block == plain, forward and backward (float64)."""
    b, h, hkv, t, d = 2, 4, 2, 70, 8
    q = torch.randn(b, h, 2, t, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, 2, t, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, t, 2 * d, dtype=torch.float64, requires_grad=True)
    lam = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(b, 1, t, t, dtype=torch.bool)
    mask[0, :, :, :5] = False  # sequence 0 is left-padded by 5: its first 5 rows attend nothing
    plain, _ = differential_attention(q, k, v, lam, scale=d**-0.5, mask=mask)
    block = kernels._BlockDiffAttention.apply(q, k, v, lam, d**-0.5, True, mask, 16)
    torch.testing.assert_close(block, plain, rtol=1e-10, atol=1e-12)
    assert (plain[0, :, :5] == 0).all()
    g = torch.randn_like(plain)
    for a, b_ in zip(
        torch.autograd.grad(plain, (q, k, v, lam), g), torch.autograd.grad(block, (q, k, v, lam), g), strict=True
    ):
        torch.testing.assert_close(a, b_, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_mask_matches_unpadded_sequences(impl):
    """A left-padded batch gives, at real positions, what each sequence gives alone (with shifted positions)."""
    attn = make_attn(impl=impl)
    long, short = torch.randn(1, 12, 64, dtype=torch.float64), torch.randn(1, 8, 64, dtype=torch.float64)
    x = torch.cat([long, torch.cat([torch.zeros(1, 4, 64, dtype=torch.float64), short], 1)])
    pad = torch.ones(2, 12, dtype=torch.bool)
    pad[1, :4] = False
    positions = torch.stack([torch.arange(12), (torch.arange(12) - 4).clamp(min=0)])
    y = attn(x, mask=pad, positions=positions)
    torch.testing.assert_close(y[0], attn(long)[0])
    torch.testing.assert_close(y[1, 4:], attn(short)[0])
    keep = pad[:, None, :].expand(2, 12, 12)
    expected, _ = diff_attn_v1(x[:1], params(attn), 4, 4, 0, keep=keep[:1])
    torch.testing.assert_close(y[:1], expected)


def test_gqa_equals_mha_with_repeated_key_value_weights():
    gqa = make_attn(num_kv_heads=2, layer_idx=4)
    mha = MultiheadDiffAttn(64, 4, 4).double()
    sd = params(gqa)
    d = 8
    # group g serves heads 2g and 2g+1: repeat each group's (2, d) key rows and 2d value rows per head
    sd["k_proj.weight"] = sd["k_proj.weight"].view(2, 2 * d, 64).repeat_interleave(2, dim=0).reshape(-1, 64)
    sd["v_proj.weight"] = sd["v_proj.weight"].view(2, 2 * d, 64).repeat_interleave(2, dim=0).reshape(-1, 64)
    mha.load_state_dict(sd)
    x = torch.randn(2, 15, 64, dtype=torch.float64)
    torch.testing.assert_close(gqa(x), mha(x))
    # the wrong pairing (query half-head 2h+c with key half-head (2h+c) // rep) gives something else
    wrong = dict(sd)
    wrong["k_proj.weight"] = params(gqa)["k_proj.weight"].view(4, d, 64).repeat_interleave(2, 0).reshape(-1, 64)
    mha.load_state_dict(wrong)
    assert (gqa(x) - mha(x)).abs().max() > 1e-3


def test_gradients_reach_lambda_vectors_and_subln():
    attn = make_attn(dtype=torch.float32)
    attn(torch.randn(2, 11, 64)).square().sum().backward()
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2", "subln.weight", "q_proj.weight"):
        grad = attn.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_rope_none_and_positions():
    attn = make_attn(rope_theta=None)
    x = torch.randn(1, 6, 64, dtype=torch.float64)
    torch.testing.assert_close(attn(x), diff_attn_v1(x, params(attn), 4, 4, 0, rope_theta=None)[0])
    roped = make_attn()
    # rotary is relative: a constant shift changes nothing, spreading the positions does
    torch.testing.assert_close(roped(x, positions=torch.arange(6) + 100), roped(x))
    assert (roped(x, positions=torch.arange(6) * 3) - roped(x)).abs().max() > 1e-6
    with pytest.raises(ValueError, match="positions has 5 entries"):
        roped(x, positions=torch.arange(5))


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(embed_dim=100, num_heads=4), r"embed_dim 100 is not divisible by 2 \* num_heads = 8"),
        (dict(embed_dim=64, num_heads=4, num_kv_heads=3), "num_heads 4 is not divisible by num_kv_heads 3"),
        (dict(embed_dim=24, num_heads=4), "rotary embedding needs an even head size, got 3"),
        (dict(embed_dim=64, num_heads=0), "must be at least 1"),
        (dict(embed_dim=64, num_heads=4, layer_idx=-1), "layer_idx counts layers from 0"),
        (dict(embed_dim=64, num_heads=4, impl="flash"), "unknown impl 'flash'"),
    ],
)
def test_bad_dimensions_raise_clear_errors(args, message):
    args = {"layer_idx": 0, **args}
    with pytest.raises(ValueError, match=message):
        MultiheadDiffAttn(**args)


def test_odd_half_head_without_rope_is_fine():
    attn = MultiheadDiffAttn(24, 4, 0, rope_theta=None)  # half-heads of 3: odd, allowed without rotary
    out = attn(torch.randn(1, 3, 24))
    assert attn.head_dim == 3 and out.shape == (1, 3, 24) and torch.isfinite(out).all()


def test_bad_masks_raise_clear_errors():
    attn = make_attn(dtype=torch.float32)
    x = torch.randn(2, 5, 64)
    with pytest.raises(ValueError, match="must be boolean"):
        attn(x, mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="does not fit batch 2, 5 queries and 5 keys"):
        attn(x, mask=torch.ones(2, 6, dtype=torch.bool))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["auto", "sdpa", "block"])
def test_fast_paths_hold_no_full_attention_map(impl):
    """At T=2048 neither forward nor backward allocates a (T, T) float32 map (16 MiB) of even one head."""
    attn = MultiheadDiffAttn(256, 4, 0, impl=impl)
    x = torch.randn(1, 2048, 256, requires_grad=True)
    with torch.profiler.profile(profile_memory=True) as prof:
        attn(x).sum().backward()
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest < 2048 * 2048 * 4, largest
    with torch.no_grad(), torch.profiler.profile(profile_memory=True) as prof:
        attn(x, need_weights=True)  # the plain path does: this shows that the probe sees such allocations
    assert max(e.cpu_memory_usage for e in prof.events()) >= 2048 * 2048 * 4


def test_grouped_query_weights_of_unknown_origin_warn():
    """Reference-layout GQA weights load either way, but only the FlashAttention pairing computes our function:
    loading GQA weights that this library did not write warns; MHA weights and our own state dicts do not."""
    from difftransformer.core.attention import GQALayoutWarning, own_layout

    gqa = make_attn(num_kv_heads=2)
    plain = {k: v.clone() for k, v in gqa.state_dict().items()}  # a dict without torch's metadata, like a file's
    with pytest.warns(GQALayoutWarning, match=r"grouped-query weights \(4 heads, 2 key/value groups\) of unknown"):
        gqa.load_state_dict(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gqa.load_state_dict(gqa.state_dict())  # written by this library (module version 2): no warning
        with own_layout():
            gqa.load_state_dict(plain)
        make_attn().load_state_dict({k: v.clone() for k, v in make_attn().state_dict().items()})  # MHA: unambiguous


def test_every_impl_name_has_one_method_chosen_when_the_module_is_built():
    from difftransformer.core.config import DIFF_IMPLS

    assert set(DIFF_IMPLS) == set(kernels.METHODS) | {"plain"}
    for impl in ("auto", "sdpa", "block", "triton"):
        assert MultiheadDiffAttn(64, 2, 0, impl=impl).method is kernels.METHODS[impl]
    with pytest.raises(ValueError, match="unknown impl 'flash'; choose one of"):
        MultiheadDiffAttn(64, 2, 0, impl="flash")
    attn = MultiheadDiffAttn(64, 2, 0, impl="auto")
    attn.impl = "block"  # assigning after construction switches the method too (it was bound once, silently)
    assert attn.method is kernels.METHODS["block"] and attn.impl == "block"
    with pytest.raises(ValueError, match="unknown impl 'flash'"):
        attn.impl = "flash"
    assert attn.impl == "block"
    with pytest.raises(ValueError, match="unknown fast differential attention method 'plain'"):
        kernels.diff_method("plain")  # the materialised method is diff.differential_attention


def test_fixed_lambdas_hold_the_entry_value_only_without_gradient_and_only_inside():
    from difftransformer.core.attention.diff import fixed_lambdas

    outer, inner = make_attn(layer_idx=1), make_attn(layer_idx=2)
    model = torch.nn.ModuleList([outer, inner])
    before = [m.lambda_full().item() for m in model]
    with fixed_lambdas(model):
        with torch.no_grad():
            for m in model:
                m.lambda_q1.add_(0.5)  # the vectors change: the fixed values stay
            moved = [m.lambda_full().item() for m in model]
            assert moved == before
        assert [m.lambda_full().item() for m in model] != before  # with gradient: computed, differentiable
        assert outer.lambda_full().requires_grad
        with fixed_lambdas(outer), torch.no_grad():  # nested: the new value, then the outer one back
            assert outer.lambda_full().item() != before[0]
        with torch.no_grad():
            assert outer.lambda_full().item() == before[0]
    with torch.no_grad():
        assert [m.lambda_full().item() for m in model] != before  # outside: computed again
