"""ModelConfig(head_norm_gain="matched"): the per-layer initial weight of the per-head norm that gives the attention
blocks the standard model's output RMS at initialisation (difftransformer.core.head_norm_gain). Held against what
real models of every preset measure, on random tokens and on the built-in corpus (a 2048-token BPE, as the
language-model study trains on); its closed form checked where one exists; the option and its fixed-constant form
validated, built and kept through a re-initialisation."""

import dataclasses
import math
import statistics

import pytest
import torch

from difftransformer.core.config import PRESETS, ModelConfig
from difftransformer.core.head_norm_gain import (
    _rho,
    _square_sums,
    averaged_value_rms,
    matched_gains,
    token_collision,
    zipf_collision,
)
from difftransformer.core.model import TransformerLM, count_parameters
from difftransformer.errors import ConfigError, InputError

BASE = dict(vocab_size=97, d_model=64, n_layers=3, n_heads=4, max_seq_len=32)
LOW, HIGH = 0.8, 1.25  # the band issue #49 asks of the measured / computed gain, every layer
STUDY_SIZES = {"X": dict(d_model=64, n_layers=5, n_heads=2, max_seq_len=512)}  # the norm study's size (lm_norm)


class _Measured(Exception):
    """Raised by the last attention block's hook: the rest of the forward (the last feed-forward block and the head,
    a third of the paper sizes' compute) changes nothing measured."""


def attention_rms(model, tokens):
    rms = {}
    last = len(model.layers) - 1

    def record(out, i):
        rms[i] = out.double().pow(2).mean().sqrt()
        if i == last:
            raise _Measured

    hooks = [b.attn.register_forward_hook(lambda m, a, out, i=i: record(out, i)) for i, b in enumerate(model.layers)]
    try:
        with torch.no_grad():
            model(tokens)
    except _Measured:
        pass
    finally:
        for h in hooks:
            h.remove()
    return [float(rms[i]) for i in range(len(model.layers))]


def prefix_model(config, layers, seed):
    """The first ``layers`` blocks of ``config``'s model as the whole model initialises them (residual projections at
    init_std / sqrt(2 n_layers) of the whole depth), at norm weight 1. Built on the meta device and then initialised
    once: the same weights as TransformerLM(config) after torch.manual_seed(seed) (its own generators, seeded by its
    first draw, set every weight; test_a_prefix_model_has_the_built_models_weights), without the layers' own
    initialisation that it overwrites (half the build time of the paper sizes)."""
    torch.manual_seed(seed)
    init_seed = int(torch.randint(0, 2**62, ()).item())  # TransformerLM's first draw
    with torch.device("meta"):
        model = TransformerLM(
            dataclasses.replace(config, n_layers=layers, head_norm_gain=None, head_norm_collision=None)
        )  # noqa: E501
    model.to_empty(device="cpu")
    if model.config.tie_embeddings:  # to_empty gives the head a tensor of its own
        model.lm_head.weight = model.embed.weight
    model._rotary_tables()
    model.reset_parameters(init_seed)
    with torch.no_grad():
        for block in model.layers:
            for proj in (block.attn.out_proj, block.ffn.down_proj):
                proj.weight.mul_(math.sqrt(layers / config.n_layers))
    return model


def measured_over_rule(config, tokens, collision, layers, seed=0):
    """Per layer: (standard block RMS / DIFF block RMS at norm weight 1) / the rule's gain. The DIFF block's output
    is linear in its norm's weight, so the first ratio is the weight that matches the two."""
    plain = dataclasses.replace(config, head_norm_gain=None, head_norm_collision=None)
    # the paper sizes' first layers (a prefix) in bfloat16 matrix products: 3 times faster here, the same ratios to 4
    # decimals at 13.1b (0.98249 and 1.00318 in float32, 0.98246 and 1.00324)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=layers < config.n_layers):
        std = attention_rms(prefix_model(dataclasses.replace(plain, attention="standard"), layers, seed), tokens)
        diff = attention_rms(prefix_model(config, layers, seed), tokens)
    rule = matched_gains(config, collision, layers)
    return [s / d / g for s, d, g in zip(std, diff, rule, strict=True)]


@pytest.fixture(scope="module")
def corpus_bpe(tmp_path_factory):
    from difftransformer.store import corpus
    from difftransformer.store.tokenizer import train_bpe

    tokenizer = train_bpe(corpus.pydocs_documents(), 2048, tmp_path_factory.mktemp("bpe") / "tok")
    return torch.tensor(tokenizer.encode("".join(corpus.pydocs_documents())), dtype=torch.long)


def _configs():
    out = []  # all slow: the corpus's BPE tokenizer alone takes about 13 s to train
    for name in PRESETS:
        big = PRESETS[name]["d_model"] > 768
        out.append(pytest.param(name, 2 if big else None, id=name + ("-first-2-layers" if big else "")))
    out += [pytest.param(name, None, id=name) for name in STUDY_SIZES]
    return out


def _config(name):
    if name in STUDY_SIZES:
        return ModelConfig(vocab_size=2048, **STUDY_SIZES[name])
    return ModelConfig.preset(name, vocab_size=2048)


@pytest.mark.slow
@pytest.mark.parametrize("name, layers", _configs())
def test_the_rule_gives_every_layer_the_standard_models_attention_rms(name, layers, corpus_bpe):
    """Within 0.8-1.25 of the measured matched gain at every layer, on random tokens and on the built-in corpus, the
    rule told each stream's collision probability (1 / vocabulary; token_collision of the corpus's windows). The
    geometric mean over 3 seeds up to width 128 (the rule is the expected RMS; one model of width 64 strays from it
    by up to 28%), one seed above (one strays by up to 17% at width 256, less when wider); the first 2 layers of the
    paper's sizes, built as in the whole model (above width 2048 one window of random tokens). The gains span a factor
    of up to 20 over depth, so a rule without depth could not pass. At 13.1b's width (logits of std 2) it holds only
    with the softmax's exact sum of squared weights (_square_sums); a log-normal shortcut missed there. The Zipf
    default: test_the_zipf_default_holds_on_the_corpus_at_the_studys_sizes."""
    config = _config(name)
    t, layers = config.max_seq_len, layers or config.n_layers
    g = torch.Generator().manual_seed(0)
    windows = 2 if config.d_model <= 2048 else 1  # the widest models: one window, random tokens only (CI's time)
    random = torch.randint(0, 2048, (windows, t), generator=g)
    text = corpus_bpe[: windows * t].view(windows, t)
    streams = (("random", random, 1 / 2048), ("corpus", text, token_collision(text)))
    for label, tokens, collision in streams[: 2 if config.d_model <= 2048 else 1]:
        seeds = range(3 if config.d_model <= 128 else 1)
        seeds = [measured_over_rule(config, tokens, collision, layers, s) for s in seeds]
        ratios = [math.exp(statistics.fmean(math.log(r) for r in layer)) for layer in zip(*seeds, strict=True)]
        assert all(LOW <= r <= HIGH for r in ratios), (label, [round(r, 3) for r in ratios])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "small", "X"])
def test_the_zipf_default_holds_on_the_corpus_at_the_studys_sizes(name, corpus_bpe):
    """The data-free default (Zipf's law, 0.024 for 2048 tokens against the corpus's 0.01) within the band at the
    sizes the study and the demo train; at context 1024 and more its first layers fall to 0.76 (docs/guide/modules.md:
    set head_norm_collision there)."""
    config = dataclasses.replace(_config(name), head_norm_gain="matched")
    t = config.max_seq_len
    text = corpus_bpe[: 2 * t].view(2, t)
    assert 0.008 < token_collision(text) < 0.02 < zipf_collision(2048)
    seeds = [measured_over_rule(config, text, None, config.n_layers, seed) for seed in range(3)]
    ratios = [math.exp(sum(math.log(r) for r in layer) / 3) for layer in zip(*seeds, strict=True)]
    assert all(LOW <= r <= HIGH for r in ratios), [round(r, 3) for r in ratios]


def test_a_prefix_model_has_the_built_models_weights():
    """prefix_model's meta-device build: every tensor (weights, lambda vectors, rotary tables) equal to a model built
    as usual from the same seed, with the residual projections scaled as the whole depth's."""
    config = ModelConfig(**BASE, tie_embeddings=True)  # as the paper sizes
    torch.manual_seed(3)
    built = TransformerLM(dataclasses.replace(config, n_layers=2)).state_dict()
    prefix = prefix_model(config, 2, 3).state_dict()
    assert built.keys() == prefix.keys()
    for name, tensor in built.items():
        if name.endswith(("out_proj.weight", "down_proj.weight")):
            tensor = tensor * math.sqrt(2 / config.n_layers)
        torch.testing.assert_close(prefix[name], tensor, rtol=0, atol=0, msg=name)
    model = prefix_model(config, 2, 3)
    assert model.lm_head.weight is model.embed.weight
    buffers = dict(TransformerLM(dataclasses.replace(config, n_layers=2)).named_buffers())
    for name, tensor in model.named_buffers():
        torch.testing.assert_close(tensor, buffers[name], rtol=0, atol=0, msg=name)


def test_the_first_layers_gains_are_the_whole_models_first():
    """matched_gains(config, p, layers) stops the propagation after ``layers`` layers (the paper sizes' tests): the
    same values as the whole model's first ones, since a layer depends only on those before it."""
    config = ModelConfig.preset("small", vocab_size=2048)
    assert matched_gains(config, 0.01, 3) == matched_gains(config, 0.01)[:3]
    assert len(matched_gains(config, 0.01, 99)) == config.n_layers
    with pytest.raises(ValueError, match="layers counts the first layers to compute, at least 1"):
        matched_gains(config, 0.01, 0)


def test_token_collision_counts_equal_pairs():
    tokens = torch.tensor([[1, 1, 2, 3], [5, 5, 5, 5]])
    assert token_collision(tokens) == pytest.approx((2 / 12 + 12 / 12) / 2)  # 2 of 12 ordered pairs; all 12
    with pytest.raises(ValueError, match="positions"):
        token_collision(torch.tensor([[1]]))
    config = ModelConfig(**BASE, head_norm_gain="matched", head_norm_collision=0.5)
    assert config.head_norm_gains() == matched_gains(ModelConfig(**BASE), 0.5)
    with pytest.raises(ConfigError) as err:
        ModelConfig(**BASE, head_norm_collision=0.5)
    assert err.value.field == "head_norm_collision"


@pytest.mark.parametrize("init_std", [0.02, 0.2])
def test_the_first_layer_has_the_closed_form_of_independent_tokens(init_std):
    """Tokens that never coincide give the first layer T independent unit vectors (shrunk by the RMSNorm's epsilon
    to mean square c). A head at position t weighs its n = t + 1 positions by the softmax of logits of variance
    v = (init_std^2 D)^2, whose squared weights sum to pi_n on average: the mean square of its output is c pi_n (c / n,
    the causal mean, at v = 0), so rho^2 = c mean_n pi_n; derived by hand (pi_n is checked on its own:
    test_the_softmax_sum_of_squares_against_sampling_and_the_two_key_formula)."""
    config = ModelConfig(**{**BASE, "init_std": init_std})
    std2, eps, t = init_std**2, config.norm_eps, config.max_seq_len
    v = (std2 * config.d_model) ** 2
    c = std2 / (std2 + eps)
    expected = math.sqrt(c * _square_sums(t, v).mean().item())
    assert averaged_value_rms(config, 0.0)[0] == pytest.approx(expected, rel=1e-9)
    lam0 = 0.8 - 0.6 * math.exp(0)
    gain = matched_gains(config, 0.0)[0]
    assert gain == pytest.approx(init_std * math.sqrt(config.d_model) * expected / (1 - lam0), rel=1e-9)
    standard = matched_gains(dataclasses.replace(config, attention="standard", head_norm=True), 0.0)[0]
    assert standard == pytest.approx(gain * (1 - lam0), rel=1e-9)  # no 1 - lambda_init without lambda


def test_tokens_that_always_coincide_give_a_mean_of_one_vector():
    """Every position the same token: the causal mean is that one unit vector, RMS 1 (less the epsilon)."""
    config = ModelConfig(**BASE)
    std2 = config.init_std**2
    assert averaged_value_rms(config, 1.0)[0] == pytest.approx(math.sqrt(std2 / (std2 + config.norm_eps)), rel=1e-9)


def test_zipf_collision_is_the_sum_of_squared_frequencies():
    for v in (1, 2, 257):
        h = sum(1 / k for k in range(1, v + 1))
        assert zipf_collision(v) == pytest.approx(sum((1 / k / h) ** 2 for k in range(1, v + 1)), rel=1e-12)
    assert zipf_collision(1) == 1.0


def test_gains_grow_with_depth_and_with_text_and_the_option_builds_them():
    config = ModelConfig.preset("small", head_norm_gain="matched")
    gains = config.head_norm_gains()
    assert len(gains) == config.n_layers and all(a < b for a, b in zip(gains, gains[1:], strict=False))
    random = matched_gains(config, 1 / config.vocab_size)
    assert all(a > b for a, b in zip(gains, random, strict=True))  # text repeats tokens
    model = TransformerLM(config)
    for gain, block in zip(gains, model.layers, strict=True):
        assert torch.all(block.attn.subln.weight == torch.tensor(gain, dtype=torch.float32))
    model.reset_parameters(3)
    for gain, block in zip(gains, model.layers, strict=True):
        assert torch.all(block.attn.subln.weight == torch.tensor(gain, dtype=torch.float32))
    standard = TransformerLM(ModelConfig.preset("small", attention="standard", head_norm=True, head_norm_gain=0.25))
    assert all(torch.all(b.attn.subln.weight == 0.25) for b in standard.layers)
    assert count_parameters(config) == count_parameters(ModelConfig.preset("small"))  # built on the meta device too


def test_matched_saves_as_the_option_and_reloads_to_the_same_weights(tmp_path):
    config = ModelConfig(**BASE, head_norm_gain="matched")
    again = ModelConfig.from_json(config.to_json(tmp_path / "c.json"))
    assert again == config and again.head_norm_gains() == config.head_norm_gains()


@pytest.mark.parametrize("kind", [{}, {"attention": "standard", "head_norm": True}], ids=["diff", "standard"])
def test_a_fixed_gain_starts_as_the_learned_one_but_keeps_weight_one(kind):
    """head_norm_gain_fixed: the same function at initialisation (the forward, the lean training path, generation;
    the fused decode step in test_decode_kernel), the weight at 1, the gain a constant; the learned weight then moves
    lr per step against the fixed one's lr / gain (Adam), so one step apart the two models differ."""
    torch.manual_seed(0)
    learned = TransformerLM(ModelConfig(**BASE, **kind, head_norm_gain="matched"))
    torch.manual_seed(0)
    fixed = TransformerLM(ModelConfig(**BASE, **kind, head_norm_gain="matched", head_norm_gain_fixed=True))
    assert fixed.config.is_ablation and learned.config.is_ablation == bool(kind)  # head_norm on standard: an ablation
    assert all(torch.all(b.attn.subln.weight == 1) for b in fixed.layers)
    x = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(fixed.train()(x), learned.train()(x), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(fixed.eval()(x), learned.eval()(x), rtol=1e-5, atol=1e-6)
    from difftransformer.inference.generate import generate

    prompt = x[:1, :5]
    a = generate(fixed, prompt, max_new_tokens=6, temperature=0.0)
    b = generate(learned, prompt, max_new_tokens=6, temperature=0.0)
    assert a == b
    for model in (learned, fixed):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model.train()(x).float().square().mean().backward()
        opt.step()
    with torch.no_grad():
        assert not torch.allclose(fixed.eval()(x), learned.eval()(x), rtol=1e-4, atol=1e-5)


def test_a_fixed_gain_needs_a_gain_and_the_module_checks_it_too():
    with pytest.raises(ConfigError) as err:
        ModelConfig(**BASE, head_norm_gain_fixed=True)
    assert err.value.field == "head_norm_gain_fixed"
    from difftransformer.core.attention import MultiheadDiffAttn

    with pytest.raises(InputError, match="head_norm_gain_fixed"):
        MultiheadDiffAttn(64, 2, 0, head_norm_gain_fixed=True)


def test_a_fixed_gain_does_not_convert_to_hugging_face():
    pytest.importorskip("transformers")
    from difftransformer.interop.hf import to_hf

    model = TransformerLM(ModelConfig(**BASE, head_norm_gain=0.5, head_norm_gain_fixed=True))
    with pytest.raises(InputError, match="ablation"):
        to_hf(model)


def test_an_invalid_collision_is_refused():
    with pytest.raises(ValueError, match="collision"):
        matched_gains(ModelConfig(**BASE), 1.5)


@pytest.mark.parametrize("logit_var", [1e-3, 1.0, 4.2, 9.0])
def test_the_softmax_sum_of_squares_against_sampling_and_the_two_key_formula(logit_var):
    """pi_n = E[sum_j w_j^2], the averaging the rule needs: 1 at one key; at two keys 1/2 + E[tanh^2(d / 2)] / 2 with d
    the difference of two logits (variance 2v), by a plain grid here; at 8 and 64 keys within 3 standard errors of
    20,000 sampled softmaxes. The log-normal shortcut e^v / (n + e^v - 1) fails the sampled check at v = 4.2 (it is
    3 times too high at 64 keys)."""
    pi = _square_sums(64, logit_var)
    assert pi[0].item() == pytest.approx(1.0, abs=1e-12)
    d = torch.linspace(-60, 60, 200_001, dtype=torch.float64) * math.sqrt(2 * logit_var)
    density = torch.exp(-d * d / (4 * logit_var))
    two = 0.5 + 0.5 * float((torch.tanh(d / 2) ** 2 * density).sum() / density.sum())
    assert pi[1].item() == pytest.approx(two, rel=1e-6)
    g = torch.Generator().manual_seed(0)
    for n in (8, 64):
        logits = torch.randn(20_000, n, generator=g, dtype=torch.float64) * math.sqrt(logit_var)
        sums = (torch.softmax(logits, -1) ** 2).sum(-1)
        error = 3 * sums.std().item() / math.sqrt(len(sums))
        assert pi[n - 1].item() == pytest.approx(sums.mean().item(), abs=error), n


def test_the_rule_computes_on_the_cpu_under_any_default_device():
    """count_parameters builds the model under torch.device("meta"): the rule's first computation there (nothing
    cached yet) still runs on the CPU, where tensors have values, and gives the gains computed outside it."""
    config = ModelConfig(**BASE, head_norm_gain="matched")

    def fresh():
        _rho.cache_clear()
        _square_sums.cache_clear()

    fresh()
    with torch.device("meta"):
        inside = config.head_norm_gains()
    fresh()
    assert inside == config.head_norm_gains()
    fresh()
    assert count_parameters(config) == count_parameters(dataclasses.replace(config, head_norm_gain=None))


@pytest.fixture(scope="module")
def alternating(tmp_path_factory):
    """Data of one document "abab...": in any window of an even number T of its tokens each byte fills T/2 places,
    so two places hold the same token with probability (T/2 - 1) / (T - 1), 15/31 at T = 32."""
    from difftransformer.store.data import prepare
    from difftransformer.store.tokenizer import ByteTokenizer

    out = tmp_path_factory.mktemp("alternating") / "data"
    prepare(["ab" * 20_000], ByteTokenizer(), out, val_every=10)
    return out


def _train_matched(data, out, capsys, model: dict, *extra: str) -> tuple[ModelConfig, str]:
    import json

    from conftest import train_args

    from difftransformer.apps.cli import main

    flags = train_args(data, model=json.dumps({**SMALL_MATCHED, **model}), max_steps=2, eval_interval=2)
    assert main(["train", *flags, "--out", str(out), *extra]) == 0
    return ModelConfig.from_json(out / "model_config.json"), capsys.readouterr().out


SMALL_MATCHED = {"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32, "head_norm_gain": "matched"}


def test_difftx_train_measures_the_collision_and_the_run_keeps_it(alternating, tmp_path, capsys):
    """#58 item 4: with the matched gain and no collision given, `difftx train` measures the training data's token
    collision at the model's context before the model is built, says so, and records it in the run's config; a
    resume keeps it, and the loaded model's config gives the same gains. A collision given is kept as given."""
    from difftransformer.store.runs import load_run

    config, printed = _train_matched(alternating, tmp_path / "run", capsys, {})
    assert abs(config.head_norm_collision - 15 / 31) < 0.002, config.head_norm_collision  # one EOT at most
    assert f"(head_norm_collision) is {config.head_norm_collision:.4f}, measured on " in printed
    assert "windows of 32 tokens" in printed
    assert _resume(tmp_path / "run", capsys) == config
    assert load_run(tmp_path / "run")[0].config.head_norm_gains() == config.head_norm_gains()
    given, printed = _train_matched(alternating, tmp_path / "given", capsys, {"head_norm_collision": 0.3})
    assert given.head_norm_collision == 0.3 and "head_norm_collision" not in printed


def _resume(run, capsys) -> ModelConfig:
    from difftransformer.apps.cli import main

    assert main(["train", "--resume", str(run), "--max-steps", "3", "--quiet"]) == 0
    assert "head_norm_collision" not in capsys.readouterr().out  # not measured again
    return ModelConfig.from_json(run / "model_config.json")


def test_the_library_keeps_zipfs_default(alternating, tmp_path):
    """The Python API measures nothing: a TrainConfig with the matched gain and no collision trains with Zipf's law
    (the docstring of token_collision says when to measure)."""
    from conftest import small_config

    from difftransformer.training.loop import train

    train(small_config(alternating, tmp_path / "run", max_steps=1, model=SMALL_MATCHED, seq_len=32), quiet=True)
    assert ModelConfig.from_json(tmp_path / "run" / "model_config.json").head_norm_collision is None


def test_a_config_files_model_error_names_the_file_before_the_collision_is_measured(alternating, tmp_path, capsys):
    """Measuring the collision reads the model config before the Trainer does: an error in it still names the
    config file it came from, as the Trainer's does (it named --model, a flag not given)."""
    from difftransformer.apps.cli import main

    config = tmp_path / "c.toml"
    config.write_text('[model]\nvocab_size = 999\nhead_norm_gain = "matched"\n')
    argv = ["train", "--config", str(config), "--data", str(alternating), "--out", str(tmp_path / "run"), "--quiet"]
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith(f"difftx train: error: {config}: model sets vocab_size 999")
