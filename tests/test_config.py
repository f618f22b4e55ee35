"""ModelConfig: validation, presets, JSON round trip, and the matched-pair parameter counts."""

import json

import pytest

from difftransformer import ModelConfig, TransformerLM, count_parameters
from difftransformer.core.config import PRESETS


def expected_count(cfg: ModelConfig, attention: str) -> int:
    """Parameter count from the architecture's formula (docs/paper.md sections 1, 2 and 5), not from the code."""
    dim, d, layers = cfg.d_model, cfg.head_dim, cfg.n_layers
    kv = cfg.n_kv_heads * d
    attn = dim * dim + 2 * dim * kv + dim * dim  # q, k, v, out
    if attention == "diff":
        attn += 4 * d + 2 * d  # lambda vectors and subln.weight
    if attention == "diff_v2":
        attn += dim * dim + dim * cfg.n_heads  # doubled queries, lambda_proj
    per_layer = attn + 3 * dim * cfg.ffn_dim + 2 * dim  # SwiGLU and two norms
    embeddings = cfg.vocab_size * dim * (1 if cfg.tie_embeddings else 2)
    return layers * per_layer + embeddings + dim


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_count_matches_formula_and_pairs_match(name):
    counts = {a: count_parameters(ModelConfig.preset(name, attention=a)) for a in ("diff", "standard", "diff_v2")}
    for attention, count in counts.items():
        assert count == expected_count(ModelConfig.preset(name), attention)
    assert abs(counts["diff"] - counts["standard"]) / counts["standard"] < 1e-3


@pytest.mark.slow
def test_paper_sizes_match_their_names():
    sizes = {"830m": 830e6, "1.4b": 1.4e9, "2.8b": 2.8e9, "6.8b": 6.8e9, "13.1b": 13.1e9}
    for name, size in sizes.items():
        assert abs(count_parameters(ModelConfig.preset(name)) - size) / size < 0.02, name
    # the 13.1B model counted on the meta device: nothing is allocated
    assert count_parameters(ModelConfig.preset("13.1b")) == 13_123_046_400
    assert 1e6 <= count_parameters(ModelConfig.preset("tiny")) <= 5e6


def test_tiny_preset_allows_gqa():
    cfg = ModelConfig.preset("tiny")
    assert cfg.n_heads >= 4 and cfg.n_heads // 2 >= 2
    ModelConfig.preset("tiny", n_kv_heads=4)
    ModelConfig.preset("tiny", n_kv_heads=2)


def test_json_round_trip(tmp_path):
    cfg = ModelConfig.preset("small", attention="standard", n_kv_heads=4, dropout=0.1, rope_theta=None)
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    path = tmp_path / "config.json"
    cfg.to_json(path)
    assert ModelConfig.from_json(path) == cfg
    assert json.loads(path.read_text())["attention"] == "standard"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(attention="flash"), "ModelConfig.attention must be one of 'diff', 'diff_v2', 'standard'"),
        (dict(d_model=100), "ModelConfig.d_model 100 is not divisible by n_heads 8"),
        (dict(n_kv_heads=3), "ModelConfig.n_kv_heads 3 does not divide n_heads 8"),
        (dict(n_heads=2, n_kv_heads=1), "both must be even"),
        (dict(d_model=120, n_heads=8), "even head size"),
        (dict(vocab_size=0), r"ModelConfig.vocab_size must be an integer in \[1, 16,777,216\], got 0"),
        (dict(n_layers=2.5), r"ModelConfig.n_layers must be an integer in \[1, 1,024\], got 2.5"),
        (dict(dropout=1.0), r"ModelConfig.dropout must be a finite number in \[0, 1\), got 1.0"),
        (dict(norm_eps=0), r"ModelConfig.norm_eps must be a finite number in \(0, 1\)"),
        (dict(rope_theta=float("nan")), r"ModelConfig.rope_theta must be a finite number in \(0, inf\) or None"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling must be None or one of"),
        (dict(rope_scaling={"rope_type": "linear"}), r"needs exactly the keys \['factor'\]"),
        (dict(tie_embeddings=1), "tie_embeddings must be true or false, got 1"),
        (dict(attn_impl="flash"), "attn_impl must be one of"),
        (dict(attention="standard", attn_impl="block"), "attn_impl chooses among the methods of 'diff' attention"),
        (dict(attention="diff_v2", attn_impl="sdpa"), "'diff_v2' has one method, so leave it 'auto'"),
        (dict(bogus=1), "ModelConfig.bogus is not a ModelConfig field; known: vocab_size"),
    ],
)
def test_invalid_configs_raise_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.preset("tiny", **overrides)


def test_unknown_preset_and_bad_json(tmp_path):
    with pytest.raises(ValueError, match="preset 'huge' is unknown; choose one of tiny"):
        ModelConfig.preset("huge")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path / "bad.json")


@pytest.mark.parametrize(
    "overrides, heads, kv_heads, head_dim",
    [
        (dict(), 4, 4, 16),  # tiny: 8 standard heads of 16 -> 4 differential heads, half-heads of 16
        (dict(n_kv_heads=2), 4, 1, 16),
        (dict(diff_heads="all"), 8, 8, 8),
        (dict(attention="standard", n_kv_heads=2), 8, 2, 16),
        (dict(attention="diff_v2"), 8, 8, 16),
    ],
)
def test_the_config_owns_the_attention_shape(overrides, heads, kv_heads, head_dim):
    cfg = ModelConfig.preset("tiny", **overrides)
    assert (cfg.attention_heads, cfg.attention_kv_heads, cfg.attention_head_dim) == (heads, kv_heads, head_dim)
    attn = TransformerLM(cfg).layers[0].attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (heads, kv_heads, head_dim)
