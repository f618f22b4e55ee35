"""Token shards: prepared once from text, then sampled as fixed-length windows.

``prepare`` tokenises documents (each followed by the end-of-text token) into a flat stream, cuts it into chunks
and sends every ``val_every``-th chunk to the validation split, so validation text is spread over the corpus.
With ``split="documents"`` whole documents are assigned instead (``is_val_document``): no document has text on
both sides, which a language-model comparison needs (a window of a validation document never trains).
Each split is written as numpy memmap shards (uint16 when the vocabulary fits, else uint32) with a manifest
(tokenizer, token and byte counts, sha256 checksums). The directory is written under a temporary name and
renamed when complete, so a crash never leaves a half-prepared directory behind.

``WindowSampler`` draws the windows of global batch ``i`` from ``numpy.random.default_rng([seed, i])``: a batch
depends only on (seed, i), so training resumes at the exact position by remembering i, and each process and each
accumulation micro-step takes its own slice of the same global batch that a single process would draw.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from difftransformer.devices import host_batch
from difftransformer.errors import ConfigError, Fields, InputError
from difftransformer.fsutil import read_json_object, write_new_dir, write_text_atomic
from difftransformer.schema import check
from difftransformer.store.tokenizer import Tokenizer, load_tokenizer

MANIFEST = "manifest.json"
VERIFIED = ".verified.json"  # shards whose checksum matched, keyed by name, size and modification time
FORMAT_VERSION = 1
SPLITS = ("chunks", "documents")
_SPLIT = {"tokens": int, "bytes": int, "shards": [{"file": str, "tokens": int, "sha256": str}]}
MANIFEST_SCHEMA = {  # schema.py's notation; the fields read are required, the others may be missing (older versions)
    "format": int,
    "tokenizer": {"kind": str, "vocab_size": int, "fingerprint": str},
    "dtype": ("uint16", "uint32"),
    "documents?": int,
    "tokens?": int,
    "chunk_tokens?": (int, None),
    "val_every?": int,
    "splits": {"train": _SPLIT, "val": _SPLIT},
    "sources?": [str],
    "created?": str,
    "split?": SPLITS,
    "documents_per_split?": {"train": int, "val": int},
}


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    out_dir: str | Path,
    val_every: int = 50,
    shard_tokens: int = 1 << 27,
    sources: list[str] | None = None,
    split: str = "chunks",
) -> dict:
    """Tokenise ``documents`` into train and validation shards under ``out_dir`` (a new directory, written atomically)
    with a manifest (tokenizer, token and byte counts, a sha256 per shard): ``difftx data prepare``.

    Args:
        documents: the texts.
        tokenizer: what turns them into ids (its end-of-text token separates documents).
        out_dir: the new data directory.
        val_every: every val_every-th chunk of the stream (``split="chunks"``) or document (``split="documents"``)
            goes to validation; at least 2, and both splits must get text.
        shard_tokens: tokens per shard file at most.
        sources: names of where the text came from, for the manifest.
        split: ``chunks`` or ``documents`` (no document on both sides).

    Returns:
        The manifest.

    Examples:
        >>> import tempfile
        >>> from difftransformer.store.tokenizer import ByteTokenizer
        >>> tmp = tempfile.mkdtemp()
        >>> texts = ["To be, or not to be. " * 100] * 20
        >>> manifest = prepare(texts, ByteTokenizer(), f"{tmp}/data", split="documents", val_every=10)
        >>> manifest["splits"]["train"]["tokens"], manifest["splits"]["val"]["tokens"]  # 18 and 2 documents of 2101
        (37818, 4202)
    """
    if tokenizer.eot_id is None:  # an IdTokenizer: a synthetic task's model reads ids, not text
        raise InputError(
            f"the tokenizer {tokenizer.fingerprint()} reads token ids (a synthetic task's model), not text, and has no "
            "end-of-text token to separate documents: prepare text with 'byte', a tokenizer.json, or a directory "
            "made by 'difftx tokenizer train'"
        )
    check = Fields.of("prepare", val_every=val_every, shard_tokens=shard_tokens, split=split)
    check.integer("val_every", 2, 1 << 20)
    check.integer("shard_tokens", 1)
    check.choice("split", SPLITS)
    prepare_into = _prepare_documents if split == "documents" else _prepare_chunks
    return write_new_dir(
        out_dir,
        "data directory",
        lambda tmp: prepare_into(documents, tokenizer, tmp, val_every, shard_tokens, sources or []),
    )


def is_val_document(index: int, val_every: int) -> bool:
    """Whether document ``index`` (counted from 0) belongs to validation under ``split="documents"``."""
    return index % val_every == val_every // 2


def _prepare_documents(documents, tokenizer, tmp: Path, val_every: int, shard_tokens: int, sources) -> dict:
    dtype = _dtype_for(tokenizer.vocab_size)
    token_bytes = tokenizer.token_bytes()
    writers = {split: _ShardWriter(tmp, split, dtype, shard_tokens) for split in ("train", "val")}
    counts = {"train": 0, "val": 0}
    for i, text in enumerate(documents):
        ids = np.asarray(tokenizer.encode(text) + [tokenizer.eot_id], dtype=np.uint32)
        split = "val" if is_val_document(i, val_every) else "train"
        writers[split].write(ids, int(token_bytes[ids].sum()))
        counts[split] += 1
    if not counts["val"] or not counts["train"]:
        n_docs = counts["train"] + counts["val"]
        raise ConfigError(
            "prepare",
            "val_every",
            f"{val_every} leaves a split without documents: the corpus has {n_docs}; split by documents needs at "
            f"least {val_every // 2 + 1} of them (or a smaller val_every)",
        )
    splits = {split: writer.close() for split, writer in writers.items()}
    total = splits["train"]["tokens"] + splits["val"]["tokens"]
    extra = {"split": "documents", "documents_per_split": counts}
    return _finish(
        tmp, tokenizer, dtype, counts["train"] + counts["val"], total, None, val_every, splits, sources, extra
    )


def _prepare_chunks(documents, tokenizer, tmp: Path, val_every: int, shard_tokens: int, sources: list[str]) -> dict:
    stream_path = tmp / "stream.u32"
    n_docs, total = 0, 0
    with open(stream_path, "wb") as stream:
        for text in documents:
            ids = np.asarray(tokenizer.encode(text) + [tokenizer.eot_id], dtype=np.uint32)
            stream.write(ids.tobytes())
            n_docs += 1
            total += len(ids)
    if total < 128:
        raise InputError(f"the corpus has {total} tokens in {n_docs} documents; at least 128 are needed")
    stream = np.memmap(stream_path, dtype=np.uint32, mode="r")
    chunk = max(64, min(16384, total // (4 * val_every)))
    n_chunks = math.ceil(total / chunk)
    is_val = (np.arange(n_chunks) % val_every) == val_every // 2
    if not is_val.any():
        raise ConfigError(
            "prepare",
            "val_every",
            f"{val_every} leaves no validation text: the corpus has {n_chunks} chunks of {chunk} tokens; use a "
            f"value of at most {2 * n_chunks - 1} (50 by default)",
        )
    dtype = _dtype_for(tokenizer.vocab_size)
    token_bytes = tokenizer.token_bytes()
    splits = {}
    for split, chosen in (("train", ~is_val), ("val", is_val)):
        writer = _ShardWriter(tmp, split, dtype, shard_tokens)
        for j in np.flatnonzero(chosen):
            piece = stream[j * chunk : (j + 1) * chunk]
            writer.write(piece, int(token_bytes[piece].sum()))
        splits[split] = writer.close()
    del stream
    stream_path.unlink()
    return _finish(tmp, tokenizer, dtype, n_docs, total, chunk, val_every, splits, sources, {"split": "chunks"})


def _finish(tmp, tokenizer, dtype, n_docs, total, chunk, val_every, splits, sources, extra) -> dict:
    tokenizer.save(tmp)
    manifest = {
        "format": FORMAT_VERSION,
        "tokenizer": {
            "kind": tokenizer.kind,
            "vocab_size": tokenizer.vocab_size,
            "fingerprint": tokenizer.fingerprint(),
        },
        "dtype": dtype.name,
        "documents": n_docs,
        "tokens": total,
        "chunk_tokens": chunk,
        "val_every": val_every,
        "splits": splits,
        "sources": sources,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


class _ShardWriter:
    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self.tokens = self.bytes = 0
        self._file = None
        self._in_shard = 0

    def write(self, ids: np.ndarray, n_bytes: int) -> None:
        self.bytes += n_bytes
        while len(ids):
            if self._file is None:
                name = f"{self.split}_{len(self.shards):03d}.bin"
                self._file = open(self.directory / name, "wb")
                self.shards.append({"file": name, "tokens": 0})
                self._in_shard = 0
            take = min(len(ids), self.shard_tokens - self._in_shard)
            self._file.write(np.asarray(ids[:take], dtype=self.dtype).tobytes())
            self._in_shard += take
            self.shards[-1]["tokens"] += take
            self.tokens += take
            ids = ids[take:]
            if self._in_shard == self.shard_tokens:
                self._finish()

    def _finish(self) -> None:
        self._file.close()
        self._file = None
        self.shards[-1]["sha256"] = _sha256(self.directory / self.shards[-1]["file"])

    def close(self) -> dict:
        if self._file is not None:
            self._finish()
        return {"tokens": self.tokens, "bytes": self.bytes, "shards": self.shards}


def read_manifest(data_dir: str | Path) -> dict:
    data_dir = Path(data_dir)
    if data_dir.exists() and not data_dir.is_dir():
        raise InputError(f"data directory {data_dir} is not a directory; give one made by 'difftx data prepare'")
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist; create it with 'difftx data prepare'")
    path = data_dir / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{data_dir} has no {MANIFEST}: it was not made by 'difftx data prepare'")
    manifest = read_json_object(path)
    version = manifest.get("format")
    if not isinstance(version, int) or isinstance(version, bool) or version != FORMAT_VERSION:
        raise InputError(f"{path} has format {version!r}; this version reads {FORMAT_VERSION}")
    check(manifest, MANIFEST_SCHEMA, str(path), "prepare the data again")
    for split in ("train", "val"):
        for shard in manifest["splits"][split]["shards"]:
            if Path(shard["file"]).name != shard["file"] or shard["tokens"] < 0:
                raise InputError(f"{path} is damaged: shard {shard['file']!r} of {split}; prepare the data again")
    return manifest


def data_identity(manifest: dict) -> str:
    """A short digest of what a data directory holds (its shards' checksums and sizes)."""
    splits = json.dumps(manifest["splits"], sort_keys=True).encode()
    return hashlib.sha256(splits).hexdigest()[:16]


def verify_data(data_dir: str | Path, cached: bool = True) -> int:
    """Check every shard of both splits against its sha256 in the manifest: ``difftx data verify``.

    Args:
        data_dir: a directory made by ``prepare``.
        cached: skip a shard that matched before and whose size and modification time have not changed since (the
            record is kept in the data directory when it is writable).

    Returns:
        How many shards were hashed.

    Raises:
        InputError: a shard does not match its checksum (it is damaged).

    Examples:
        >>> from difftransformer.store.examples import example_data
        >>> data = example_data()  # a short text, prepared in a new temporary directory
        >>> verify_data(data), verify_data(data)  # the second time, from the record
        (2, 0)
    """
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    record_path = data_dir / VERIFIED
    record: dict = {}
    if cached and record_path.is_file():
        try:
            record = read_json_object(record_path)
        except InputError:
            record = {}
    hashed, seen = 0, {}
    for split in ("train", "val"):
        for shard in manifest["splits"][split]["shards"]:
            path = data_dir / shard["file"]
            if not path.is_file():
                raise FileNotFoundError(f"shard {path} listed in the manifest is missing; prepare the data again")
            stat = path.stat()
            key = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, shard["sha256"]]
            seen[shard["file"]] = key
            if cached and record.get(shard["file"]) == key:
                continue
            hashed += 1
            if _sha256(path) != shard["sha256"]:
                raise InputError(
                    f"shard {path} does not match its checksum: the file is damaged; prepare the data again"
                )
    if cached and hashed:
        try:
            write_text_atomic(record_path, json.dumps(seen) + "\n")
        except OSError:
            pass  # a read-only data directory: verified again next time
    return hashed


class TokenData:
    """One split of a prepared data directory, memory-mapped, its shards checked against the manifest (sizes; the
    checksums with ``verify_data``).

    Args:
        data_dir: a directory made by ``prepare``.
        split: ``train`` or ``val``.

    Examples:
        >>> from difftransformer.store.examples import example_data
        >>> data = example_data()  # a short text, prepared in a new temporary directory
        >>> val = TokenData(data, "val")
        >>> val.n_tokens, val.tokenizer().decode(val.window(0, 6).tolist())
        (4202, 'To be,')
    """

    def __init__(self, data_dir: str | Path, split: str = "train") -> None:
        self.dir = Path(data_dir)
        self.manifest = read_manifest(self.dir)
        if split not in self.manifest["splits"]:
            raise InputError(f"{self.dir} has no split {split!r}")
        info = self.manifest["splits"][split]
        dtype = np.dtype(self.manifest["dtype"])
        self.shards = []
        for shard in info["shards"]:
            path = self.dir / shard["file"]
            if not path.is_file():
                raise FileNotFoundError(f"shard {path} listed in the manifest is missing")
            if path.stat().st_size != shard["tokens"] * dtype.itemsize:
                raise InputError(
                    f"shard {path} has {path.stat().st_size} bytes, the manifest says {shard['tokens']} tokens of "
                    f"{dtype.itemsize} bytes: the file is truncated or corrupt; prepare the data again"
                )
            self.shards.append(np.memmap(path, dtype=dtype, mode="r"))
        self._check_ids(info["shards"])
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.n_tokens = int(self.starts[-1])
        self.n_bytes = int(info["bytes"])
        self.split = split

    def _check_ids(self, listed: list[dict]) -> None:
        """Every token id lies in the tokenizer's vocabulary, checked once here: the model does not check the ids
        of each training batch (a read of the device's result per step)."""
        vocab = self.manifest["tokenizer"]["vocab_size"]
        for shard, entry in zip(self.shards, listed, strict=True):
            if len(shard) and int(shard.max()) >= vocab:
                raise InputError(
                    f"shard {self.dir / entry['file']} holds token id {int(shard.max())}, outside the tokenizer's "
                    f"vocabulary of {vocab}: the file is corrupt; prepare the data again"
                )

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.dir)

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split, across shard boundaries."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        while filled < length:
            shard = int(np.searchsorted(self.starts, start + filled, side="right")) - 1
            offset = start + filled - int(self.starts[shard])
            piece = self.shards[shard][offset : offset + length - filled]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
        return out


@dataclass
class WindowSampler:
    """Random windows of ``seq_len + 1`` tokens; global batch ``index`` is a pure function of (seed, index)."""

    data: TokenData
    seq_len: int
    global_batch: int
    seed: int

    def __post_init__(self) -> None:
        if self.data.n_tokens < self.seq_len + 1:
            raise InputError(
                f"the {self.data.split} split has {self.data.n_tokens} tokens, fewer than one window of "
                f"seq_len + 1 = {self.seq_len + 1}; use a larger corpus or a smaller `seq_len`"
            )

    def batch(self, index: int, part: int = 0, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (global_batch / parts, seq_len): part ``part`` of global batch ``index``.

        Processes and accumulation micro-steps each take one part, so any split of the same global batch
        sees the same windows."""
        if self.global_batch % parts:
            raise InputError(f"the global batch of {self.global_batch} does not split into {parts} equal parts")
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, self.data.n_tokens - self.seq_len, size=self.global_batch)
        size = self.global_batch // parts
        rows = [self.data.window(int(s), self.seq_len + 1) for s in starts[part * size : (part + 1) * size]]
        tokens = host_batch(torch.from_numpy(np.stack(rows)))
        return tokens[:, :-1], tokens[:, 1:]


def eval_windows(data: TokenData, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Fixed, evenly spaced windows of seq_len + 1 tokens, about max_tokens in all."""
    if data.n_tokens < seq_len + 1:
        raise InputError(
            f"the {data.split} split has {data.n_tokens} tokens, fewer than one window of {seq_len + 1}; use a larger "
            "corpus (or a smaller `seq_len`) so that validation is possible"
        )
    available = (data.n_tokens - 1) // seq_len
    count = max(1, min(available, max_tokens // seq_len))
    starts = np.linspace(0, data.n_tokens - seq_len - 1, count).astype(np.int64)
    return torch.from_numpy(np.stack([data.window(int(s), seq_len + 1) for s in starts]))
