"""Tokenizers: byte-level (the default, no files), BPE trained locally, or any ``tokenizer.json`` on disk.

Every tokenizer has an end-of-text token appended after each document, saves itself into a directory (so it
travels with the data and the run) and knows how many UTF-8 bytes each token stands for (for bits per byte).
Nothing is fetched from a hub.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
SPEC_FILE = "tokenizer_spec.json"
HF_FILE = "tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus an end-of-text token 256."""

    kind = "byte"

    def __init__(self) -> None:
        self.vocab_size = 257
        self.eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        counts = np.ones(self.vocab_size, dtype=np.int64)
        counts[self.eot_id] = 0
        return counts

    def save(self, directory: str | Path) -> None:
        _write_spec(directory, {"kind": self.kind, "vocab_size": self.vocab_size})

    def to_hf(self):
        """The same tokenizer as a Hugging Face ``tokenizers.Tokenizer``: byte-level BPE without merges, whose ids
        are the byte values (GPT-2's byte-to-character alphabet), and the end-of-text token 256."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        chars, extra = {}, 0
        for b in range(256):
            if b in printable:
                chars[b] = chr(b)
            else:
                chars[b] = chr(256 + extra)
                extra += 1
        vocab = {chars[b]: b for b in range(256)} | {EOT: self.eot_id}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([EOT])
        return tok

    def fingerprint(self) -> str:
        return "byte-257"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file (BPE or any other)."""

    kind = "hf"

    def __init__(self, tokenizer, source: str = "") -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        eot = tokenizer.token_to_id(EOT)
        if eot is None:
            raise ValueError(
                f"tokenizer {source or ''} has no {EOT!r} token; add it as a special token (difftx tokenizer train "
                "does) so that documents can be separated"
            )
        self.eot_id = eot

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises its own exception type
            raise ValueError(f"{path} is not a valid tokenizer.json: {err}") from None
        return cls(tok, str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids if i != self.eot_id], skip_special_tokens=True)

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes per token: the decoded length of each token on its own (0 for special tokens)."""
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            token = self._tok.id_to_token(i)
            if token is not None and token not in special:
                counts[i] = len(self._tok.decode([i]).encode("utf-8"))
        return counts

    def to_hf(self):
        return self._tok

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / HF_FILE))
        _write_spec(directory, {"kind": self.kind, "vocab_size": self.vocab_size, "file": HF_FILE})

    def fingerprint(self) -> str:
        return "hf-" + hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()[:16]


Tokenizer = ByteTokenizer | HFTokenizer


def _write_spec(directory: str | Path, spec: dict) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")


def get_tokenizer(name: str) -> Tokenizer:
    """``byte``, a path to a ``tokenizer.json``, or a directory holding one (as written by ``save``)."""
    if name == "byte":
        return ByteTokenizer()
    path = Path(name)
    if path.is_dir():
        return load_tokenizer(path)
    if path.suffix == ".json":
        return HFTokenizer.from_file(path)
    raise ValueError(
        f"unknown tokenizer {name!r}: give 'byte', a tokenizer.json file, or a directory made by "
        "'difftx tokenizer train'"
    )


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer saved in a data, tokenizer or run directory."""
    directory = Path(directory)
    spec_path = directory / SPEC_FILE
    if not spec_path.is_file():
        if (directory / HF_FILE).is_file():
            return HFTokenizer.from_file(directory / HF_FILE)
        raise FileNotFoundError(f"{directory} holds no tokenizer ({SPEC_FILE} or {HF_FILE} is missing)")
    spec = json.loads(spec_path.read_text())
    if spec.get("kind") == "byte":
        return ByteTokenizer()
    if spec.get("kind") == "hf":
        return HFTokenizer.from_file(directory / spec.get("file", HF_FILE))
    raise ValueError(f"{spec_path} names an unknown tokenizer kind {spec.get('kind')!r}")


def train_bpe(texts: Iterator[str], vocab_size: int, out_dir: str | Path) -> HFTokenizer:
    """Train a byte-level BPE tokenizer locally (Hugging Face ``tokenizers``) and save it to ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"a byte-level BPE vocabulary needs more than 257 entries, got --vocab-size {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    result = HFTokenizer(tok)
    result.save(out_dir)
    return result
