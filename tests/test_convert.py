"""`difftx convert`: run -> Hugging Face directory -> run, checked with plain transformers."""

import pytest
import torch
from conftest import SMALL, optional, small_config

from difftransformer import generate, load_run
from difftransformer.apps.cli import main
from difftransformer.training.loop import train

transformers = optional("transformers")


def small_run(prepared, out, attention):
    cfg = small_config(
        prepared,
        out,
        attention=attention,
        max_steps=3,
        eval_interval=3,
        ckpt_interval=3,
        lr=1e-2,
        model={**SMALL, "n_kv_heads": 2},
    )
    train(cfg, quiet=True)
    return out


@pytest.mark.parametrize("attention, arch", [("diff", "DiffLlamaForCausalLM"), ("standard", "LlamaForCausalLM")])
def test_run_to_hf_loads_in_plain_transformers_and_generates_the_same(prepared, tmp_path, attention, arch, capsys):
    run = small_run(prepared, tmp_path / "run", attention)
    assert main(["convert", "--run", str(run), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    said = capsys.readouterr().out
    load = "load it with transformers.AutoModelForCausalLM.from_pretrained"
    assert said == f"{run} -> {tmp_path / 'hf'}: a {arch} directory with a model card (README.md); {load}\n"
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
    back_dir = tmp_path / "back"
    said = capsys.readouterr().out
    sample = f"sample with: difftx generate --run {back_dir} --prompt 'Your text'"
    assert said == f"{tmp_path / 'hf'} -> {back_dir}: a run directory; {sample}\n"
    back, back_tok = load_run(back_dir)
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


def test_diff_from_llama_head_mapping():
    from difftransformer.interop.hf import diff_from_standard, from_hf

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    llama = transformers.LlamaForCausalLM(cfg)
    base = from_hf(llama)
    diff = diff_from_standard(base)
    d, rep = 8, 2
    a, b = base.layers[0].attn, diff.layers[0].attn
    assert b.num_heads == 4 and b.num_kv_heads == 2
    q_std, q_diff = a.q_proj.weight.view(8, d, 64), b.q_proj.weight.view(4, 2, d, 64)
    out_std, out_diff = a.out_proj.weight.view(64, 8, d), b.out_proj.weight.view(64, 4, 2, d)
    for g in range(2):
        for r in range(rep):
            for c in range(2):
                llama_head = (2 * g + c) * rep + r  # uses key/value head 2g + c
                assert torch.equal(q_diff[g * rep + r, c], q_std[llama_head])
                assert torch.equal(out_diff[:, g * rep + r, c], out_std[:, llama_head])
    assert torch.equal(b.k_proj.weight, a.k_proj.weight) and torch.equal(b.v_proj.weight, a.v_proj.weight)
    assert b.lambda_full().item() == pytest.approx(-1.0, abs=1e-5)


@pytest.mark.slow
def test_llama_converted_to_diff_starts_close_and_trains(prepared, tmp_path, capsys):
    """A trained standard model -> Llama directory -> DIFF run: its loss starts near the original's, then training
    from it (--init-from) lowers it."""
    import torch.nn.functional as F

    from difftransformer.store.data import TokenData, eval_windows

    cfg = small_config(
        prepared,
        tmp_path / "std",
        attention="standard",
        seq_len=64,
        batch_size=8,
        max_steps=60,
        eval_interval=60,
        ckpt_interval=60,
        eval_tokens=512,
        lr=3e-3,
    )
    train(cfg, quiet=True)
    assert main(["convert", "--run", str(tmp_path / "std"), "--out", str(tmp_path / "llama")]) == 0
    capsys.readouterr()
    assert (
        main(["convert", "--from-hf", str(tmp_path / "llama"), "--attention", "diff", "--out", str(tmp_path / "diff0")])
        == 0
    )
    assert "a DIFF model built from a standard one: an approximation, near its loss" in capsys.readouterr().out
    std, _ = load_run(tmp_path / "std")
    diff, _ = load_run(tmp_path / "diff0")
    assert diff.config.attention == "diff"
    windows = eval_windows(TokenData(prepared, "val"), 64, 64 * 16)

    def loss(model):
        with torch.no_grad():
            return F.cross_entropy(model(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten()).item()

    original, converted = loss(std), loss(diff)
    assert converted < original + 0.5 < 5.0  # far below a fresh model's ln(257) = 5.55
    tuned = small_config(
        prepared,
        tmp_path / "diff1",
        init_from=str(tmp_path / "diff0"),
        model={},  # the model comes from init_from
        seq_len=64,
        batch_size=8,
        max_steps=20,
        eval_interval=20,
        ckpt_interval=20,
        eval_tokens=512,
        lr=1e-3,
    )
    train(tuned, quiet=True)
    after, _ = load_run(tmp_path / "diff1")
    assert loss(after) < converted


def test_exports_of_earlier_versions_import_with_the_right_end_token(prepared, tmp_path):
    """Exports written before the token ids were made consistent say eos 2 and bos 1 (Llama's defaults) in the
    generation config, and bos 1 in the model config: those ordinary byte tokens are not taken for special ones."""
    import json

    from difftransformer.store.tokenizer import ByteTokenizer

    run = small_run(prepared, tmp_path / "run", "diff")
    assert main(["convert", "--run", str(run), "--out", str(tmp_path / "hf")]) == 0
    config, generation = (tmp_path / "hf" / "config.json"), (tmp_path / "hf" / "generation_config.json")
    config.write_text(json.dumps({**json.loads(config.read_text()), "bos_token_id": 1}))
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "bos_token_id": 1, "eos_token_id": 2}))
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    _, tok = load_run(tmp_path / "back")
    assert isinstance(tok, ByteTokenizer) and tok.stop_ids == [256] and tok.bos_id is None


def _llama_with_its_own_end_token(corpus_dir, out, eos_in_both: bool = False):
    """A Llama directory whose tokenizer has <s> and </s> (no <|endoftext|>), its end and begin tokens."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from difftransformer.store.corpus import find_files, iter_documents

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<eot>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(iter_documents(find_files([corpus_dir])), trainer=trainer)
    bos, end, eot = (tok.token_to_id(t) for t in ("<s>", "</s>", "<eot>"))
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, bos_token_id=bos, eos_token_id=[end, eot] if eos_in_both else end,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    if eos_in_both:
        generation = out / "generation_config.json"
        generation.write_text(json.dumps({**json.loads(generation.read_text()), "eos_token_id": [end, eot]}))
    return bos, end, eot


def test_an_end_token_listed_twice_stops_generation_once(corpus_dir, tmp_path):
    import json

    _, end, eot = _llama_with_its_own_end_token(corpus_dir, tmp_path / "llama", eos_in_both=True)
    assert main(["convert", "--from-hf", str(tmp_path / "llama"), "--out", str(tmp_path / "run")]) == 0
    _, tok = load_run(tmp_path / "run")
    assert tok.stop_ids == [end, eot] and tok.eot_id == end
    assert json.loads((tmp_path / "run" / "tokenizer_spec.json").read_text())["stop"] == ["<eot>"]


@pytest.mark.slow
def test_eval_of_an_imported_llama_uses_its_own_end_token(corpus_dir, tmp_path, capsys):
    """A run imported from a Llama whose end token is </s>: lm-eval gets that token (it got <|endoftext|>, which the
    tokenizer lacks: IndexError), and both measures agree."""
    import json

    optional("lm_eval")
    _llama_with_its_own_end_token(corpus_dir, tmp_path / "llama")
    assert main(["convert", "--from-hf", str(tmp_path / "llama"), "--out", str(tmp_path / "run")]) == 0
    jsonl = tmp_path / "task.jsonl"
    jsonl.write_text(json.dumps({"text": "attention noise cancels when two maps are subtracted"}) + "\n")
    capsys.readouterr()
    assert main(["eval", "--run", str(tmp_path / "run"), "--jsonl", str(jsonl)]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{") :])
    assert abs(result["lm_eval"]["bits_per_byte"] - result["ours"]["bits_per_byte"]) < 1e-4


def _hf_dir(prepared, tmp_path):
    run = small_run(prepared, tmp_path / "run", "diff")
    assert main(["convert", "--run", str(run), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    return tmp_path / "hf"


def _damage(path, how: str) -> None:
    import struct

    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    if how == "truncated":
        data = data[: len(data) - 100]
    elif how == "header length":
        data[:8] = struct.pack("<Q", 1 << 40)
    elif how == "header":
        data[8] = ord("X")  # the header JSON's opening brace
    elif how == "dtype":
        data[8 : 8 + length] = bytes(data[8 : 8 + length]).replace(b'"F32"', b'"Q32"', 1)
    elif how == "overlap":  # the second tensor's bytes start inside the first one's
        import json

        header = json.loads(bytes(data[8 : 8 + length]))
        names = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])
        first, second = header[names[0]]["data_offsets"], header[names[1]]["data_offsets"]
        header[names[1]]["data_offsets"] = [first[0], first[0] + second[1] - second[0]]
        text = json.dumps(header, separators=(",", ":")).encode()  # no longer than the original: padded to it
        data[8 : 8 + length] = text.ljust(length)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, message", [
    ("truncated", "lies at bytes"),
    ("header length", "its header claims 1099511627776 bytes"),
    ("header", "its header is not valid JSON"),
    ("dtype", "has the unknown dtype 'Q32'"),
    ("overlap", "share bytes"),
])  # fmt: skip
def test_a_damaged_hf_weights_file_is_a_clear_error(prepared, tmp_path, capsys, how, message):
    """A truncated file once ended in SafetensorError's traceback ("incomplete metadata"), a garbage header length in
    "header too large"; every damage is named now, before transformers reads the file, and nothing is written."""
    hf = _hf_dir(prepared, tmp_path)
    _damage(hf / "model.safetensors", how)
    capsys.readouterr()
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err
    assert f"{hf / 'model.safetensors'} is damaged or not a safetensors file: " in err and message in err, err
    assert not (tmp_path / "back").exists()


def test_hf_weights_missing_or_not_finite_are_refused(prepared, tmp_path, capsys):
    """transformers starts a weight its files lack at random with a warning; a NaN imported with exit 0 once."""
    from safetensors.torch import load, save_file

    hf = _hf_dir(prepared, tmp_path)
    # read into memory, not mapped: safetensors 0.4.1 (the floor) maps the file, and overwriting a mapped file kills the
    # process with SIGBUS when its tensors are read (it did on the floor versions)
    weights = load((hf / "model.safetensors").read_bytes())
    name = next(n for n in weights if n.endswith("q_proj.weight"))
    save_file({n: t for n, t in weights.items() if n != name}, hf / "model.safetensors", {"format": "pt"})
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "a")]) == 2
    assert f"has no weights for {name} (transformers would start it at random)" in capsys.readouterr().err
    weights[name][0, 0] = float("nan")
    save_file(weights, hf / "model.safetensors", {"format": "pt"})
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "b")]) == 2
    assert f"{name} holds values that are not finite" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow  # a process or more of its own (the fast tier, make test-quick, stays within a minute)
def test_an_hf_directorys_own_code_is_never_run(prepared, tmp_path, capsys):
    """A config whose model_type is unknown and whose auto_map names code in the directory: transformers is called
    with trust_remote_code=False, so the code is not run and nothing asks on the terminal; a clear error, exit 2."""
    import json
    import subprocess
    import sys

    hf = _hf_dir(prepared, tmp_path)
    marker = tmp_path / "the directory's code ran"
    (hf / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((hf / "config.json").read_text())
    config.update(model_type="custom_diff", auto_map={"AutoModelForCausalLM": "modeling_custom.CustomModel",
                                                      "AutoConfig": "modeling_custom.CustomConfig"})  # fmt: skip
    (hf / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "difftransformer", "convert", "--from-hf", str(hf), "--out", str(tmp_path / "back")],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "transformers could not load" in proc.stderr and not marker.exists()


def test_a_tied_config_over_a_head_of_its_own_converts_to_what_transformers_computes(corpus_dir, tmp_path, capsys):
    """config.json ties the head to the embedding, the weights hold a head of their own: transformers 5 keeps them
    apart (its logits use the file's head), 4.x ties them. The import built a tied model from the head, whose logits
    differed from transformers' by up to 4.5 with exit 0; it now computes what the loaded model computes."""
    import json

    from safetensors.torch import load, save_file

    from difftransformer.store.tokenizer import ByteTokenizer

    hf = tmp_path / "hf"
    config = transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    ByteTokenizer().to_hf().save(str(hf / "tokenizer.json"))
    weights = load((hf / "model.safetensors").read_bytes())
    weights["lm_head.weight"] = torch.randn(257, 32, generator=torch.Generator().manual_seed(3))
    save_file(weights, hf / "model.safetensors", {"format": "pt"})
    assert json.loads((hf / "config.json").read_text())["tie_word_embeddings"] is True
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "back")]) == 0, capsys.readouterr().err
    model, _ = load_run(tmp_path / "back")
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    tokens = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, rtol=1e-4, atol=1e-4)
