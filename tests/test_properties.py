"""Property-based tests (hypothesis): random and damaged inputs to the configs, the data readers, the tokenizers and
checkpoint loading give either a correct result or a clean InputError (or a missing-file error), never another
exception and never a silently changed result."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from difftransformer import ModelConfig
from difftransformer.core.model import count_parameters
from difftransformer.errors import ConfigError, InputError
from difftransformer.inference.generate import SamplingConfig
from difftransformer.store.checkpoint import load_checkpoint, save_checkpoint
from difftransformer.store.corpus import iter_documents
from difftransformer.store.data import read_manifest
from difftransformer.store.tokenizer import ByteTokenizer, HFTokenizer, train_bpe
from difftransformer.training.loop import TrainConfig

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5000),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
small_ints = st.integers(-2, 300)


def field_values(cls, special: dict) -> st.SearchStrategy[dict]:
    names = [f.name for f in dataclasses.fields(cls)]
    return st.dictionaries(st.sampled_from(names), st.one_of(anything, *special.values()), max_size=5).map(
        lambda d: {k: v for k, v in d.items() if k in names}
    )


@SETTINGS
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "d_model": st.sampled_from([0, 8, 12, 32, 48, 64, 100]),
            "n_heads": small_ints,
            "n_kv_heads": st.one_of(st.none(), small_ints),
            "n_layers": st.integers(-1, 4),
            "vocab_size": st.one_of(small_ints, anything),
            "max_seq_len": st.one_of(small_ints, anything),
            "rope_theta": st.one_of(st.none(), st.floats(), anything),
            "rope_scaling": st.one_of(
                st.none(),
                anything,
                st.fixed_dictionaries({"rope_type": st.just("linear"), "factor": st.floats()}),
                st.fixed_dictionaries(
                    {
                        "rope_type": st.just("llama3"),
                        "factor": st.floats(0.5, 8),
                        "low_freq_factor": st.floats(0.1, 4),
                        "high_freq_factor": st.floats(0.1, 8),
                        "original_max_position_embeddings": st.integers(-1, 4096),
                    }
                ),
            ),
            "dropout": st.one_of(st.floats(), anything),
            "norm_eps": st.one_of(st.floats(), anything),
            "attention": st.sampled_from(["diff", "diff_v2", "standard", "flash", 3]),
            "tie_embeddings": anything,
            "ffn_dim": st.one_of(small_ints, anything),
        },
    )
)
def test_model_config_is_valid_or_refused_by_name(fields):
    try:
        cfg = ModelConfig.from_dict({"d_model": 32, "n_heads": 4, "n_layers": 1, "vocab_size": 64, **fields})
    except ConfigError as err:
        assert err.owner == "ModelConfig" and str(err).startswith("ModelConfig.")
        return
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
        value = getattr(cfg, name)
        assert type(value) is int and value >= 1
    assert cfg.d_model % cfg.n_heads == 0 and cfg.n_heads % cfg.n_kv_heads == 0
    assert cfg.rope_theta is None or (math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0)
    assert 0 <= cfg.dropout < 1 and 0 < cfg.norm_eps < 1 and isinstance(cfg.tie_embeddings, bool)
    assert count_parameters(cfg) > 0  # the model builds
    assert ModelConfig.from_json(cfg.to_json()) == cfg


@SETTINGS
@given(field_values(TrainConfig, {"device": st.text(max_size=10), "lr": st.floats(), "grad_clip": st.floats()}))
@example({"grad_clip": -1.0})
@example({"grad_clip": 0.0})
@example({"seed": -1})
@example({"device": "cuda:0"})
def test_train_config_is_valid_or_refused_by_name(fields):
    try:
        cfg = TrainConfig(**{"data": "d", "out": "o", **fields})
    except ConfigError as err:
        assert err.owner == "TrainConfig" and str(err).startswith("TrainConfig.")
        return
    except TypeError:  # a field this dataclass does not have (no such case is generated)
        raise
    assert cfg.lr > 0 and cfg.grad_clip > 0 and math.isfinite(cfg.grad_clip) and 0 <= cfg.weight_decay <= 1
    assert cfg.batch_size % cfg.grad_accum == 0 and 0 <= cfg.warmup_steps <= cfg.max_steps
    assert cfg.seed >= 0 and cfg.keep_last >= 0 and cfg.max_nonfinite_steps >= 1
    # out is not saved (a run directory does not name itself): the reader gives it
    assert TrainConfig.from_json(cfg.to_json(), out="elsewhere") == dataclasses.replace(cfg, out="elsewhere")


@SETTINGS
@given(field_values(SamplingConfig, {"temperature": st.floats(), "top_p": st.floats()}))
def test_sampling_config_is_valid_or_refused_by_name(fields):
    try:
        cfg = SamplingConfig(**{"max_new_tokens": 4, **fields})
    except ConfigError as err:
        assert err.owner == "SamplingConfig"
        return
    assert cfg.max_new_tokens >= 1 and 0 <= cfg.temperature <= 100
    assert cfg.top_p is None or 0 < cfg.top_p <= 1
    assert cfg.top_k is None or cfg.top_k >= 1


@SETTINGS
@given(st.binary(max_size=200), st.sampled_from([".txt", ".md", ".jsonl"]))
@example(b"\xff\xfe", ".txt")
@example(b"\xef\xbb\xbfa text after a byte-order mark", ".txt")
@example(b'{"text": "a"}\n{"text": 1}\n', ".jsonl")
@example(b'[{"text": "a"}]\n', ".jsonl")
@example(b"[" * 5000, ".jsonl")
def test_any_bytes_read_as_documents_or_refused(tmp_path_factory, data, suffix):
    path = tmp_path_factory.mktemp("docs") / f"f{suffix}"
    path.write_bytes(data)
    try:
        docs = list(iter_documents([path]))
    except InputError:
        return
    text = data.decode("utf-8").removeprefix("\ufeff")  # it was read, so it is UTF-8 (a byte-order mark is no text)
    if suffix != ".jsonl":
        assert docs == ([text] if text.strip() else [])
    else:
        records = [json.loads(line) for line in text.split("\n") if line.strip()]
        assert docs == [r["text"] for r in records if r["text"].strip()]


@SETTINGS
@given(st.lists(st.text(), max_size=6), st.booleans())
@example(["a\u2028b", "c\rd", "<|endoftext|>"], False)
def test_jsonl_documents_round_trip(tmp_path_factory, texts, ascii_only):
    path = tmp_path_factory.mktemp("jsonl") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=ascii_only) + "\n" for t in texts), encoding="utf-8")
    assert list(iter_documents([path])) == [t for t in texts if t.strip()]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> HFTokenizer:
    words = "attention noise cancels when two softmax maps are subtracted naïve café 東京 😀".split()
    return train_bpe(iter([" ".join(words * 30)]), 320, tmp_path_factory.mktemp("tok"))


@SETTINGS
@given(st.text(max_size=60))
@example("before <|endoftext|> after")
@example("\u2028\r\n\x00")
def test_tokenizers_round_trip_and_count_bytes(bpe, text):
    for tok in (ByteTokenizer(), bpe):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eot_id not in ids  # a document's own text never ends it
        assert int(tok.token_bytes()[ids].sum()) == len(text.encode("utf-8"))  # bits per byte count every byte


@SETTINGS
@given(st.binary(max_size=300))
@example(b'{"model": {"type": "BPE"}}')
def test_any_bytes_as_tokenizer_json_load_or_are_refused(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("tokjson") / "tokenizer.json"
    path.write_bytes(data)
    try:
        HFTokenizer.from_file(path)
    except InputError:
        pass


@SETTINGS
@given(st.recursive(anything, lambda inner: st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8))
def test_any_json_as_manifest_reads_or_is_refused(tmp_path_factory, value):
    root = tmp_path_factory.mktemp("manifest")
    (root / "manifest.json").write_text(json.dumps(value))
    try:
        read_manifest(root)
    except InputError:
        pass


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = {"w": torch.randn(8, 4), "b": torch.randn(4).to(torch.bfloat16), "n": torch.arange(3)}
    optim = {"state": {"w": {"exp_avg": torch.randn(8, 4), "step": 3}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    root = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(root, 7, model, optim, {"data_position": 7, "rng_torch": [1, 2, 3]})
    return root / "checkpoints" / "step_00000007"


@SETTINGS
@given(
    st.sampled_from(["model.safetensors", "optimizer.safetensors", "state.json"]),
    st.sampled_from(["flip", "truncate", "append", "delete"]),
    st.floats(0, 1, exclude_max=True),
    st.integers(1, 255),
)
def test_damaged_checkpoints_load_unchanged_or_are_refused(tmp_path_factory, checkpoint_dir, file, how, where, byte):
    original = load_checkpoint(checkpoint_dir)
    damaged = tmp_path_factory.mktemp("damaged") / "step"
    shutil.copytree(checkpoint_dir, damaged)
    data = bytearray((damaged / file).read_bytes())
    at = int(where * len(data))
    if how == "flip":
        data[at] ^= byte
    elif how == "truncate":
        data = data[:at]
    elif how == "append":
        data += bytes([byte]) * 3
    (damaged / file).write_bytes(bytes(data))
    if how == "delete":
        (damaged / file).unlink()
    try:
        loaded = load_checkpoint(damaged)
    except (InputError, FileNotFoundError):
        return
    assume(how != "delete")
    model, optim, meta = loaded
    assert meta == original[2]
    assert optim["param_groups"] == original[1]["param_groups"]
    for name, tensor in original[0].items():
        assert torch.equal(model[name], tensor) and model[name].dtype == tensor.dtype, name
    assert torch.equal(optim["state"]["w"]["exp_avg"], original[1]["state"]["w"]["exp_avg"])


# Characters that make the three formats' structure (brackets, anchors, aliases, tags, keys, quotes, indentation),
# with letters and digits between them
_STRUCTURE = st.text(alphabet="[]{}&*!:,-=.'\"#|>\n  abxyz019", max_size=400)


@SETTINGS
@given(text=st.one_of(_STRUCTURE, st.text(max_size=300)), suffix=st.sampled_from([".yaml", ".toml", ".json"]))
@example(text="a: &a [*a]\n", suffix=".yaml")
@example(text="a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n", suffix=".yaml")
@example(text="[" * 3000, suffix=".json")
@example(text="a = " + "[" * 3000, suffix=".toml")
def test_any_config_file_reads_or_is_refused_within_a_second(tmp_path_factory, text, suffix):
    """Random documents of each format: a mapping of settings or an InputError that names the file, never another
    exception, and each within a second (the YAML aliases that recursed or grew without bound are refused first)."""
    import time

    from difftransformer.training.config_file import read_config_file

    path = tmp_path_factory.mktemp("config") / f"run{suffix}"
    path.write_text(text, encoding="utf-8")
    start = time.perf_counter()
    try:
        fields = read_config_file(path)
    except InputError as err:
        assert str(path) in str(err)  # the error names the file
    else:
        assert isinstance(fields, dict)
    assert time.perf_counter() - start < 1.0


RUN_FILES = ["checkpoints/step_00000002/model.safetensors", "checkpoints/step_00000002/state.json",
             "model_config.json", "tokenizer_spec.json"]  # fmt: skip
HF_FILES = ["model.safetensors", "config.json", "tokenizer.json", "generation_config.json"]


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    file=st.sampled_from([("run", f) for f in RUN_FILES] + [("hf", f) for f in HF_FILES]),
    how=st.sampled_from(["flip", "truncate"]),
    where=st.floats(0, 1, exclude_max=True),
    byte=st.integers(1, 255),
)
def test_damaged_files_are_a_clear_error_never_a_traceback(
    tmp_path_factory, run_and_hf, capsys, file, how, where, byte
):
    """Bytes of a run's weights, state, config and tokenizer files, and of a Hugging Face directory's weights, config,
    tokenizer and generation config, flipped or cut off: `generate` and `convert --from-hf` exit 0 (a change no
    check can see, such as a flipped value in HF weights, which carry no digest) or 2 with a message, never with a
    traceback (exit 1), within seconds."""
    import time

    from difftransformer.apps.cli import main

    kind, name = file
    copy = tmp_path_factory.mktemp("damaged") / kind
    shutil.copytree(run_and_hf[0] if kind == "run" else run_and_hf[1], copy)
    data = bytearray((copy / name).read_bytes())
    at = int(where * len(data))
    if how == "flip":
        data[at] ^= byte
    else:
        data = data[:at]
    (copy / name).write_bytes(bytes(data))
    if kind == "run":
        command = ["generate", "--run", str(copy), "--prompt", "the", "--max-new-tokens", "2", "--device", "cpu"]
    else:
        command = ["convert", "--from-hf", str(copy), "--out", str(copy.parent / "back")]
    capsys.readouterr()
    start = time.perf_counter()
    code = main(command)
    err = capsys.readouterr().err
    assert code in (0, 2), err[-3000:]
    assert code == 0 or err.startswith(f"difftx {command[0]}: error: "), err[-3000:]
    assert time.perf_counter() - start < 30
