"""`difftx convert`: run -> Hugging Face directory -> run, checked with plain transformers."""

import pytest
import torch
import transformers

from difftransformer import generate, load_run
from difftransformer.cli import main
from difftransformer.train import TrainConfig, train


def small_run(prepared, out, attention):
    cfg = TrainConfig(
        data=str(prepared),
        out=str(out),
        attention=attention,
        seq_len=32,
        batch_size=4,
        max_steps=3,
        eval_interval=3,
        ckpt_interval=3,
        eval_tokens=128,
        threads=1,
        lr=1e-2,
        model={"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
    )
    train(cfg, quiet=True)
    return out


@pytest.mark.parametrize("attention, arch", [("diff", "DiffLlamaForCausalLM"), ("standard", "LlamaForCausalLM")])
def test_run_to_hf_loads_in_plain_transformers_and_generates_the_same(prepared, tmp_path, attention, arch):
    run = small_run(prepared, tmp_path / "run", attention)
    assert main(["convert", "--run", str(run), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # no custom code
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert type(hf_model).__name__ == arch
    ours, tok = load_run(run)
    prompt = "the attention noise"
    ids = hf_tok(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == tok.encode(prompt)
    with torch.no_grad():
        assert (hf_model(ids).logits - ours(ids)).abs().max().item() < 1e-4
    hf_out = hf_model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=tok.eot_id, eos_token_id=None)
    assert hf_out[0, ids.shape[1] :].tolist() == generate(ours, tok.encode(prompt), 20, temperature=0)

    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back, back_tok = load_run(tmp_path / "back")
    assert back.config.attention == attention and back_tok.encode(prompt) == tok.encode(prompt)
    with torch.no_grad():
        assert (back(ids) - ours(ids)).abs().max().item() < 1e-4


def test_convert_errors_write_nothing(prepared, tmp_path, capsys):
    run = small_run(prepared, tmp_path / "run", "diff")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    assert main(["convert", "--run", str(run), "--to", "hf", "--out", str(tmp_path / "taken")]) == 2
    assert "already exists" in capsys.readouterr().err and (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    gpt2.save_pretrained(tmp_path / "gpt2")
    assert main(["convert", "--from-hf", str(tmp_path / "gpt2"), "--out", str(tmp_path / "r1")]) == 2
    assert "holds ['GPT2LMHeadModel']" in capsys.readouterr().err
    assert main(["convert", "--from-hf", str(tmp_path / "nothing"), "--out", str(tmp_path / "r2")]) == 2
    assert "config.json is missing" in capsys.readouterr().err
    assert main(["convert", "--run", str(tmp_path / "nothing"), "--out", str(tmp_path / "r3")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in ("r1", "r2", "r3"))
    assert not list(tmp_path.glob(".r*"))
