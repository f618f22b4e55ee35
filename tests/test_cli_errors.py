"""Bad invocations of every command: each exits 2 with one line that names the problem (and the flag), never a
traceback, and leaves every existing file as it was.

DIFFTX_BAD_INPUTS_REPORT=path writes the table (invocation, exit code, message) as Markdown.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from conftest import SMALL, optional, small_config, snapshot, write_corpus

from difftransformer.apps.cli import main
from difftransformer.inference.quantize import quantize_run
from difftransformer.store.corpus import find_files, iter_documents
from difftransformer.store.data import prepare, verify_data
from difftransformer.store.tokenizer import train_bpe
from difftransformer.training.loop import Trainer, train

transformers = optional("transformers")

REPORT: list[tuple[str, int, str]] = []


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """Data, runs (finished, damaged, mismatched), bad files and foreign model directories to misuse."""
    root = tmp_path_factory.mktemp("world")
    corpus = write_corpus(root / "corpus")
    docs = lambda: iter_documents(find_files([corpus]))  # noqa: E731
    from difftransformer.store.tokenizer import ByteTokenizer

    prepare(docs(), ByteTokenizer(), root / "data", val_every=10)
    prepare(docs(), train_bpe(docs(), 300, root / "tok"), root / "data-bpe", val_every=10)
    verify_data(root / "data")  # the checksum cache exists, so no invocation below needs to write it
    verify_data(root / "data-bpe")
    train(small_config(root / "data", root / "run", max_steps=4, ckpt_interval=4, eval_interval=4), quiet=True)
    for name in ("corrupt", "badconfig", "mismatch"):
        shutil.copytree(root / "run", root / name)
    quantize_run(root / "run", "w8a16", root / "quant")
    shutil.copytree(root / "run", root / "moved")
    (root / "moved" / "train_config.json").write_text(
        (root / "run" / "train_config.json").read_text().replace(str(root / "data"), str(root / "gone"))
    )
    model = root / "corrupt" / "checkpoints" / "step_00000004" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-3] ^= 0xFF
    model.write_bytes(bytes(data))
    (root / "badconfig" / "train_config.json").write_text("{not json")
    config = json.loads((root / "mismatch" / "model_config.json").read_text())
    (root / "mismatch" / "model_config.json").write_text(json.dumps({**config, "n_layers": 3}))
    (root / "bad.txt").write_bytes(b"caf\xe9 au lait")
    (root / "x.csv").write_text("a,b\n")
    (root / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (root / "nofield.jsonl").write_text('{"body": "no text field"}\n')
    (root / "small.txt").write_text("tiny")
    (root / "garbage.json").write_text('{"this": "is not a tokenizer"}')
    (root / "taken").mkdir()
    (root / "taken" / "keep.txt").write_text("mine")
    (root / "long.txt").write_text("word " * 200)
    (root / "prompt.txt").write_text("the attention")
    (root / "empty").mkdir()
    (root / "empty" / "manifest.json").write_text("[1, 2")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    gpt2.save_pretrained(root / "gpt2")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    rope = {"rope_parameters": {**yarn, "rope_theta": 1e4}} if transformers.__version__[0] >= "5" else {}
    llama = transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, **rope
    )
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "yarn")
    config = json.loads((root / "yarn" / "config.json").read_text())
    (root / "yarn" / "config.json").write_text(json.dumps({**config, "rope_theta": 1e4, "rope_scaling": yarn}))
    shutil.copy(root / "tok" / "tokenizer.json", root / "yarn" / "tokenizer.json")
    (root / "notjson").mkdir()
    (root / "notjson" / "config.json").write_text("{oops")
    pickled = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**llama.to_dict(), "rope_scaling": None}))
    pickled.save_pretrained(root / "pickled")
    for weights in (root / "pickled").glob("*.safetensors"):
        weights.unlink()
    torch.save(pickled.state_dict(), root / "pickled" / "pytorch_model.bin")  # a pickle: never to be loaded
    shutil.copy(root / "tok" / "tokenizer.json", root / "pickled" / "tokenizer.json")
    (root / "empty.jsonl").write_text("")
    (root / "blank.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
    (root / "blank.txt").write_text("")
    Trainer(small_config(root / "data", root / "unstarted", max_steps=2000), quiet=True).close()  # warmup 200
    train(small_config(root / "data-bpe", root / "run-bpe", max_steps=2, ckpt_interval=2), quiet=True)
    shutil.copytree(root / "run-bpe", root / "swapped")
    _defects_of_the_audit(root, llama)
    other = write_corpus(root / "corpus2", seed=1)
    train_bpe(iter_documents(find_files([other])), 300, root / "tok2")
    shutil.copy(root / "tok2" / "tokenizer.json", root / "swapped" / "tokenizer.json")
    return root


def _defects_of_the_audit(root: Path, llama) -> None:
    """The files of issue #54's cases: a Hugging Face directory whose config says 60000 layers, one whose
    model.safetensors is a FIFO, a synthetic task's token-id tokenizer, a run with a file where a checkpoint goes, a
    run whose train_config.json asks for windows longer than its model's context, a folder whose text file is a link
    to /dev/zero, a bench context figure without its store, and a store of another shape."""
    from difftransformer.store.tokenizer import IdTokenizer

    plain = transformers.LlamaConfig(**{**llama.to_dict(), "rope_scaling": None, "num_hidden_layers": 2})
    transformers.LlamaForCausalLM(plain).save_pretrained(root / "hf60")
    shutil.copy(root / "tok" / "tokenizer.json", root / "hf60" / "tokenizer.json")
    shutil.copytree(root / "hf60", root / "fifohf")
    config = json.loads((root / "hf60" / "config.json").read_text())
    (root / "hf60" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 60000}))
    (root / "fifohf" / "model.safetensors").unlink()
    os.mkfifo(root / "fifohf" / "model.safetensors")
    IdTokenizer(64).save(root / "idstok")
    shutil.copytree(root / "run", root / "filestep")
    (root / "filestep" / "checkpoints" / "step_00000009").write_text("a user's notes")
    shutil.copytree(root / "run", root / "longseq")
    recipe = json.loads((root / "longseq" / "train_config.json").read_text())
    (root / "longseq" / "train_config.json").write_text(json.dumps({**recipe, "seq_len": 100000}))
    (root / "zerodir").mkdir()
    (root / "zerodir" / "a.txt").write_text("some text")
    (root / "zerodir" / "zero.txt").symlink_to("/dev/zero")
    (root / "ctx.png").write_bytes(b"a figure of something else")
    (root / "badctx.json").write_text('{"benchmark": "context", "rows": 5}')


TRAIN = "train --data {w}/data --out {w}/new --model " + shlex.quote(json.dumps(SMALL)) + " --quiet"
FROM = "train --data {w}/data --out {w}/new --quiet --init-from"
CASES = [
    # (command line, with {w} for the fixture directory; a phrase the one-line message must contain)
    ("train", "needs --data"),
    ("train --data {w}/nothing --out {w}/new", "does not exist; create it with 'difftx data prepare'"),
    ("train --data {w}/small.txt --out {w}/new", "is not a directory"),
    ("train --data {w}/corpus --out {w}/new", "has no manifest.json"),
    ("train --data {w}/empty --out {w}/new", "manifest.json is not valid JSON"),
    (TRAIN + " --grad-clip -1", "--grad-clip must be a finite number in (0, inf)"),
    (TRAIN + " --grad-clip 0", "--grad-clip must be a finite number in (0, inf)"),
    (TRAIN + " --grad-clip nan", "--grad-clip must be a finite number"),
    (
        TRAIN + " --grad-clip inf",
        "--grad-clip must be a finite number in (0, inf) (the largest gradient norm kept; 1.0 by default, 1e9 for no",
    ),
    (TRAIN + " --lr 0", "--lr must be a finite number in (0, 1]"),
    (TRAIN + " --lr=-1e-3", "--lr must be a finite number in (0, 1]"),
    (TRAIN + " --lr 2", "--lr must be a finite number in (0, 1]"),
    (TRAIN + " --lr inf", "--lr must be a finite number in (0, 1]"),
    (TRAIN + " --lr fast", "argument --lr: invalid float value: 'fast'"),
    (TRAIN + " --batch-size 0", "--batch-size must be an integer in [1, 1,048,576]"),
    (TRAIN + " --batch-size 5 --grad-accum 2", "--batch-size 5 is not divisible by --grad-accum 2"),
    (TRAIN + " --grad-accum 0", "--grad-accum must be an integer in [1, 16]"),
    (TRAIN + " --max-steps 0", "--max-steps must be an integer"),
    (TRAIN + " --max-steps 100 --warmup-steps 500", "--warmup-steps must be an integer in [0, 100]"),
    (TRAIN + " --seq-len 0", "--seq-len must be an integer in [1,"),
    (TRAIN + " --seq-len 100000", "--seq-len 100000 exceeds the model's max_seq_len 256"),
    (TRAIN + " --eval-interval 0", "--eval-interval must be an integer"),
    (TRAIN + " --log-interval -1", "--log-interval must be an integer"),
    (TRAIN + " --ckpt-interval 0", "--ckpt-interval must be an integer"),
    (TRAIN + " --keep-last -1", "--keep-last must be an integer in [0,"),
    (TRAIN + " --eval-tokens 0", "--eval-tokens must be an integer"),
    (TRAIN + " --seed -1", "--seed must be an integer in [0,"),
    (TRAIN + " --device gpu", "--device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got 'gpu'"),
    (TRAIN + " --device cuda", "--device is 'cuda', but no CUDA GPU is available here"),
    (TRAIN + " --device cuda:3", "--device is 'cuda:3', but no CUDA GPU is available here"),
    (TRAIN + " --threads 0", "--threads must be an integer in [1, 1,024]"),
    (TRAIN + " --weight-decay -0.1", "--weight-decay must be a finite number in [0, 1]"),
    (TRAIN + " --weight-decay 2", "--weight-decay must be a finite number in [0, 1]"),
    (TRAIN + " --max-nonfinite-steps 0", "--max-nonfinite-steps must be an integer"),
    (TRAIN + " --model '{bad'", "--model is not valid JSON"),
    (TRAIN + " --model '[1, 2]'", "--model must hold a JSON object, got list"),
    (TRAIN + " --model '{\"n_layer\": 2}'", "--model has 'n_layer', which is not a ModelConfig field"),
    (TRAIN + " --model '{\"n_layers\": 0}'", "n_layers (in --model) must be an integer in [1, 1,024], got 0"),
    (TRAIN + " --model '{\"d_model\": 100}'", "d_model (in --model) 100 is not divisible by n_heads (in --model) 8"),
    (TRAIN + ' --model \'{"attention": "standard"}\'', "--model must not set attention; use --attention"),
    (TRAIN + " --model '{\"vocab_size\": 300}'", "--model sets vocab_size 300, but the data's tokenizer has 257"),
    (TRAIN + " --model '{\"rope_theta\": -5}'", "rope_theta (in --model) must be a finite number in (0, inf)"),
    (TRAIN + " --preset huge", "argument --preset: invalid choice: 'huge' (choose from 'tiny', 'small'"),
    (TRAIN + " --attention flash", "argument --attention: invalid choice: 'flash'"),
    (
        "train --data {w}/data --out {w}/run",
        "run directory {w}/run holds a run (at step 4); to train it further: difftx "
        "train --resume {w}/run --max-steps N; to start another run, choose another --out",
    ),
    ("train --data {w}/data --out {w}/taken", "run directory {w}/taken already exists and is not empty"),
    (FROM + " {w}/nothing", "--init-from {w}/nothing is not a run directory (it does not exist or is a file)"),
    (FROM + " {w}/small.txt", "--init-from {w}/small.txt is not a run directory (it does not exist or is a file)"),
    (FROM + " {w}/corpus", "--init-from {w}/corpus has no checkpoint to start from"),
    (FROM + " {w}/run/checkpoints/step_00000009", "checkpoint {w}/run/checkpoints/step_00000009 (init_from) does not"),
    (TRAIN + " --init-from {w}/run", "--model cannot be given with --init-from: the model (its config and weights)"),
    (FROM + " {w}/run --attention standard", "--attention cannot be given with --init-from"),
    (FROM + " {w}/run --preset small", "--preset cannot be given with --init-from"),
    (FROM + " {w}/run --preset tiny", "--preset cannot be given with --init-from"),
    (
        "train --data {w}/data-bpe --out {w}/new --init-from {w}/run",
        "uses the tokenizer byte-257, the data in {w}/data-bpe hf-",
    ),
    ("train --resume {w}/nothing", "{w}/nothing is not a run directory (train_config.json is missing)"),
    ("train --resume {w}/run --lr 0.1", "--lr cannot change when resuming (the run has 0.0015)"),
    ("train --resume {w}/run --out {w}/other", "--out cannot be given when resuming"),
    ("train --resume {w}/run --max-steps 2", "--max-steps 2 is below the step the run {w}/run has reached, 4"),
    ("train --resume {w}/run --model '{\"n_layers\": 3}'", "--model cannot change when resuming"),
    ("train --resume {w}/run --dtype float32", "--dtype cannot change when resuming"),
    ("train --resume {w}/run --init-from {w}/run", "--init-from cannot change when resuming"),
    ("train --resume {w}/run --data {w}/data-bpe", "was tokenised with hf-"),
    ("train --resume {w}/run --data {w}/nothing", "--data {w}/nothing of the run {w}/run is not there"),
    ("train --resume {w}/corrupt --max-steps 8", "model.safetensors does not match its checksum"),
    ("train --resume {w}/badconfig", "train_config.json is not valid JSON"),
    ("train --resume {w}/unstarted --max-steps 10", "--max-steps 10 is below the run's warmup of 200 steps"),
    (
        "train --resume {w}/mismatch --max-steps 8",
        "{w}/mismatch/model_config.json is not the config step_00000004 was written with (n_layers is 3; its",
    ),
    ("data prepare --input {w}/corpus --out {w}/d --val-every 1", "--val-every must be an integer in [2,"),
    ("data prepare --input {w}/corpus --out {w}/d --val-every 0", "--val-every must be an integer in [2,"),
    ("data prepare --input {w}/corpus --out {w}/d --val-every 100000", "--val-every 100000 leaves no validation"),
    ("data prepare --input {w}/nothing --out {w}/d", "input {w}/nothing does not exist"),
    ("data prepare --input {w}/x.csv --out {w}/d", "unsupported file type '.csv'"),
    ("data prepare --input {w}/bad.txt --out {w}/d", "{w}/bad.txt is not valid UTF-8 (byte 3"),
    ("data prepare --input {w}/bad.jsonl --out {w}/d", "{w}/bad.jsonl:2 is not valid JSON"),
    ("data prepare --input {w}/nofield.jsonl --out {w}/d", "has no string field 'text'"),
    ("data prepare --input {w}/corpus --out {w}/d --text-field ''", "--text-field must be a non-empty string"),
    ("data prepare --input {w}/corpus --out {w}/d --tokenizer {w}/no.json", "tokenizer file {w}/no.json does not"),
    ("data prepare --input {w}/corpus --out {w}/d --tokenizer {w}/garbage.json", "is not a valid tokenizer.json"),
    ("data prepare --input {w}/corpus --out {w}/d --tokenizer bpe", "unknown tokenizer 'bpe'"),
    ("data prepare --input {w}/corpus --out {w}/taken", "data directory {w}/taken already exists"),
    ("data prepare --input {w}/small.txt --out {w}/d", "at least 128 are needed"),
    ("data verify {w}/nothing", "data directory {w}/nothing does not exist"),
    ("data verify {w}/empty", "manifest.json is not valid JSON"),
    ("tokenizer train --input {w}/corpus --out {w}/t --vocab-size 10", "--vocab-size must be an integer in [258,"),
    ("tokenizer train --input {w}/corpus --out {w}/taken", "tokenizer directory {w}/taken already exists"),
    ("tokenizer train --input {w}/blank.txt --out {w}/t", "the input holds no text to train a tokenizer on"),
    ("generate --run {w}/run --prompt hi --temperature -1", "--temperature must be a finite number in [0, 100]"),
    ("generate --run {w}/run --prompt hi --temperature nan", "--temperature must be a finite number"),
    ("generate --run {w}/run --prompt hi --top-p 0", "--top-p must be a finite number in (0, 1]"),
    ("generate --run {w}/run --prompt hi --top-p 1.5", "--top-p must be a finite number in (0, 1]"),
    ("generate --run {w}/run --prompt hi --top-k 0", "--top-k must be an integer >= 1"),
    ("generate --run {w}/run --prompt hi --max-new-tokens 0", "--max-new-tokens must be an integer in [1,"),
    ("generate --run {w}/run --prompt hi --seed -1", "--seed must be an integer in [0,"),
    ("generate --run {w}/run --prompt hi --threads 0", "argument --threads: must be at least 1, got 0"),
    ("generate --run {w}/run --prompt hi --device cuda", "--device is 'cuda', but no CUDA GPU is available here"),
    ("generate --run {w}/run --prompt hi --device tpu", "--device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"),
    ("bench decode --context 8 --device cuda:1", "--device is 'cuda:1', but no CUDA GPU is available here"),
    ("generate --run {w}/nothing --prompt hi", "run directory {w}/nothing does not exist"),
    ("generate --run {w}/corpus --prompt hi", "is not a run directory: model_config.json is missing"),
    ("generate --run {w}/run --prompt ''", "prompt 0 is empty"),
    ("generate --run {w}/run --prompt " + "x" * 300, "prompt 0 has 300 tokens"),
    ("generate --run {w}/corrupt --prompt hi", "model.safetensors does not match its checksum"),
    (
        "generate --run {w}/mismatch --prompt hi",
        "{w}/mismatch/model_config.json is not the config step_00000004 was written with (n_layers is 3; its",
    ),
    ("generate --run {w}/run --prompt ab\udcff", "--prompt is not valid UTF-8 (byte 0xff at position 2)"),
    ("generate --run {w}/run --prompt hi --stop ok \udce9t", "--stop is not valid UTF-8 (byte 0xe9 at position 0)"),
    ("generate --run {w}/run --prompt hi --stop ''", "stop string 0 is '': it must hold at least one character"),
    (
        "generate --run {w}/run --prompt hi --max-new-tokens 100000",
        "--max-new-tokens 100000 leaves no room for a prompt in the model's context of 256 tokens; ask for at most 255",
    ),
    ("generate --run {w}/small.txt --prompt hi", "{w}/small.txt is a file, not a run directory"),
    ("generate --run {w}/swapped --prompt hi", "{w}/swapped/tokenizer.json is not the tokenizer"),
    ("generate --run {w}/run/checkpoints/step_00000009 --prompt hi", "run directory {w}/run/checkpoints/step_000"),
    ("convert --out {w}/c", "give either --run RUN --to hf, or --from-hf DIR"),
    ("convert --run {w}/run --from-hf {w}/gpt2 --out {w}/c", "give either --run RUN --to hf, or --from-hf DIR"),
    ("convert --from-hf {w}/nothing --out {w}/c", "config.json is missing"),
    ("convert --from-hf {w}/gpt2 --out {w}/c", "holds ['GPT2LMHeadModel']"),
    ("convert --from-hf {w}/notjson --out {w}/c", "config.json is not valid JSON"),
    ("convert --from-hf {w}/yarn --out {w}/c", "rotary scaling 'yarn' is not supported"),
    (
        "convert --from-hf {w}/pickled --out {w}/c",
        "{w}/pickled has no .safetensors weights (pytorch_model.bin is a pickle, which is never loaded",
    ),
    ("convert --run {w}/run --out {w}/taken", "output directory {w}/taken already exists"),
    ("convert --run {w}/corrupt --out {w}/c", "model.safetensors does not match its checksum"),
    ("analyze attention --run {w}/run --prompt-file {w}/nothing.txt --out {w}/a.png", "{w}/nothing.txt does not exist"),
    ("analyze attention --run {w}/run --prompt-file {w}/long.txt --out {w}/a.png", "longer than"),
    ("analyze attention --run {w}/run --prompt-file {w}/bad.txt --out {w}/a.png", "is not valid UTF-8"),
    ("analyze attention --run {w}/run --prompt-file {w}/prompt.txt --out {w}/a.png --layer 9", "--layer 9 is out"),
    ("analyze attention --run {w}/run --prompt-file {w}/prompt.txt --out {w}/a.csv", "must name a .png file"),
    ("analyze attention --run {w}/run --out {w}/a.png", "the following arguments are required: --prompt-file"),
    ("analyze outliers --run {w}/run --out {w}/taken", "output directory {w}/taken already exists"),
    ("analyze outliers --run {w}/nothing --out {w}/o", "run directory {w}/nothing does not exist"),
    ("analyze outliers --run {w}/run --out {w}/o --tokens 0", "argument --tokens: must be at least 1, got 0"),
    ("analyze outliers --run {w}/run --out {w}/o --data {w}/nothing", "the data directory {w}/nothing of"),
    ("analyze outliers --run {w}/run --out {w}/o --data {w}/data-bpe", "but {w}/run uses"),
    ("analyze outliers --run {w}/badconfig --out {w}/o", "train_config.json is not valid JSON"),
    ("eval --run {w}/run --jsonl {w}/bad.jsonl --logit-bits 1", "logit bits must be an integer from 2 to 16"),
    ("eval --run {w}/run --jsonl {w}/empty.jsonl", "{w}/empty.jsonl holds no text to evaluate: no record has a"),
    ("eval --run {w}/run --jsonl {w}/blank.jsonl", "non-blank --text-field 'text'"),
    ("eval --run {w}/run --jsonl {w}/nothing.jsonl", "{w}/nothing.jsonl does not exist or is not a file"),
    ("eval --run {w}/run --jsonl {w}/empty.jsonl --text-field \udcff", "--text-field is not valid UTF-8"),
    ("eval --run {w}/run --jsonl {w}/bad.jsonl --logit-bits 4 --logit-granularity col", "invalid choice: 'col'"),
    ("quantize --run {w}/run --scheme w2 --out {w}/q", "argument --scheme: invalid choice: 'w2'"),
    ("quantize --run {w}/run --scheme w8a8 --out {w}/taken", "output directory {w}/taken already exists"),
    ("quantize --run {w}/quant --scheme w8a16 --out {w}/q", "{w}/quant is already quantized (w8a16)"),
    ("quantize --run {w}/moved --scheme w8a8 --out {w}/q", "training data: the data directory {w}/gone of {w}/moved"),
    ("quantize --run {w}/run --scheme w8a8 --out {w}/q --data {w}/data-bpe", "but {w}/run uses"),
    ("quantize --run {w}/run --scheme w8a8 --out {w}/q --calib-samples 0", "argument --calib-samples: must be at"),
    ("quantize --run {w}/run --scheme w8a8 --out {w}/q --calibrator mse", "argument --calibrator: invalid choice"),
    ("quantize --run {w}/nothing --scheme w8a16 --out {w}/q", "run directory {w}/nothing does not exist"),
    ("convert --run {w}/quant --out {w}/c", "this model is quantized"),
    ("train --resume {w}/quant", "{w}/quant is a quantized run (w8a16), which cannot train further"),
    (FROM + " {w}/quant", "{w}/quant is a quantized run (w8a16), which cannot start a run from it"),
    ("bench attention --threads 0", "argument --threads: must be at least 1, got 0"),
    ("bench attention --device cuda", "--device is 'cuda', but no CUDA GPU is available here"),
    ("repro needle --seeds 0", "argument --seeds: must be at least 1, got 0"),
    ("repro needle --out {w}/r --logit-bits 20", "logit bits must be an integer from 2 to 16, got 20"),
    ("repro lm --out {w}/r --logit-bits 4", "--logit-bits applies to needle and icl (their final evaluation), not lm"),
    ("repro lm --out {w}/lm --corpora {w}/nothing", "corpus directory {w}/nothing does not exist; fetch it"),
    ("repro lm --out {w}/lm --corpora {w}/corpus --part grid", "the learning-rate sweep is not complete"),
    ("repro lm --out {w}/taken --corpora {w}/corpus", "{w}/taken is not empty and holds no study.json"),
    ("repro lm --scale tpu", "argument --scale: invalid choice: 'tpu'"),
    ("repro lm --scale gpu --out {w}/lm", "--scale gpu trains on 'cuda', which this machine lacks"),
    ("demo --steps 0", "argument --steps: must be at least 1, got 0"),
    # issue #54's cases
    (
        "convert --from-hf {w}/hf60 --out {w}/c",
        "{w}/hf60: config.json says 60000 layers, the weights hold layers 0 to 1",
    ),
    ("convert --from-hf {w}/fifohf --out {w}/c", "{w}/fifohf/model.safetensors is a FIFO (named pipe)"),
    (
        "data prepare --input {w}/zerodir --out {w}/d",
        "{w}/zerodir/zero.txt (a link to /dev/zero) is a character device",
    ),
    ("data prepare --input {w}/corpus --out {w}/d --tokenizer {w}/idstok", "ids-64 reads token ids"),
    ("bench attention --seq 8 --json {w}/small.txt", "--json {w}/small.txt already exists; choose another path"),
    ("bench context --seq 64 --json {w}/ctx.json", "{w}/ctx.png already exists and is not this new study's figure"),
    ("bench context --seq 64 --json {w}/badctx.json", "{w}/badctx.json is damaged: machine is missing"),
    ("bench context --seq 64 --json {w}/ctx.png", "--json {w}/ctx.png must name a .json file"),
    ("train --resume {w}/filestep --max-steps 8", "{w}/filestep/checkpoints/step_00000009 is not a checkpoint (a file"),
    ("train --resume {w}/longseq --max-steps 8", "longseq/train_config.json: seq_len 100000 exceeds the model's max"),
    ("train --data {w}/data --out {w}/small.txt", "run directory {w}/small.txt already exists and is a file"),
    ("train --data {w}/data --out .", "--out . is the working directory"),
    ("quantize --run {w}/run --scheme w8a16 --out {w}/run/checkpoints/step_99999999", "inside the checkpoints folder"),
    ("presets --bogus", "unrecognized arguments: --bogus"),
]


@pytest.mark.slow
@pytest.mark.parametrize("line, phrase", CASES, ids=[c[0][:60] for c in CASES])
def test_bad_invocation_exits_2_with_one_line_and_changes_nothing(world, line, phrase, capsys):
    argv = shlex.split(line.replace("{w}", str(world)))
    before = snapshot(world)
    code = main(argv)
    out = capsys.readouterr()
    message = out.err.strip()
    REPORT.append((" ".join(argv).replace(str(world), "W"), code, message.replace(str(world), "W")))
    assert code == 2, (argv, out.err, out.out)
    assert len(message.splitlines()) == 1 and message.startswith("difftx"), message
    assert phrase.replace("{w}", str(world)) in message, message
    assert snapshot(world) == before  # nothing existing changed, nothing new left behind


def test_write_report():
    path = os.environ.get("DIFFTX_BAD_INPUTS_REPORT")
    assert len(REPORT) == len(CASES) or not REPORT  # all ran (or this test runs alone)
    if path and REPORT:
        rows = [f"| `{argv}` | {code} | {msg.replace('|', '/')} |" for argv, code, msg in REPORT]
        Path(path).write_text("| invocation | exit | message |\n|---|---|---|\n" + "\n".join(rows) + "\n")


def test_a_defect_keeps_its_traceback(monkeypatch):
    """Only user errors become one line: an exception from inside the code (here a plain ValueError) propagates,
    so `difftx` shows its traceback and exits 1."""
    import difftransformer.apps.cli.demo as demo

    def broken(_args):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(demo, "_presets", broken)
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main(["presets"])


def test_an_error_line_is_written_whole_so_processes_lines_do_not_run_together(monkeypatch):
    """Each process of a torchrun group prints its own error line to one shared stderr pipe. Python's stderr there is
    an unbuffered text stream over the pipe (write_through): every write is its own write to the pipe, so a line
    printed as text then newline (as print does) can have another process's line land inside it. The line must reach
    the pipe in one write, with its newline."""
    import io

    from difftransformer.apps.cli.parsing import fail

    class Pipe(io.RawIOBase):
        def __init__(self):
            self.writes = []

        def writable(self):
            return True

        def write(self, data):
            self.writes.append(bytes(data))
            return len(data)

    pipe = Pipe()
    monkeypatch.setattr("sys.stderr", io.TextIOWrapper(pipe, encoding="utf-8", write_through=True))
    assert fail("difftx train", "process 0 of 2 stopped:   the process group failed", code=4) == 4
    assert pipe.writes == [b"difftx train: error: process 0 of 2 stopped: the process group failed\n"]


def test_the_cpu_allocators_refusal_is_the_out_of_memory_message(monkeypatch, capsys):
    """`train --batch-size 1048576` asked the CPU allocator for 128 GiB: its RuntimeError kept its traceback."""
    import difftransformer.apps.cli.demo as demo

    def refused(_args):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
            "allocate 137438953472 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(demo, "_presets", refused)
    assert main(["presets"]) == 2
    assert capsys.readouterr().err == (
        "difftx presets: error: out of memory: an allocation of 128.0 GiB was refused; use a smaller batch, model or "
        "sequence length\n"
    )
