"""TransformerLM: shapes, causality, errors, initialisation, and the three attention kinds."""

import math

import pytest
import torch
from conftest import LAMBDA_INIT

from difftransformer import ModelConfig, TransformerLM


@pytest.mark.parametrize("attention", ["diff", "diff_v2", "standard"])
def test_forward_shape_and_causality(attention):
    model = TransformerLM(ModelConfig.preset("tiny", attention=attention, n_kv_heads=4)).eval()
    tokens = torch.randint(0, 256, (2, 30))
    logits = model(tokens)
    assert logits.shape == (2, 30, 256) and logits.dtype == torch.float32
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % 256
    out = model(changed)
    torch.testing.assert_close(out[:, :20], logits[:, :20], rtol=0, atol=1e-6)
    assert (out[:, 20:] - logits[:, 20:]).abs().max() > 1e-4


def test_each_layer_knows_its_index():
    model = TransformerLM(ModelConfig.preset("tiny"))
    for i, block in enumerate(model.layers):
        assert block.attn.layer_idx == i
        assert block.attn.lambda_init == pytest.approx(LAMBDA_INIT[i], abs=5e-5)
        assert block.attn.num_heads == 4 and block.attn.head_dim == 16


def test_initialisation_is_as_documented():
    cfg = ModelConfig.preset("small")
    model = TransformerLM(cfg)
    std, residual = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
    assert model.embed.weight.std().item() == pytest.approx(std, rel=0.05)
    attn = model.layers[3].attn
    assert attn.q_proj.weight.std().item() == pytest.approx(std, rel=0.05)
    assert attn.out_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert model.layers[3].ffn.down_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert torch.equal(attn.subln.weight, torch.ones(2 * cfg.head_dim))
    assert attn.lambda_q1.std().item() == pytest.approx(0.1, rel=0.5)


def test_same_seed_gives_pair_the_same_non_attention_weights():
    torch.manual_seed(5)
    diff = TransformerLM(ModelConfig.preset("tiny"))
    torch.manual_seed(5)
    std = TransformerLM(ModelConfig.preset("tiny", attention="standard"))
    assert torch.equal(diff.embed.weight, std.embed.weight)
    assert torch.equal(diff.lm_head.weight, std.lm_head.weight)
    assert torch.equal(diff.layers[5].ffn.down_proj.weight, std.layers[5].ffn.down_proj.weight)
    torch.manual_seed(6)
    assert not torch.equal(TransformerLM(ModelConfig.preset("tiny")).embed.weight, diff.embed.weight)


def test_tied_embeddings():
    model = TransformerLM(ModelConfig.preset("tiny", tie_embeddings=True))
    assert model.lm_head.weight is model.embed.weight
    untied = TransformerLM(ModelConfig.preset("tiny"))
    assert untied.num_parameters() - model.num_parameters() == 256 * 128


def test_bad_inputs_raise_clear_errors():
    model = TransformerLM(ModelConfig.preset("tiny", max_seq_len=16)).eval()
    with pytest.raises(ValueError, match="17 tokens is longer than the model's context max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
        model(torch.full((1, 4), 300))
    model.train()  # in training mode the ids are not read on the host (the training data are checked when opened)
    with pytest.raises(IndexError):
        model(torch.full((1, 4), 300))
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.zeros(1, 4))


def test_padded_batch_matches_single_sequences():
    model = TransformerLM(ModelConfig.preset("tiny")).eval()
    a, b = torch.randint(0, 256, (1, 12)), torch.randint(0, 256, (1, 7))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)])
    pad = batch.new_ones(2, 12, dtype=torch.bool)
    pad[1, :5] = False
    positions = (pad.long().cumsum(-1) - 1).clamp(min=0)
    out = model(batch, mask=pad, positions=positions)
    torch.testing.assert_close(out[0], model(a)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1, 5:], model(b)[0], rtol=1e-5, atol=1e-5)


def test_training_step_reduces_loss():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (4, 33))
    losses = []
    for _ in range(5):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    assert losses[0] == pytest.approx(math.log(256), abs=0.1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "attention, impl", [("diff", "sdpa"), ("diff", "block"), ("diff_v2", "auto"), ("standard", "auto")]
)
def test_forward_traces_without_graph_breaks(attention, impl):
    """torch.compile friendliness: dynamo captures the whole forward in one graph."""
    model = TransformerLM(ModelConfig.preset("tiny", attention=attention, attn_impl=impl, n_layers=2))
    explanation = torch._dynamo.explain(model)(torch.randint(0, 256, (2, 32)))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
