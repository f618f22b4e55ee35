"""Tokenizers: byte-level (the default, no files), BPE trained locally, any ``tokenizer.json`` on disk, or plain
token ids (the synthetic tasks' models).

Every tokenizer has an end-of-text token appended after each document, saves itself into a directory (so it
travels with the data and the run) and knows how many UTF-8 bytes each token stands for (for bits per byte).
Nothing is fetched from a hub.

Documents are encoded with special tokens read as plain text (a literal ``<|endoftext|>`` in a document is text,
not a document boundary). Prompts are encoded as the tokenizer's own template says (``encode_prompt``: a
Llama tokenizer prepends its begin-of-text token, as ``transformers`` does). A tokenizer imported with a model
keeps the model's special tokens: its end-of-text token (the first of the model's end tokens), the others as
extra stop tokens, and its begin-of-text token.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from difftransformer.errors import Fields, InputError
from difftransformer.fsutil import read_json_object, write_new_dir
from difftransformer.paths import read_bytes
from difftransformer.schema import check

if TYPE_CHECKING:
    import tokenizers

EOT = "<|endoftext|>"
SPEC_FILE = "tokenizer_spec.json"
HF_FILE = "tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus an end-of-text token 256: the default tokenizer, with no file and no training.

    Examples:
        >>> tok = ByteTokenizer()
        >>> tok.encode("été"), tok.decode(tok.encode("été")), tok.vocab_size
        ([195, 169, 116, 195, 169], 'été', 257)
    """

    kind = "byte"

    def __init__(self) -> None:
        self.vocab_size = 257
        self.eot_id = 256
        self.bos_id = None
        self.stop_ids = [self.eot_id]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids as the exported Hugging Face tokenizer gives them: a literal ``<|endoftext|>`` is the
        end-of-text token, the rest UTF-8 bytes."""
        parts = [self.encode(part) for part in text.split(EOT)]
        return [i for n, part in enumerate(parts) for i in ([self.eot_id] if n else []) + part]

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

        chars = byte_level_chars()
        vocab = {chars[b]: b for b in range(256)} | {EOT: self.eot_id}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([EOT])
        return tok

    def fingerprint(self) -> str:
        return "byte-257"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file (BPE or any other).

    Args:
        tokenizer: the ``tokenizers.Tokenizer``.
        source: where it came from, for messages.
        eot: the end-of-text token (``<|endoftext|>`` unless the model that came with it uses another).
        stop: further tokens that end generation.
        bos: the begin-of-text token, if the model has one.

    Examples:
        >>> import tempfile
        >>> tmp = tempfile.mkdtemp()
        >>> tok = train_bpe(["To be, or not to be: that is the question."] * 50, 300, tmp)
        >>> loaded = HFTokenizer.from_file(f"{tmp}/tokenizer.json")
        >>> loaded.decode(loaded.encode("To be")), loaded.fingerprint() == tok.fingerprint()
        ('To be', True)
    """

    kind = "hf"

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        source: str = "",
        eot: str = EOT,
        stop: list[str] = (),
        bos: str | None = None,
    ):
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eot, self.stop, self.bos = eot, list(stop), bos
        ids = {}
        for role, token in [("eot", eot), *(("stop", t) for t in self.stop), ("bos", bos)]:
            if token is None:
                continue
            ids[token] = tokenizer.token_to_id(token)
            if ids[token] is None:
                if role == "eot" and eot == EOT:
                    raise InputError(
                        f"tokenizer {source} has no {EOT!r} token; add it as a special token (difftx tokenizer train "
                        "does) so that documents can be separated"
                    )
                raise InputError(f"tokenizer {source} has no token {token!r} (its {role} token)")
        self.eot_id = ids[eot]
        self.stop_ids = [self.eot_id, *(ids[t] for t in self.stop if ids[t] != self.eot_id)]
        self.bos_id = None if bos is None else ids[bos]

    @classmethod
    def from_file(cls, path: str | Path, **special) -> HFTokenizer:
        return cls(read_tokenizer_file(path), str(path), **special)

    def encode(self, text: str) -> list[int]:
        """A document's ids; special tokens in the text are encoded as text."""
        self._tok.encode_special_tokens = True
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = False

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids as ``transformers`` encodes it: special tokens recognised, the template's BOS added."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids if i != self.eot_id], skip_special_tokens=True)

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes per token (0 for special tokens). Exact for byte-level tokenizers, whose token strings spell
        one byte per character (a token may hold part of a character); otherwise the length of the token decoded
        on its own."""
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        byte_level = _has_byte_level(json.loads(self._tok.to_str()).get("decoder"))
        alphabet = set(byte_level_chars().values())
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            token = self._tok.id_to_token(i)
            if token is None or token in special:
                continue
            if byte_level and all(c in alphabet for c in token):
                counts[i] = len(token)
            else:
                counts[i] = len(self._tok.decode([i]).encode("utf-8"))
        return counts

    def to_hf(self):
        return self._tok

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / HF_FILE))
        spec = {"kind": self.kind, "vocab_size": self.vocab_size, "file": HF_FILE}
        if (self.eot, self.stop, self.bos) != (EOT, [], None):
            spec |= {"eot": self.eot, "stop": self.stop, "bos": self.bos}
        _write_spec(directory, spec | {"fingerprint": self.fingerprint()})

    def fingerprint(self) -> str:
        """Identifies the token stream a document becomes (the vocabulary, merges and end-of-text token)."""
        digest = "hf-" + hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()[:16]
        return digest if self.eot == EOT else f"{digest}-eot:{self.eot}"


class IdTokenizer:
    """The token ids themselves, written as whitespace-separated numbers: the text form of a model trained on a
    synthetic task (``difftx repro needle|icl``), whose vocabulary has no characters. No end-of-text token."""

    kind = "ids"

    def __init__(self, vocab_size: int) -> None:
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise InputError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.eot_id = None
        self.bos_id = None
        self.stop_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if not (word.isascii() and word.isdigit()) or int(word) >= self.vocab_size:
                raise InputError(
                    f"{word!r} is not a token id: this model reads whitespace-separated ids from 0 to "
                    f"{self.vocab_size - 1}"
                )
            ids.append(int(word))
        return ids

    encode_prompt = encode

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def token_bytes(self) -> np.ndarray:
        """One per token: bits per byte of a synthetic task are bits per token."""
        return np.ones(self.vocab_size, dtype=np.int64)

    def save(self, directory: str | Path) -> None:
        _write_spec(directory, {"kind": self.kind, "vocab_size": self.vocab_size})

    def to_hf(self):
        raise InputError("a model trained on token ids (a synthetic task) has no Hugging Face tokenizer to export")

    def fingerprint(self) -> str:
        return f"ids-{self.vocab_size}"


Tokenizer = ByteTokenizer | HFTokenizer | IdTokenizer


def byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in byte-level BPE token strings
    (printable Latin-1 bytes stand for themselves, the others for characters from U+0100 on)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _has_byte_level(decoder) -> bool:
    """Whether a tokenizer.json decoder is ByteLevel, alone or in a Sequence."""
    if not isinstance(decoder, dict):
        return False
    return decoder.get("type") == "ByteLevel" or any(_has_byte_level(d) for d in decoder.get("decoders") or [])


def read_tokenizer_file(path: str | Path):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json file, with a clear error for a missing or damaged one."""
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    text = read_bytes(path, what="tokenizer file").decode("utf-8", "replace")
    try:
        return Tokenizer.from_str(text)
    except Exception as err:  # tokenizers raises its own exception type
        raise InputError(f"{path} is not a valid tokenizer.json: {err}") from None


def _write_spec(directory: str | Path, spec: dict) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer a name gives: ``byte``, a path to a ``tokenizer.json``, or a directory holding one (as written by
    ``save``).

    Args:
        name: ``byte``, a file or a directory.

    Returns:
        The tokenizer.

    Examples:
        >>> get_tokenizer("byte").vocab_size
        257
    """
    if name == "byte":
        return ByteTokenizer()
    path = Path(name)
    if path.is_dir():
        return load_tokenizer(path)
    if path.suffix == ".json":
        return HFTokenizer.from_file(path)
    raise InputError(
        f"unknown tokenizer {name!r}: give 'byte', a tokenizer.json file, or a directory made by "
        "'difftx tokenizer train'"
    )


SPEC_SCHEMAS = {  # tokenizer_spec.json by kind (schema.py's notation), as save() writes it
    "byte": {"kind": "byte", "vocab_size?": 257},
    "ids": {"kind": "ids", "vocab_size": int},
    "hf": {
        "kind": "hf",
        "vocab_size?": int,
        "file?": str,
        "eot?": str,
        "stop?": [str],
        "bos?": (str, None),
        "fingerprint?": str,
    },
}


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer saved in a data, tokenizer or run directory."""
    directory = Path(directory)
    spec_path = directory / SPEC_FILE
    if not spec_path.is_file():
        if (directory / HF_FILE).is_file():
            return HFTokenizer.from_file(directory / HF_FILE)
        raise FileNotFoundError(f"{directory} holds no tokenizer ({SPEC_FILE} or {HF_FILE} is missing)")
    spec = read_json_object(spec_path)
    kind = spec.get("kind")
    if not isinstance(kind, str) or kind not in SPEC_SCHEMAS:
        raise InputError(f"{spec_path} names an unknown tokenizer kind {kind!r}")
    check(spec, SPEC_SCHEMAS[kind], str(spec_path), "copy the tokenizer's directory again")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "ids":
        try:
            return IdTokenizer(spec["vocab_size"])
        except InputError as err:
            raise InputError(f"{spec_path} is damaged: {err}") from None
    file, eot, stop, bos = spec.get("file", HF_FILE), spec.get("eot", EOT), spec.get("stop", []), spec.get("bos")
    if Path(file).name != file:
        raise InputError(f"{spec_path} is damaged: file {file!r} is not a file name in its directory")
    tokenizer = HFTokenizer.from_file(directory / file, eot=eot, stop=stop, bos=bos)
    refuse_replaced(
        tokenizer, spec.get("fingerprint"), directory / file, spec_path, "the data directory prepared with it"
    )
    return tokenizer


def refuse_replaced(
    tokenizer: Tokenizer, recorded: str | None, where: str | Path, record: str | Path, holder: str
) -> None:
    """An InputError when ``recorded``, the fingerprint ``record`` wrote, is not ``tokenizer``'s: its file
    (``where``) was replaced or edited, and ``holder`` holds the right one. None (nothing recorded) passes."""
    if recorded is not None and recorded != tokenizer.fingerprint():
        raise InputError(
            f"{where} is not the tokenizer {record} was saved with (its fingerprint is {tokenizer.fingerprint()}, "
            f"{record} records {recorded}): the file was replaced or edited; copy the right one back ({holder} "
            "holds it)"
        )


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> HFTokenizer:
    """Train a byte-level BPE tokenizer locally (Hugging Face ``tokenizers``) and save it to ``out_dir``:
    ``difftx tokenizer train``.

    Args:
        texts: the training text.
        vocab_size: the vocabulary asked for; smaller when the text holds fewer distinct merges.
        out_dir: where ``tokenizer.json`` and its spec are written.

    Returns:
        The tokenizer.

    Raises:
        InputError: no text.

    Examples:
        >>> import tempfile
        >>> tok = train_bpe(["To be, or not to be: that is the question."] * 50, 300, tempfile.mkdtemp())
        >>> tok.vocab_size <= 300, tok.decode(tok.encode("or not"))
        (True, 'or not')
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    Fields.of("train_bpe", vocab_size=vocab_size).integer(
        "vocab_size", 258, 1 << 20, hint=" (256 bytes, the end token and merges)"
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = {"characters": 0}

    def counted() -> Iterator[str]:
        for text in texts:
            seen["characters"] += len(text)
            yield text

    tok.train_from_iterator(counted(), trainer=trainer)
    if not seen["characters"]:
        raise InputError("the input holds no text to train a tokenizer on (every document is empty)")
    result = HFTokenizer(tok)
    write_new_dir(out_dir, "tokenizer directory", result.save)  # whole or not at all (a full disk)
    return result
