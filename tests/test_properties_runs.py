"""Property-based tests (hypothesis) where the bugs of issue #28 were: prompts of any bytes (special-token strings
among them), evaluation files of any records, and run directories with one file replaced by the same-shaped file
of another run. Each gives the right result or one clear error, never a traceback and never a silent wrong result."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import SMALL, small_config, write_corpus
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from difftransformer.apps.cli import main
from difftransformer.errors import InputError
from difftransformer.inference.evaluate import read_texts
from difftransformer.store.corpus import find_files, iter_documents
from difftransformer.store.data import prepare
from difftransformer.store.runs import load_run
from difftransformer.store.tokenizer import EOT, ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe
from difftransformer.training.config import resume_config
from difftransformer.training.evaluate import text_bits_per_byte
from difftransformer.training.loop import Trainer, train

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SPECIAL = [EOT.encode(), b"<|endoftext", b"<s>", b"</s>", "é".encode(), "東".encode(), b"\xff", b"\xc3", b"\x00"]
# bytes as a shell passes them: any, with the special-token strings a user might type among them
prompt_bytes = st.lists(st.one_of(st.binary(max_size=6), st.sampled_from(SPECIAL)), max_size=5).map(b"".join)
texts = st.lists(st.one_of(st.text(max_size=20), st.sampled_from([EOT, "", "  ", "\n", "a" + EOT + "b"])), max_size=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A byte-level run and two BPE runs of the same shapes: B's tokenizer has A's vocabulary with two ids swapped,
    its model another rope_theta, its training another seed."""
    root = tmp_path_factory.mktemp("runs")
    docs = lambda: iter_documents(find_files([write_corpus(root / "corpus")]))  # noqa: E731
    prepare(docs(), ByteTokenizer(), root / "data-byte", val_every=10)
    tok_a = train_bpe(docs(), 300, root / "tok-a")
    spec = json.loads(tok_a.to_hf().to_str())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (root / "tok-b").mkdir()
    (root / "tok-b" / "tokenizer.json").write_text(json.dumps(spec))
    tok_b = HFTokenizer.from_file(root / "tok-b" / "tokenizer.json")
    assert tok_b.vocab_size == tok_a.vocab_size and tok_b.fingerprint() != tok_a.fingerprint()
    prepare(docs(), tok_a, root / "data-a", val_every=10)
    prepare(docs(), tok_b, root / "data-b", val_every=10)
    base = dict(max_steps=4, ckpt_interval=4, eval_interval=4)
    train(small_config(root / "data-byte", root / "byte", **base), quiet=True)
    train(small_config(root / "data-a", root / "a", **base), quiet=True)
    train(small_config(root / "data-b", root / "b", model={**SMALL, "rope_theta": 5000.0}, seed=1, **base), quiet=True)
    return {"byte": root / "byte", "a": root / "a", "b": root / "b"}


@SETTINGS
@given(prompt_bytes, st.sampled_from(["byte", "a"]))
@example(EOT.encode(), "byte")
@example(b"ab\xff", "a")
@example(b"", "byte")
@example(b"-5 degrees", "byte")  # a prompt that begins with '-' (argparse read it as a flag)
@example(b"--", "byte")
def test_any_prompt_generates_or_is_refused_in_one_line(runs, capsys, data, which):
    prompt = os.fsdecode(data)  # what Python makes of argv bytes: lone surrogates for bytes that are not UTF-8
    argv = ["generate", "--run", str(runs[which]), "--prompt", prompt, "--max-new-tokens", "3", "--temperature", "0"]
    code = main(argv)
    out, err = capsys.readouterr()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        assert code == 2 and err.startswith("difftx generate: error: --prompt is not valid UTF-8 (byte 0x"), err
        return
    if not load_tokenizer(runs[which]).encode_prompt(text):
        assert code == 2 and err.strip() == "difftx generate: error: prompt 0 is empty; give at least one token"
        return
    assert code == 0 and out.startswith(text) and err == "", err


@SETTINGS
@given(st.text(max_size=30), st.lists(st.sampled_from([EOT, "<s>", "x"]), max_size=3))
@example("a<|endoftext|>b", [])
def test_a_byte_prompt_encodes_as_the_exported_tokenizer_does(text, inserts):
    from transformers import PreTrainedTokenizerFast

    prompt = text + "".join(inserts)
    tok = ByteTokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.to_hf(), eos_token=EOT)
    assert tok.encode_prompt(prompt) == hf(prompt)["input_ids"]


@SETTINGS
@given(st.lists(st.one_of(texts.map(lambda t: {"text": "".join(t)}), st.just({"body": "x"}), st.just("")), max_size=4))
@example([])
@example([{"text": ""}, {"text": " \n "}])
@example([{"text": EOT}])
def test_any_eval_file_scores_as_lm_eval_reads_it_or_is_refused(runs, tmp_path_factory, records):
    """Ours scores the ids that lm-eval's tokenizer gives the same texts (special-token strings read as text by
    both), or the file is refused in one line: no text, or a record without the field."""
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("eval") / "task.jsonl"
    path.write_text("".join((json.dumps(r) if r else "") + "\n" for r in records))
    try:
        found = read_texts(path)
    except InputError as err:
        has_text = any(isinstance(r, dict) and r.get("text", "").strip() for r in records)
        lacks_field = any(isinstance(r, dict) and "text" not in r for r in records)
        assert lacks_field or not has_text, err
        return
    model, tok = load_run(runs["a"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.to_hf(), eos_token=tok.eot, split_special_tokens=True)
    for text in found:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False)
    bits = text_bits_per_byte(model, tok, found)
    assert math.isfinite(bits) and bits > 0


SWAPPABLE = [
    "model_config.json",
    "train_config.json",
    "tokenizer.json",
    "tokenizer_spec.json",
    "metrics.jsonl",
    "checkpoints/step_00000004/model.safetensors",
    "checkpoints/step_00000004/optimizer.safetensors",
    "checkpoints/step_00000004/state.json",
]
# what each use of a run reads: a swapped file it reads is refused; one it does not read changes nothing
READS = {
    "load": {"model_config.json", "tokenizer.json", "tokenizer_spec.json", "model.safetensors", "state.json"},
    "resume": {
        "model_config.json", "train_config.json", "tokenizer.json", "tokenizer_spec.json", "model.safetensors",
        "optimizer.safetensors", "state.json",
    },
}  # fmt: skip


def _use(run: Path, how: str):
    """The model weights a use of the run ends up with (load: load_run; resume: a Trainer resuming it)."""
    if how == "load":
        return load_run(run)[0].state_dict()
    trainer = Trainer(resume_config(run), resume=True, quiet=True)
    trainer.close()
    return trainer.model.state_dict()


def _every_swap(test):
    """Each (file, use) pair as an explicit example, so that none is left to chance."""
    for file in SWAPPABLE:
        for how in READS:
            test = example(file, how)(test)
    return test


@SETTINGS
@given(st.sampled_from(SWAPPABLE), st.sampled_from(list(READS)))
@_every_swap
def test_a_run_with_a_file_from_another_run_is_refused_or_unchanged(runs, tmp_path_factory, file, how):
    run = tmp_path_factory.mktemp("swapped") / "run"
    shutil.copytree(runs["a"], run)
    shutil.copy(runs["b"] / file, run / file)
    assert (run / file).read_bytes() != (runs["a"] / file).read_bytes()  # a real swap, of the same shape
    if Path(file).name in READS[how]:
        with pytest.raises(InputError) as refused:  # the file itself, or what it points to (another run's data)
            _use(run, how)
        assert "\n" not in str(refused.value)
        return
    expected = _use(runs["a"], how)
    for name, tensor in _use(run, how).items():
        assert torch.equal(tensor, expected[name]), name
