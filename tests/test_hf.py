"""Parity with Hugging Face transformers (pinned in requirements-dev.txt: transformers 5.24.0).

DiffLlama is an independent implementation of the same function with another layout (docs/paper.md section 1):
the converter's permutation and weight folding are checked by comparing logits, both directions.
"""

import pytest
import torch
from conftest import optional, randomize_diff_params

from difftransformer import ModelConfig, TransformerLM
from difftransformer.interop.hf import from_hf, to_hf

transformers = optional("transformers")

TOL = 1e-4


def hf_rope(theta=10000.0):
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}


def hf_config(cls, num_key_value_heads, **extra):
    return cls(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        **hf_rope(),
        **extra,
    )


def max_error(ours, hf_model, tokens):
    with torch.no_grad():
        return (ours(tokens) - hf_model(tokens).logits).abs().max().item()


@pytest.mark.parametrize("n_kv_heads", [8, 4, 2])
def test_diff_to_hf_same_logits(n_kv_heads):
    model = TransformerLM(ModelConfig.preset("tiny", n_kv_heads=n_kv_heads, n_layers=3)).eval()
    for block in model.layers:
        randomize_diff_params(block.attn)  # lambda far from lambda_init, subln.weight not all ones
    hf_model = to_hf(model)
    assert type(hf_model).__name__ == "DiffLlamaForCausalLM"
    assert hf_model.config.num_attention_heads == 8 and hf_model.config.num_key_value_heads == n_kv_heads
    tokens = torch.randint(0, 256, (2, 50))
    assert max_error(model, hf_model, tokens) < TOL


@pytest.mark.parametrize("num_key_value_heads", [8, 4, 2])
def test_diffllama_from_hf_same_logits(num_key_value_heads):
    hf_model = transformers.DiffLlamaForCausalLM(hf_config(transformers.DiffLlamaConfig, num_key_value_heads)).eval()
    with torch.no_grad():
        for layer in hf_model.model.layers:
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(layer.self_attn, name).normal_(0, 0.5)
    model = from_hf(hf_model)
    assert model.config.attention == "diff" and model.config.n_kv_heads == num_key_value_heads
    tokens = torch.randint(0, 256, (2, 50))
    assert max_error(model, hf_model, tokens) < TOL


def test_round_trip_folds_subln_and_keeps_function():
    model = TransformerLM(ModelConfig.preset("tiny", n_kv_heads=4, n_layers=2)).eval()
    for block in model.layers:
        randomize_diff_params(block.attn)
    back = from_hf(to_hf(model))
    assert torch.equal(back.layers[0].attn.subln.weight, torch.ones(32))  # folded into out_proj
    tokens = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        assert (back(tokens) - model(tokens)).abs().max().item() < TOL


def test_a_head_norm_gain_exports_as_the_papers_architecture():
    # the gain is an initial weight of subln, which the export folds into o_proj like any other value of it
    model = TransformerLM(ModelConfig.preset("tiny", n_layers=2, head_norm_gain=0.1)).eval()
    tokens = torch.randint(0, 256, (2, 30))
    assert max_error(model, to_hf(model), tokens) < TOL
    assert from_hf(to_hf(model)).config.head_norm_gain is None  # what remains is a weight, not an option


@pytest.mark.parametrize("n_kv_heads", [8, 2])
def test_standard_both_ways(n_kv_heads):
    model = TransformerLM(ModelConfig.preset("tiny", attention="standard", n_kv_heads=n_kv_heads, n_layers=2)).eval()
    hf_model = to_hf(model)
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    tokens = torch.randint(0, 256, (2, 30))
    assert max_error(model, hf_model, tokens) < TOL
    llama = transformers.LlamaForCausalLM(hf_config(transformers.LlamaConfig, n_kv_heads)).eval()
    assert max_error(from_hf(llama), llama, tokens) < TOL


def test_tied_embeddings_convert():
    model = TransformerLM(ModelConfig.preset("tiny", tie_embeddings=True, n_layers=2)).eval()
    hf_model = to_hf(model)
    assert hf_model.config.tie_word_embeddings
    assert max_error(model, hf_model, torch.randint(0, 256, (1, 20))) < TOL
    assert from_hf(hf_model).config.tie_embeddings


def test_unsupported_conversions_raise_clear_errors():
    with pytest.raises(ValueError, match="'diff_v2' has no Hugging Face architecture"):
        to_hf(TransformerLM(ModelConfig.preset("tiny", attention="diff_v2", n_layers=1)))
    with pytest.raises(ValueError, match="rope_theta=None"):
        to_hf(TransformerLM(ModelConfig.preset("tiny", rope_theta=None, n_layers=1)))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="cannot convert GPT2LMHeadModel"):
        from_hf(gpt2)


@pytest.mark.parametrize("flag, named", [("attention_bias", "the attention projections"), ("mlp_bias", "the MLP")])
def test_biases_are_named_where_they_are(flag, named):
    """attention_bias=True was reported as an MLP bias."""
    transformers = optional("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, **{flag: True})  # fmt: skip
    with pytest.raises(ValueError, match=f"{flag} is true: {named} have biases"):
        from_hf(transformers.LlamaForCausalLM(cfg))
