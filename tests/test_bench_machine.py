"""The FLOP count of a training step against torch's own FLOP counter, and the machine's matrix-product rate."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from difftransformer import ModelConfig, TransformerLM
from difftransformer.apps.bench_machine import matmul_rate, step_flops


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True}, {"n_kv_heads": 4}], ids=str)
def test_the_step_count_is_torchs_count_of_the_products_with_causality(overrides):
    """torch's FlopCounterMode counts every matrix product of a forward and backward; the materialising method
    multiplies full (T, T) maps, so its attention products are the causal count times 2T / (T + 1)."""
    cfg = ModelConfig.preset("tiny", max_seq_len=64, attn_impl="plain", **overrides)
    model = TransformerLM(cfg)
    batch, t = 2, 64
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (batch, t))).sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    linear = counts.pop("aten.mm")
    full_attention = counts.pop("aten.bmm")  # the maps' products
    assert not counts
    assert full_attention > 0
    assert step_flops(cfg, batch, t) == linear + full_attention * (t + 1) // (2 * t)


def test_diff_and_the_standard_model_count_the_same_attention_products():
    diff, std = (ModelConfig.preset("small", attention=a, max_seq_len=1024) for a in ("diff", "standard"))
    extra = step_flops(diff, 4, 1024) - step_flops(std, 4, 1024)
    assert 0 <= extra < 1e-3 * step_flops(std, 4, 1024)  # DIFF's layers hold a few more weights, no more products


def test_the_matmul_rate_is_positive_and_finite():
    rate = matmul_rate(size=128, repeats=2)
    assert 1e6 < rate < 1e15
