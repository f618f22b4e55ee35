"""Activation-outlier statistics (the paper's Table 5) on hand-made tensors and hand-computable models."""

import json
import math

import pytest
import torch
from conftest import optional

from difftransformer.apps.outliers import measure
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.inference.magnitudes import MagnitudeStats


def test_statistics_of_a_hand_made_tensor():
    values = -torch.arange(1, 1001, dtype=torch.float32)  # |x| = 1..1000, signs must not matter
    stats = MagnitudeStats()
    stats.add(values[:400])
    stats.add(values[400:].view(20, 30))
    summary = stats.summary()
    assert [summary[k] for k in ("top1", "top2", "top3", "top10", "top100")] == [1000, 999, 998, 991, 901]
    assert summary["count"] == 1000
    assert summary["median"] == pytest.approx(500.5, rel=0.012)


def test_merge_is_the_statistics_of_both_streams():
    a, b = torch.randn(5000) * 3, torch.randn(7000)
    left, right, both = MagnitudeStats(), MagnitudeStats(), MagnitudeStats()
    left.add(a)
    right.add(b)
    both.add(torch.cat([a, b]))
    assert left.merge(right).summary() == both.summary()
    assert both.summary()["median"] == pytest.approx(float(torch.cat([a, b]).abs().median()), rel=0.012)


def test_fewer_values_than_a_rank_give_nan_and_non_finite_values_are_refused():
    stats = MagnitudeStats()
    stats.add(torch.tensor([2.0, -3.0]))
    summary = stats.summary()
    assert summary["top2"] == 2.0 and math.isnan(summary["top3"])
    with pytest.raises(ValueError, match="non-finite activations"):
        stats.add(torch.tensor([1.0, float("nan")]))


def _constant_model(kind: str) -> tuple[TransformerLM, float]:
    """One layer, no rotary, every token embedded as the all-ones vector and q = k = 0.5 * sum(normed input) in
    every component: every logit is d * (0.5 * D / sqrt(1 + eps))^2 / sqrt(d) with d the query head size."""
    cfg = ModelConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=4, max_seq_len=32, attention=kind, rope_theta=None)
    model = TransformerLM(cfg).eval()
    attn = model.layers[0].attn
    with torch.no_grad():
        model.embed.weight.fill_(1.0)
        attn.q_proj.weight.fill_(0.5)
        attn.k_proj.weight.fill_(0.5)
    d = 2  # 8 wide / 4 heads of 2; DIFF: 2 heads of two half-heads of 2
    component = 0.5 * 8 / math.sqrt(1 + cfg.norm_eps)
    return model, d * component**2 / math.sqrt(d)


@pytest.mark.parametrize("kind", ["diff", "standard"])
def test_logits_of_a_hand_computable_model(kind):
    model, logit = _constant_model(kind)
    tokens = torch.randint(0, 16, (3, 10))
    summary = measure(model, tokens, batch=2).summary()
    pooled = summary["attention_logits"]["pooled"]
    assert pooled["top1"] == pytest.approx(logit, rel=1e-5) and pooled["top100"] == pytest.approx(logit, rel=1e-5)
    assert pooled["median"] == pytest.approx(logit, rel=0.012)
    maps = 4  # standard: 4 heads; DIFF: 2 heads x 2 maps
    assert pooled["count"] == 3 * maps * (10 * 11 // 2)  # causal: the allowed entries only
    assert summary["tokens"] == 30


@pytest.mark.parametrize("kind", ["diff", "diff_v2", "standard"])
def test_hidden_states_are_the_residual_stream_after_each_block(kind):
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=4, max_seq_len=32, attention=kind)
    model = TransformerLM(cfg).eval()
    tokens = torch.randint(0, 32, (2, 12))
    summary = measure(model, tokens).summary()
    x, after = model.embed(tokens), []
    with torch.no_grad():
        for block in model.layers:
            x = block(x)
            after.append(x.abs().max().item())
    layers = summary["hidden_states"]["layers"]
    assert [layer["top1"] for layer in layers] == pytest.approx(after, rel=1e-5)
    assert [layer["count"] for layer in layers] == [2 * 12 * 16] * 3
    assert summary["hidden_states"]["pooled"]["top1"] == pytest.approx(max(after), rel=1e-5)


def test_measuring_leaves_the_model_and_its_outputs_as_they_were():
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, max_seq_len=32)
    model = TransformerLM(cfg).train()
    tokens = torch.randint(0, 32, (2, 12))
    with torch.no_grad():
        before = model.eval()(tokens)
    model.train()
    measure(model, tokens)
    assert model.training
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not b._forward_hooks and not b.attn._forward_pre_hooks for b in model.layers)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), before)


@pytest.mark.slow
def test_analyze_outliers_command_writes_the_report(tmp_path, prepared, capsys):
    optional("matplotlib")
    from conftest import small_config

    from difftransformer.apps.cli import main
    from difftransformer.training.loop import train

    for kind in ("diff", "standard"):
        train(small_config(prepared, tmp_path / kind, attention=kind, max_steps=2, ckpt_interval=2), quiet=True)
    out = tmp_path / "outliers"
    argv = ["analyze", "outliers", "--run", str(tmp_path / "diff"), "--run", str(tmp_path / "standard")]
    assert main([*argv, "--tokens", "128", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["outliers.md", "outliers.png", "results.json"]
    result = json.loads((out / "results.json").read_text())
    assert [r["attention"] for r in result["runs"]] == ["diff", "standard"]
    assert all(r["tokens"] == 128 for r in result["runs"])  # 4 windows of the runs' seq_len 32
    table = (out / "outliers.md").read_text()
    assert "| paper 3B diff | 400,000 | 38.8 |" in table and "(standard) | 128 |" in table
    assert "wrote" in capsys.readouterr().out


def test_quantiles_from_the_histogram():
    stats = MagnitudeStats()
    stats.add(torch.arange(1, 10001, dtype=torch.float32))
    assert stats.quantile(0.9) == pytest.approx(9000, rel=0.012)
    assert 9000 <= stats.quantile(0.9, upper=True) <= 9000 * 1.024  # the bin's upper edge
    assert stats.quantile(1.0, upper=True) == 10000  # never above the largest value
