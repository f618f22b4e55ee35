"""The standard baseline and V2 against plain implementations of their equations (tests/reference.py)."""

import pytest
import torch
from reference import diff_attn_v2, standard_attn

from difftransformer import ModelConfig, MultiheadAttention, MultiheadDiffAttnV2, TransformerLM
from difftransformer.core.attention import ATTENTION


def params(module):
    return {k: v.detach() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])
def test_standard_matches_reference(num_kv_heads):
    attn = MultiheadAttention(64, 8, 0, num_kv_heads).double()
    x = torch.randn(2, 19, 64, dtype=torch.float64)
    torch.testing.assert_close(attn(x), standard_attn(x, params(attn), 8, num_kv_heads))
    y, w = attn(x, need_weights=True)
    torch.testing.assert_close(y, attn(x))
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 8, 19, dtype=torch.float64))


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_v2_matches_reference(num_kv_heads):
    attn = MultiheadDiffAttnV2(64, 4, 0, num_kv_heads).double()
    with torch.no_grad():
        attn.lambda_proj.weight.normal_(0, 0.5)  # lambda far from 0.5 and different per token and head
    x = torch.randn(2, 21, 64, dtype=torch.float64)
    expected, expected_map = diff_attn_v2(x, params(attn), 4, num_kv_heads)
    torch.testing.assert_close(attn(x), expected)
    y, w = attn(x, need_weights=True)
    torch.testing.assert_close(w, expected_map)
    lam = torch.sigmoid(x @ attn.lambda_proj.weight.T).transpose(1, 2)  # (B, H, T)
    torch.testing.assert_close(w.sum(-1), 1 - lam)
    assert (w < 0).any()


def test_v2_layout_and_parameter_shapes():
    attn = MultiheadDiffAttnV2(128, 8, 3, 2)
    shapes = {k: tuple(v.shape) for k, v in attn.state_dict().items()}
    assert shapes == {
        "q_proj.weight": (2 * 8 * 16, 128),
        "k_proj.weight": (2 * 16, 128),
        "v_proj.weight": (2 * 16, 128),
        "out_proj.weight": (128, 8 * 16),
        "lambda_proj.weight": (8, 128),
    }


@pytest.mark.parametrize("name", ["diff", "diff_v2", "standard"])
def test_same_interface_by_name(name):
    cfg = ModelConfig.preset("tiny", attention=name, n_kv_heads=4)
    attn = ATTENTION[name].from_config(cfg, layer_idx=2)
    x = torch.randn(2, 10, cfg.d_model)
    y = attn(x)
    y2, w = attn(x, need_weights=True)
    assert y.shape == x.shape and w.shape[-2:] == (10, 10) and w.shape[0] == 2
    assert (y - y2).abs().max() < 1e-5
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[0, :3] = False
    assert attn(x, mask=pad).shape == x.shape
    model = TransformerLM(cfg)
    assert type(model.layers[0].attn) is ATTENTION[name]
