"""The fused decode kernel (cpu_kernel.fused_decode, fused_decode_heads): exact against the float64 materialised
method for MHA and GQA, masks and cache lengths from one slot to several blocks; the path generate takes, eager and
compiled (no graph break); the fallback when the kernel is off; and its errors."""

from __future__ import annotations

import pytest
import torch

from difftransformer import ModelConfig, TransformerLM
from difftransformer.core.attention import cpu_kernel, kernels
from difftransformer.core.attention.diff import differential_attention
from difftransformer.inference.cache import KVCache
from difftransformer.inference.generate import generate

CASES = {  # b, h, hkv, tq, tk, d, causal, masked
    "one slot": (1, 2, 2, 1, 1, 8, False, False),
    "one row, mha, 37 slots": (2, 4, 4, 1, 37, 16, False, False),
    "gqa, 2 heads per group": (2, 4, 2, 1, 300, 8, False, True),
    "gqa, 4 heads per group, 16 rows, causal": (1, 8, 2, 16, 300, 32, True, False),
    "several rows, causal and masked": (3, 4, 2, 5, 70, 8, True, True),
    "a long cache (several blocks), d 64": (1, 2, 1, 1, 2500, 64, False, True),
    "odd key counts (the 4-key loops' tails)": (1, 2, 1, 3, 7, 5, True, False),
    "a cache's mask: filled slots visible, one row with a hole": (2, 4, 2, 2, 90, 16, True, "filled"),
}


def case_inputs(b, h, hkv, tq, tk, d, masked, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 2, tq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, 2, tk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, tk, 2 * d, generator=g, dtype=dtype)
    mask = None
    if masked == "filled":  # rows whose visible keys are contiguous take the kernel's unmasked loops
        mask = torch.ones(b, 1, tq, tk, dtype=torch.bool)
        mask[..., -5:] = False  # the slots the cache has not filled
        mask[-1, :, -1, 40] = False  # except one row, with a hidden key among the visible ones
    elif masked:
        mask = torch.rand(b, 1, tq, tk, generator=g) > 0.3
        mask[0, :, 0] = False  # a row that may attend nothing: zeros, not NaN
        mask[..., -3:] = False  # unfilled cache slots at the end
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_the_decode_kernel_equals_the_float64_materialised_method(kernel, threads, case, dtype):
    b, h, hkv, tq, tk, d, causal, masked = CASES[case]
    q, k, v, mask = case_inputs(b, h, hkv, tq, tk, d, masked, dtype)
    lam = torch.tensor(0.43, dtype=dtype)
    ref = differential_attention(
        q.double(), k.double(), v.double(), lam.double(), scale=d**-0.5, causal=causal, mask=mask
    )[0]
    out = cpu_kernel.fused_decode(q, k, v, lam, d**-0.5, causal, mask)
    assert out.shape == ref.shape and out.dtype == dtype
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(out.double(), ref, **tol)
    if masked is True:
        assert not out[0, :, 0].any()  # the row that sees nothing


def test_a_query_view_with_other_strides_gives_the_same_rows(kernel):
    q, k, v, _ = case_inputs(1, 4, 2, 2, 50, 8, False, torch.float64)
    lam = torch.tensor(0.3, dtype=torch.float64)
    strided = q.transpose(0, 3).contiguous().transpose(0, 3)  # the same values, another layout
    assert strided.stride() != q.stride()
    torch.testing.assert_close(
        cpu_kernel.fused_decode(strided, k, v, lam, 0.3, True, None),
        cpu_kernel.fused_decode(q, k, v, lam, 0.3, True, None),
    )


def tiny(**overrides) -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", attention="diff", max_seq_len=64, **overrides)
    model = TransformerLM(cfg).double().eval()
    with torch.no_grad():  # the per-head norms' weights away from 1, so that a weight left out would show
        for layer in model.layers:
            if layer.attn.subln is not None:
                layer.attn.subln.weight.normal_(1.0, 0.3)
    return model


def decode_logits(model, tokens, padding):
    cache = KVCache(model, tokens.shape[0], 30)
    with torch.no_grad():
        out = [model(tokens[:, :20], mask=padding, cache=cache)]
        out += [model(tokens[:, i : i + 1], mask=padding, cache=cache) for i in range(20, 26)]
    return torch.cat(out, 1)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"head_norm": False},
        {"n_kv_heads": 2},
        {"head_norm_gain": 0.1},
        {"head_norm_gain": 0.1, "head_norm_gain_fixed": True},
    ],
    ids=str,
)
def test_decode_steps_through_the_fused_layer_equal_the_materialised_method(kernel, monkeypatch, overrides):
    model = tiny(**overrides)
    tokens = torch.randint(0, model.config.vocab_size, (2, 26), generator=torch.Generator().manual_seed(2))
    padding = torch.ones(2, 30, dtype=torch.bool)
    padding[1, :5] = False  # the second row left-padded
    calls = count_fused_calls(monkeypatch)
    fast = decode_logits(model, tokens, padding)
    assert calls == [model.config.n_layers] * 6  # every decode step, every layer; not the 20-token prefill
    for layer in model.layers:
        layer.attn.impl = "plain"
    ref = decode_logits(model, tokens, padding)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)


def count_fused_calls(monkeypatch) -> list[int]:
    """Patch fused_decode_heads to count its calls: one entry per model forward that calls it (layer 0 opens one)."""
    calls: list[int] = []
    real = cpu_kernel.fused_decode_heads

    def counting(attn, q, k, v, causal, mask):
        if attn.layer_idx == 0 or not calls:
            calls.append(0)
        calls[-1] += 1
        return real(attn, q, k, v, causal, mask)

    monkeypatch.setattr(cpu_kernel, "fused_decode_heads", counting)
    return calls


def test_generate_decodes_through_the_fused_kernel_and_not_when_it_is_off(kernel, monkeypatch):
    model = tiny()
    prompt = list(range(1, 21))  # longer than DECODE_ROWS: the prefill takes the block or sdpa path
    assert len(prompt) > kernels.DECODE_ROWS
    calls = count_fused_calls(monkeypatch)
    fused = generate(model, prompt, 8, temperature=0)
    assert calls == [model.config.n_layers] * 7  # 8 new tokens: 7 decode steps after the prefill
    calls.clear()
    monkeypatch.setattr(cpu_kernel, "decode_supported", lambda q, k, v: False)  # no kernel: the PyTorch rows
    assert generate(model, prompt, 8, temperature=0) == fused and calls == []


def test_training_and_probed_steps_do_not_take_the_decode_kernel(kernel, monkeypatch):
    from difftransformer.core.attention.logits import logit_probe

    model = tiny()
    calls = count_fused_calls(monkeypatch)
    tokens = torch.randint(0, 64, (1, 4))
    model(tokens).sum().backward()  # 4 rows with gradient: the training path
    with torch.no_grad(), logit_probe(lambda scores, allowed: scores):
        model(tokens)
    assert calls == []


def test_a_compiled_decode_step_calls_the_decode_op_without_a_graph_break(kernel):
    model = tiny(n_layers=1).float()
    graphs = []

    def backend(gm, example_inputs):  # Dynamo's graph as traced: the op must appear in it, whole
        graphs.append(gm)
        return gm.forward

    step = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    tokens = torch.randint(0, 64, (1, 10))
    cache = KVCache(model, 1, 16)
    with torch.no_grad():
        model(tokens[:, :6], cache=cache)
        compiled = step(tokens[:, 6:7], cache=cache, slots=torch.tensor([6]))
        cache_eager = KVCache(model, 1, 16)
        model(tokens[:, :6], cache=cache_eager)
        eager = model(tokens[:, 6:7], cache=cache_eager, slots=torch.tensor([6]))
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("difftx.diff_decode_heads" in t for t in targets), targets
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_bad_inputs_get_errors_that_name_them(kernel):
    q, k, v, _ = case_inputs(1, 2, 1, 1, 10, 8, False, torch.float32)
    lam = torch.tensor(0.5)
    with pytest.raises(RuntimeError, match="mask must be a contiguous boolean"):
        cpu_kernel.fused_decode(q, k, v, lam, 0.3, False, torch.ones(1, 1, 1, 10))  # not boolean
    with pytest.raises(RuntimeError, match="k holds 10 positions and v 9"):
        cpu_kernel.fused_decode(q, k, v[:, :, :9], lam, 0.3, False, None)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_kernel.fused_decode(q, k.double(), v, lam, 0.3, False, None)


def test_a_short_forward_without_a_cache_is_causal_through_the_fused_layer(kernel, monkeypatch):
    """At most DECODE_ROWS tokens without gradient and without a cache take the decode kernel too: it must apply
    causality itself (there is no cache mask then)."""
    model = tiny()
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    calls = count_fused_calls(monkeypatch)
    with torch.no_grad():
        fast = model(tokens)
        for layer in model.layers:
            layer.attn.impl = "plain"
        ref = model(tokens)
    assert calls == [model.config.n_layers]
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
