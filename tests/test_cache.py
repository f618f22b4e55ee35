"""The static KV cache: fixed buffers written at slots, the mask it gives every layer, and a compiled decode step."""

from __future__ import annotations

import pytest
import torch

from difftransformer import ModelConfig, TransformerLM
from difftransformer.errors import InputError
from difftransformer.inference.cache import KVCache


def tiny(attention="diff", **kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, attention=attention)
    return TransformerLM(ModelConfig(**{**cfg, **kw})).eval()


def test_the_buffers_are_the_modules_and_move_with_it():
    """Registered buffers (as gpt-fast's cache): what .to() moves and torch.compile sees at fixed addresses."""
    model = tiny()
    cache = KVCache(model, 2, 8)
    names = [name for name, _ in cache.named_buffers()]
    assert names == ["keys_0", "values_0", "keys_1", "values_1"]
    assert [b.data_ptr() for b in cache.buffers()] == [
        t.data_ptr() for pair in zip(cache.keys, cache.values, strict=True) for t in pair
    ]
    assert cache.state_dict() == {}  # never saved with anything
    moved = cache.to(torch.float64)
    assert moved is cache and all(b.dtype == torch.float64 for b in cache.keys + cache.values)


def test_buffers_have_each_layouts_shape_and_never_grow():
    diff, std = KVCache(tiny("diff", n_kv_heads=2), 3, 20), KVCache(tiny("standard", n_kv_heads=2), 3, 20)
    assert diff.keys[0].shape == (3, 1, 2, 20, 8) and diff.values[0].shape == (3, 1, 20, 16)  # 2 heads, 1 group
    assert std.keys[0].shape == (3, 2, 20, 8) and std.values[0].shape == (3, 2, 20, 8)
    assert len(diff.keys) == 2
    model = tiny()
    cache = KVCache(model, 1, 20)
    shapes = [tuple(k.shape) for k in cache.keys]
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 5)), cache=cache)
        model(torch.randint(0, 64, (1, 1)), cache=cache)
    assert [tuple(k.shape) for k in cache.keys] == shapes and cache.length == 6


def test_the_mask_lets_slot_i_see_slots_up_to_i_and_only_real_tokens():
    cache = KVCache(tiny(), 2, 5)
    padding = torch.tensor([[False, True, True, True, True], [True, True, True, True, True]])
    cache.prepare(torch.tensor([2, 3]), padding)
    expected_row0 = torch.tensor([[False, True, True, False, False], [False, True, True, True, False]])
    assert cache.mask.shape == (2, 1, 2, 5)
    assert torch.equal(cache.mask[0, 0], expected_row0)
    assert torch.equal(
        cache.mask[1, 0], torch.tensor([[True, True, True, False, False], [True, True, True, True, False]])
    )


@pytest.mark.parametrize("attention", ["diff", "diff_v2", "standard"])
def test_a_first_pass_without_padding_runs_causal_over_its_slots_and_builds_no_mask(attention, monkeypatch):
    """Its queries see slots 0..T-1 causally: the attention takes those slots with causality (half the products of
    the masked square over all max_len slots, and no T x max_len mask); a later pass, or a padded one, takes the
    mask. Both equal the model without a cache."""
    from difftransformer.core.attention import common

    model, tokens = tiny(attention), torch.randint(0, 64, (2, 7))
    seen = []
    real = common.attended

    def recording(attn, k, v, mask, cache, tq):
        out = real(attn, k, v, mask, cache, tq)
        seen.append((out[0].shape[-2], out[2] is None, common.causal_of(attn, cache)))
        return out

    for module in ("diff", "common"):  # V1's projection, and the one of the softmax variants
        monkeypatch.setattr(f"difftransformer.core.attention.{module}.attended", recording)
    cache = KVCache(model, 2, 16)
    with torch.no_grad():
        full = model(tokens)
        seen.clear()
        first = model(tokens[:, :5], cache=cache)
        assert cache.prefix == 5 and cache.mask is None and seen == [(5, True, True)] * 2  # two layers
        seen.clear()
        later = model(tokens[:, 5:], cache=cache)
        assert cache.prefix is None and cache.mask.shape == (1, 1, 2, 16) and seen == [(16, False, False)] * 2
        torch.testing.assert_close(torch.cat([first, later], 1), full, rtol=1e-5, atol=1e-5)
        padded = KVCache(model, 2, 16)
        model(tokens[:, :5], cache=padded, mask=torch.ones(2, 16, dtype=torch.bool))
        assert padded.prefix is None and padded.mask.shape == (2, 1, 5, 16)


def test_bad_caches_and_masks_are_named():
    model = tiny()
    with pytest.raises(InputError, match="a cache holds 1 to the model's max_seq_len=32 slots, got 40"):
        KVCache(model, 1, 40)
    cache = KVCache(model, 1, 8)
    with pytest.raises(InputError, match="the attention mask covers its 8 slots"):
        model(torch.zeros(1, 2, dtype=torch.long), mask=torch.ones(1, 2, dtype=torch.bool), cache=cache)
    with pytest.raises(InputError, match="the cache holds 8 slots; 9 were asked for"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=cache)


@pytest.mark.parametrize("attention", ["diff", "diff_v2", "standard"])
def test_explicit_slots_equal_the_automatic_ones(attention):
    model = tiny(attention)
    tokens = torch.randint(0, 64, (1, 9))
    auto, explicit = KVCache(model, 1, 12), KVCache(model, 1, 12)
    with torch.no_grad():
        first = model(tokens[:, :6], cache=auto)  # a first pass: causal over its own slots (cache.prefix)
        assert auto.prefix == 6 and auto.mask is None
        torch.testing.assert_close(model(tokens[:, :6], cache=explicit, slots=torch.arange(6)), first)  # the mask
        assert explicit.prefix is None and explicit.mask.shape == (1, 1, 6, 12)
        for mine, theirs in zip(explicit.buffers(), auto.buffers(), strict=True):
            mine.copy_(theirs)
        for i in range(6, 9):
            a = model(tokens[:, i : i + 1], cache=auto)
            b = model(tokens[:, i : i + 1], cache=explicit, slots=torch.tensor([i]))
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        full = model(tokens)
    torch.testing.assert_close(b[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)


def test_rotary_tables_stay_at_full_precision_and_are_not_saved():
    model = tiny()
    assert "rope_cos" not in model.state_dict()
    assert model.to(torch.bfloat16).rope_cos.dtype == torch.float32
    assert model.double().rope_cos.dtype == torch.float64
    assert tiny(rope_theta=None).rope_cos is None


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["diff", "standard"])
def test_a_compiled_decode_step_compiles_once_and_equals_eager(attention):
    model = tiny(attention, n_layers=1)
    tokens = torch.randint(0, 64, (1, 10))
    step = torch.compile(model, fullgraph=True, dynamic=False)
    cache = KVCache(model, 1, 16)
    with torch.no_grad():
        model(tokens[:, :6], cache=cache)  # eager prefill
        outs = [step(tokens[:, 6:7], cache=cache, slots=torch.tensor([6]))]  # compiles
        with torch._dynamo.config.patch(error_on_recompile=True):  # every later step reuses that graph
            outs += [step(tokens[:, i : i + 1], cache=cache, slots=torch.tensor([i])) for i in range(7, 10)]
        full = model(tokens)
    for i, out in zip(range(6, 10), outs, strict=True):
        torch.testing.assert_close(out[:, 0], full[:, i], rtol=1e-4, atol=1e-4)
