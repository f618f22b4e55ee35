"""KV-cache generation: cached decoding equals the full forward pass, batching, sampling options, errors."""

import contextlib

import pytest
import torch
from conftest import SMALL, small_config

from difftransformer import ModelConfig, TransformerLM
from difftransformer.inference.cache import KVCache
from difftransformer.inference.generate import generate, sample_next
from difftransformer.store.tokenizer import ByteTokenizer


def tiny(attention="diff", **kw):
    torch.manual_seed(0)
    return TransformerLM(ModelConfig.preset("tiny", attention=attention, n_layers=3, **kw)).eval()


@pytest.mark.parametrize(
    "attention, impl",
    [("diff", "auto"), ("diff", "block"), ("diff", "sdpa"), ("diff_v2", "auto"), ("standard", "auto")],
)
@pytest.mark.parametrize("n_kv_heads", [8, 2])
def test_cached_decoding_equals_full_forward(attention, n_kv_heads, impl):
    model = tiny(attention, n_kv_heads=n_kv_heads, attn_impl=impl)
    tokens = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model, 2, 48)
        steps = [model(tokens[:, :25], cache=cache)] + [model(tokens[:, i : i + 1], cache=cache) for i in range(25, 40)]
    assert cache.length == 40
    assert (torch.cat(steps, 1) - full).abs().max().item() < 1e-5


def greedy_without_cache(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("attention", ["diff", "standard"])
def test_greedy_matches_recomputing_everything(attention):
    model = tiny(attention)
    prompt = [5, 17, 99, 3, 250, 41]
    assert generate(model, prompt, 20, temperature=0) == greedy_without_cache(model, prompt, 20)


def test_batched_left_padded_prompts_match_single_prompts():
    model = tiny(n_kv_heads=4)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [200, 100], [7, 7, 7, 7, 7]]
    batched = generate(model, prompts, 12, temperature=0)
    assert batched == [generate(model, p, 12, temperature=0) for p in prompts]


def test_sampling_options():
    model = tiny()
    prompt = [10, 20, 30]
    a = generate(model, prompt, 15, temperature=1.0, seed=3)
    assert a == generate(model, prompt, 15, temperature=1.0, seed=3)
    assert a != generate(model, prompt, 15, temperature=1.0, seed=4)
    greedy = generate(model, prompt, 15, temperature=0)
    assert generate(model, prompt, 15, temperature=1.0, top_k=1, seed=5) == greedy
    assert generate(model, prompt, 15, temperature=1.0, top_p=1e-6, seed=5) == greedy
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    draws = {int(sample_next(logits, 1.0, 2, None, torch.Generator().manual_seed(s))) for s in range(50)}
    assert draws == {2, 3}  # top-k 2 keeps the two largest
    # softmax = (0.032, 0.087, 0.237, 0.644): top-p keeps the smallest set whose mass reaches p
    for p, kept in ((0.6, {3}), (0.7, {2, 3}), (0.95, {1, 2, 3})):
        draws = {int(sample_next(logits, 1.0, None, p, torch.Generator().manual_seed(s))) for s in range(80)}
        assert draws == kept, p


def test_stop_tokens_and_strings():
    model = tiny()
    prompt = [65, 66, 67]
    free = generate(model, prompt, 30, temperature=0)
    stop = free[5]
    first = free.index(stop)
    assert generate(model, prompt, 30, temperature=0, stop_tokens=[stop]) == free[:first]
    tok = ByteTokenizer()
    text = tok.decode(free)
    target = text[3:5]
    out = generate(model, prompt, 30, temperature=0, stop_strings=[target], tokenizer=tok)
    assert target in tok.decode(out) and target not in tok.decode(out[:-1])
    streamed = []
    generate(model, prompt, 10, temperature=0, on_token=lambda row, t: streamed.append((row, t)))
    assert streamed == [(0, t) for t in free[:10]]


def test_prompt_longer_than_context():
    model = tiny(max_seq_len=32)
    with pytest.raises(
        ValueError, match="prompt 0 has 30 tokens; with 5 new tokens it exceeds the model's context of 32"
    ):
        generate(model, list(range(30)), 5)
    out = generate(model, list(range(30)), 5, temperature=0, truncate=True)
    assert out == generate(model, list(range(3, 30)), 5, temperature=0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate(model, [], 5)


def test_load_run_and_generate_command(prepared, tmp_path, capsys):
    from difftransformer import load_run
    from difftransformer.apps.cli import main
    from difftransformer.training.loop import train

    small = {**SMALL, "tie_embeddings": True}
    cfg = small_config(prepared, tmp_path / "run", model=small, max_steps=3, eval_interval=3, ckpt_interval=3)
    train(cfg, quiet=True)
    model, tok = load_run(tmp_path / "run")
    assert model.lm_head.weight is model.embed.weight and not model.training
    ids = generate(model, tok.encode("the "), 10, temperature=0)
    assert (
        main(
            [
                "generate",
                "--run",
                str(tmp_path / "run"),
                "--prompt",
                "the ",
                "--max-new-tokens",
                "10",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == "the " + tok.decode(ids) + "\n"


def test_load_run_errors(prepared, tmp_path):
    import shutil

    from difftransformer import load_run
    from difftransformer.store.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
    from difftransformer.training.loop import train

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run(tmp_path / "nope")
    cfg = small_config(prepared, tmp_path / "run", max_steps=2, eval_interval=2, ckpt_interval=2)
    train(cfg, quiet=True)
    run = tmp_path / "run"
    weights = list_checkpoints(run)[-1] / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="model.safetensors is damaged or not a safetensors file: .* truncated"):
        load_run(run)
    weights.write_bytes(good)
    config = (run / "model_config.json").read_text()
    (run / "model_config.json").write_text(config.replace('"n_layers": 2', '"n_layers": 3'))
    with pytest.raises(ValueError, match=r"model_config.json is not the config step_00000002 was written with \(n_la"):
        load_run(run)  # its state.json records the config it was written with
    model, optim, meta = load_checkpoint(list_checkpoints(run)[-1])
    del meta["model_config"]
    save_checkpoint(run, 2, model, optim, meta, keep_last=0)  # as a version without the record wrote it
    with pytest.raises(ValueError, match="does not match .*model_config.json: it has no layers.2"):
        load_run(run)  # the shapes still tell
    (run / "model_config.json").write_text(config.replace('"d_model": 64', '"d_model": 128'))
    with pytest.raises(ValueError, match="embed.weight has shape"):
        load_run(run)
    (run / "model_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="model_config.json is missing"):
        load_run(run)
    (run / "model_config.json").write_text(config)
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(FileNotFoundError, match="has no checkpoint"):
        load_run(run)


@pytest.mark.parametrize("causal", [True, False])
def test_decode_rows_path_equals_plain(causal):
    """The no-gradient path for a few query rows (decoding) against the plain path, with a padding mask and GQA."""
    from difftransformer.core.attention import kernels
    from difftransformer.core.attention.diff import differential_attention

    b, h, hkv, tq, tk, d = 2, 4, 2, 3, 20, 8
    q, k = torch.randn(b, h, 2, tq, d), torch.randn(b, hkv, 2, tk, d)
    v, lam = torch.randn(b, hkv, tk, 2 * d), torch.tensor(0.6)
    mask = torch.ones(b, 1, tq, tk, dtype=torch.bool)
    mask[1, :, :, :6] = False
    with torch.no_grad():
        fast = kernels.diff_attention(q, k, v, lam, scale=d**-0.5, causal=causal, mask=mask, impl="auto")
        plain, _ = differential_attention(q, k, v, lam, scale=d**-0.5, causal=causal, mask=mask)
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-6)


def test_a_tiny_temperature_samples_the_most_likely_token():
    """`generate --temperature 1e-39` ended in multinomial's traceback: logits / 1e-39 overflowed to inf, and softmax
    of inf is NaN. Divided after subtracting the row's largest, any positive temperature is a distribution."""
    from difftransformer.inference.generate import sample_next

    logits = torch.randn(3, 50) * 10
    generator = torch.Generator().manual_seed(0)
    for temperature in (1e-39, 1e-30, 1e-6):
        picked = sample_next(logits, temperature, None, None, generator)
        assert torch.equal(picked, logits.argmax(-1)), temperature
    assert torch.isfinite(torch.softmax((logits - logits.amax(-1, keepdim=True)) / 1e-39, -1)).all()


def test_lambda_is_computed_once_per_generation(monkeypatch):
    """generate fixes each layer's lambda on entry (the weights do not change during a generation): one computation
    per layer for the prefill and every decode step, and the same tokens as computing it at every step."""
    from difftransformer.core.attention import diff

    model, prompt = tiny(), list(range(1, 12))
    computed = []
    real = diff.softmax_dtype  # lambda_full's first call when it computes lambda

    def counting(tensor):
        computed.append(1)
        return real(tensor)

    monkeypatch.setattr(diff, "softmax_dtype", counting)
    fixed = generate(model, prompt, 6, temperature=0)
    assert len(computed) == model.config.n_layers
    computed.clear()
    monkeypatch.setattr("difftransformer.inference.generate.fixed_lambdas", lambda model: contextlib.nullcontext())
    assert generate(model, prompt, 6, temperature=0) == fixed
    assert len(computed) == model.config.n_layers * 6  # the prefill and five decode steps
