"""The model's ablation options (paper Table 6): each changes what it should and nothing else, is validated, and is
saved and reloaded with a run."""

import math

import pytest
import torch
from conftest import LAMBDA_INIT, small_config

from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.errors import ConfigError, InputError

BASE = dict(vocab_size=97, d_model=64, n_layers=3, n_heads=8, max_seq_len=32)


def build(**options):
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**BASE, **options)).eval()


def tokens():
    return torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))


def test_defaults_are_the_paper_architecture():
    cfg = ModelConfig(**BASE)
    assert (cfg.head_norm, cfg.lambda_init, cfg.diff_heads, cfg.is_ablation) == (None, None, "half", False)
    old = {k: v for k, v in cfg.to_dict().items() if k not in ("head_norm", "lambda_init", "diff_heads")}
    assert ModelConfig.from_dict(old) == cfg  # configs saved before these options existed load unchanged


def test_no_head_norm_removes_only_the_norm():
    ref, ablated = build(), build(head_norm=False)
    ref_sd, abl_sd = ref.state_dict(), ablated.state_dict()
    assert set(ref_sd) - set(abl_sd) == {f"layers.{i}.attn.subln.weight" for i in range(3)}
    assert set(abl_sd) <= set(ref_sd)
    for name, value in abl_sd.items():
        assert torch.equal(value, ref_sd[name]), name  # the same initialisation of everything else
    x = tokens()
    assert not torch.allclose(ref(x), ablated(x))
    for block in ref.layers:  # the reference with its norm replaced by the (1 - lambda_init) factor alone
        block.attn.subln.forward = lambda a, scale=1.0: a * scale
    with torch.no_grad():  # the inference path calls the norm module (training fuses it with out_proj)
        torch.testing.assert_close(ref(x), ablated(x))


def test_constant_lambda_init_changes_only_lambda_init():
    ref, ablated = build(), build(lambda_init=0.5)
    for name, value in ablated.state_dict().items():
        assert torch.equal(value, ref.state_dict()[name]), name
    for i, (a, b) in enumerate(zip(ref.layers, ablated.layers, strict=True)):
        assert a.attn.lambda_init == pytest.approx(LAMBDA_INIT[i], abs=5e-5)
        assert b.attn.lambda_init == 0.5
        assert (b.attn.lambda_full() - a.attn.lambda_full()).item() == pytest.approx(0.5 - a.attn.lambda_init)
    assert not torch.allclose(ref(tokens()), ablated(tokens()))


def test_all_heads_doubles_the_maps_and_halves_their_size():
    ref, ablated, std = build(), build(diff_heads="all"), build(attention="standard")
    a, b = ref.layers[0].attn, ablated.layers[0].attn
    assert (a.num_heads, a.head_dim) == (4, 8)  # the paper: n_heads / 2 heads of the standard head size
    assert (b.num_heads, b.head_dim) == (8, 4)  # as many differential heads as standard heads, half the size
    assert b.q_proj.weight.shape == a.q_proj.weight.shape and b.out_proj.weight.shape == a.out_proj.weight.shape
    per_layer = {m: m.num_parameters() - std.num_parameters() for m in (ref, ablated)}
    assert per_layer[ref] == 3 * (4 * 8 + 2 * 8)  # lambda vectors (4d) and the norm (2d), d = 8
    assert per_layer[ablated] == 3 * (4 * 4 + 2 * 4)  # the same with d = 4
    _, maps = b(ablated.embed(tokens()), need_weights=True)
    assert maps.shape[1] == 8


def test_standard_with_head_norm_normalises_each_head():
    ref, normed = build(attention="standard"), build(attention="standard", head_norm=True)
    assert set(normed.state_dict()) - set(ref.state_dict()) == {f"layers.{i}.attn.subln.weight" for i in range(3)}
    for name, value in ref.state_dict().items():
        assert torch.equal(value, normed.state_dict()[name]), name
    attn, plain = normed.layers[0].attn, ref.layers[0].attn
    with torch.no_grad():
        attn.subln.weight.uniform_(0.5, 1.5)
    seen = []
    plain.out_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x = torch.randn(2, 12, 64)
    plain(x)  # the heads' concatenated output of the same weights without the norm: (B, T, 8 heads * 8)
    heads = seen[0].view(2, 12, 8, 8)
    heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.subln.weight
    torch.testing.assert_close(attn(x), attn.out_proj(heads.flatten(2)), rtol=1e-4, atol=1e-5)


def test_head_norm_gain_scales_only_the_initial_norm_weight_and_so_each_attention_output():
    ref, gained = build(), build(head_norm_gain=0.125)
    assert not gained.config.is_ablation  # an initialisation, not another architecture
    for name, value in gained.state_dict().items():
        expected = torch.full_like(value, 0.125) if name.endswith("subln.weight") else ref.state_dict()[name]
        assert torch.equal(value, expected), name
    h = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(3))
    for a, b in zip(ref.layers, gained.layers, strict=True):
        with torch.no_grad():
            torch.testing.assert_close(b.attn(h), 0.125 * a.attn(h))
        torch.testing.assert_close(b.attn.train()(h), 0.125 * a.attn.train()(h))  # the lean training path too
    gained.reset_parameters(7)  # a re-initialisation keeps the gain
    assert all(torch.all(block.attn.subln.weight == 0.125) for block in gained.layers)


@pytest.mark.parametrize(
    "options",
    [
        dict(attention="standard", head_norm_gain=0.5),
        dict(attention="standard", head_norm_gain="matched"),
        dict(attention="diff_v2", head_norm_gain=0.5),
        dict(attention="diff_v2", head_norm_gain="matched"),
        dict(head_norm=False, head_norm_gain="matched"),
        dict(head_norm_gain="Matched"),
        dict(head_norm=False, head_norm_gain=0.5),
        dict(head_norm_gain=0.0),
        dict(head_norm_gain=-1.0),
        dict(head_norm_gain=float("inf")),
        dict(head_norm_gain="0.5"),
    ],
)
def test_invalid_head_norm_gains_are_refused(options):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**{**BASE, **options})
    assert err.value.field == "head_norm_gain"


def test_the_module_refuses_a_gain_without_a_norm():
    from difftransformer.core.attention import MultiheadDiffAttn

    with pytest.raises(InputError, match="head_norm_gain"):
        MultiheadDiffAttn(64, 4, 0, head_norm=False, head_norm_gain=0.5)
    with pytest.raises(InputError, match="head_norm_gain"):
        MultiheadDiffAttn(64, 4, 0, head_norm_gain=float("nan"))


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(attention="diff_v2", head_norm=True), "head_norm"),
        (dict(attention="standard", lambda_init=0.5), "lambda_init"),
        (dict(attention="diff_v2", diff_heads="all"), "diff_heads"),
        (dict(lambda_init=1.0), "lambda_init"),
        (dict(lambda_init=-0.1), "lambda_init"),
        (dict(lambda_init=float("nan")), "lambda_init"),
        (dict(head_norm="no"), "head_norm"),
        (dict(diff_heads="quarter"), "diff_heads"),
        (dict(d_model=48, n_heads=16, diff_heads="all"), "diff_heads"),  # head size 3 cannot be halved
        (dict(d_model=80, n_heads=8, diff_heads="all"), "rope_theta"),  # halves of 5: no rotary pairs
    ],
)
def test_invalid_options_name_the_field(options, field):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**{**BASE, **options})
    assert err.value.field == field


def test_all_heads_allows_an_odd_number_of_standard_heads():
    cfg = ModelConfig(**{**BASE, "d_model": 48, "n_heads": 3, "diff_heads": "all"})
    assert TransformerLM(cfg).layers[0].attn.num_heads == 3


def test_ablations_do_not_export_to_hugging_face():
    from difftransformer.interop.hf import to_hf

    with pytest.raises(InputError, match="ablation option"):
        to_hf(build(head_norm=False))


@pytest.mark.slow
@pytest.mark.parametrize(
    "attention, options",
    [
        ("diff", {"head_norm": False, "lambda_init": 0.8}),
        ("diff", {"diff_heads": "all"}),
        ("standard", {"head_norm": True}),
        ("diff", {"head_norm_gain": 0.25}),
    ],
)
def test_options_are_saved_and_reloaded_with_the_run(tmp_path, prepared, attention, options):
    from difftransformer.training.config import resume_config
    from difftransformer.training.loop import Trainer

    run = tmp_path / "run"
    cfg = small_config(prepared, run, attention=attention, max_steps=4, ckpt_interval=2, model={**_small(), **options})
    trainer = Trainer(cfg, quiet=True)
    trainer.fit(until=2)
    trainer.close()
    resumed = Trainer(resume_config(run), resume=True, quiet=True)
    for name, value in options.items():
        assert getattr(resumed.model_config, name) == value
    assert resumed.step_idx == 2
    rows = resumed.fit()
    resumed.close()
    assert rows[-1]["step"] == 4 and math.isfinite(rows[-1]["val_loss"])


def _small():
    from conftest import SMALL

    return dict(SMALL)
