"""Token shards: prepared once from text, then sampled as fixed-length windows.

``prepare`` tokenises documents (each followed by the end-of-text token) into a flat stream, cuts it into chunks
and sends every ``val_every``-th chunk to the validation split, so validation text is spread over the corpus.
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

from difftransformer.fsutil import write_new_dir
from difftransformer.tokenizer import Tokenizer, load_tokenizer

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


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
) -> dict:
    """Tokenise ``documents`` into train/val shards under ``out_dir``; return the manifest."""
    return write_new_dir(
        out_dir,
        "data directory",
        lambda tmp: _prepare_into(documents, tokenizer, tmp, val_every, shard_tokens, sources or []),
    )


def _prepare_into(documents, tokenizer, tmp: Path, val_every: int, shard_tokens: int, sources: list[str]) -> dict:
    stream_path = tmp / "stream.u32"
    n_docs, total = 0, 0
    with open(stream_path, "wb") as stream:
        for text in documents:
            ids = np.asarray(tokenizer.encode(text) + [tokenizer.eot_id], dtype=np.uint32)
            stream.write(ids.tobytes())
            n_docs += 1
            total += len(ids)
    if total < 128:
        raise ValueError(f"the corpus has {total} tokens in {n_docs} documents; at least 128 are needed")
    stream = np.memmap(stream_path, dtype=np.uint32, mode="r")
    chunk = max(64, min(16384, total // (4 * val_every)))
    n_chunks = math.ceil(total / chunk)
    is_val = (np.arange(n_chunks) % val_every) == val_every // 2
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
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {data_dir} does not exist; create it with 'difftx data prepare'")
    path = data_dir / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{data_dir} has no {MANIFEST}: it was not made by 'difftx data prepare'")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is corrupt: {err}") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path} has format {manifest.get('format')!r}; this version reads {FORMAT_VERSION}")
    return manifest


class TokenData:
    """One split of a prepared data directory, memory-mapped."""

    def __init__(self, data_dir: str | Path, split: str = "train") -> None:
        self.dir = Path(data_dir)
        self.manifest = read_manifest(self.dir)
        if split not in self.manifest["splits"]:
            raise ValueError(f"{self.dir} has no split {split!r}")
        info = self.manifest["splits"][split]
        dtype = np.dtype(self.manifest["dtype"])
        self.shards = []
        for shard in info["shards"]:
            path = self.dir / shard["file"]
            if not path.is_file():
                raise FileNotFoundError(f"shard {path} listed in the manifest is missing")
            if path.stat().st_size != shard["tokens"] * dtype.itemsize:
                raise ValueError(
                    f"shard {path} has {path.stat().st_size} bytes, the manifest says {shard['tokens']} tokens of "
                    f"{dtype.itemsize} bytes: the file is truncated or corrupt; prepare the data again"
                )
            self.shards.append(np.memmap(path, dtype=dtype, mode="r"))
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.n_tokens = int(self.starts[-1])
        self.n_bytes = int(info["bytes"])
        self.split = split

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

    def verify(self) -> None:
        """Check every shard against its sha256 in the manifest."""
        for shard in self.manifest["splits"][self.split]["shards"]:
            if _sha256(self.dir / shard["file"]) != shard["sha256"]:
                raise ValueError(
                    f"shard {self.dir / shard['file']} does not match its checksum; prepare the data again"
                )


@dataclass
class WindowSampler:
    """Random windows of ``seq_len + 1`` tokens; global batch ``index`` is a pure function of (seed, index)."""

    data: TokenData
    seq_len: int
    global_batch: int
    seed: int

    def __post_init__(self) -> None:
        if self.data.n_tokens < self.seq_len + 1:
            raise ValueError(
                f"the {self.data.split} split has {self.data.n_tokens} tokens, fewer than one window of "
                f"seq_len + 1 = {self.seq_len + 1}; use a larger corpus or a smaller --seq-len"
            )

    def batch(self, index: int, part: int = 0, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (global_batch / parts, seq_len): part ``part`` of global batch ``index``.

        Processes and accumulation micro-steps each take one part, so any split of the same global batch
        sees the same windows."""
        if self.global_batch % parts:
            raise ValueError(f"the global batch of {self.global_batch} does not split into {parts} equal parts")
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, self.data.n_tokens - self.seq_len, size=self.global_batch)
        size = self.global_batch // parts
        rows = [self.data.window(int(s), self.seq_len + 1) for s in starts[part * size : (part + 1) * size]]
        tokens = torch.from_numpy(np.stack(rows))
        return tokens[:, :-1], tokens[:, 1:]


def eval_windows(data: TokenData, seq_len: int, max_tokens: int) -> torch.Tensor:
    """Fixed, evenly spaced windows of seq_len + 1 tokens, about max_tokens in all."""
    if data.n_tokens < seq_len + 1:
        raise ValueError(
            f"the {data.split} split has {data.n_tokens} tokens, fewer than one window of {seq_len + 1}; use a larger "
            "corpus (or a smaller --seq-len) so that validation is possible"
        )
    available = (data.n_tokens - 1) // seq_len
    count = max(1, min(available, max_tokens // seq_len))
    starts = np.linspace(0, data.n_tokens - seq_len - 1, count).astype(np.int64)
    return torch.from_numpy(np.stack([data.window(int(s), seq_len + 1) for s in starts]))
