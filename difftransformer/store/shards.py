"""Tensors stored in pieces: each process of a sharded (FSDP) run writes the part of every tensor it holds into a file
of its own, and any process count reads back exactly the parts it needs.

A piece file is a safetensors file whose metadata, besides the digest of its tensors (``sha256``, as every
checkpoint file carries), records for each tensor the global shape and the offset of the stored piece in it
(``chunks``, JSON). A file without ``chunks`` (a single process's ``model.safetensors``) holds whole tensors: one piece
at offset 0. ``PieceReader`` indexes the pieces of one or more files from their headers alone and reads any box of a
tensor (a process's new shard, or the whole tensor) from the pieces that overlap it, each through safetensors' lazy
slicing: a process reads only the rows it needs. Nothing is unpickled (torch.distributed.checkpoint's own file format
pickles its metadata, which loading someone else's run must not run).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from difftransformer.errors import InputError
from difftransformer.store.weights_file import check_header

CHUNKS_KEY = "chunks"


@dataclass(frozen=True)
class Piece:
    """One stored piece of a tensor: the file, the tensor's global shape, where the piece starts and its shape."""

    file: Path
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    size: tuple[int, ...]


def piece_metadata(pieces: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> str:
    """The ``chunks`` metadata of a piece file: {name: {"shape": global shape, "offset": the piece's offset}}."""
    return json.dumps({name: {"shape": list(shape), "offset": list(at)} for name, (shape, at) in pieces.items()})


def piece_file_name(kind: str, rank: int, world: int) -> str:
    """``model-00001-of-00002.safetensors``: process ``rank``'s pieces of ``kind`` (model or optimizer)."""
    return f"{kind}-{rank:05d}-of-{world:05d}.safetensors"


def piece_files(directory: Path, kind: str) -> list[Path]:
    """The piece files of ``kind`` in a checkpoint directory, in rank order (none for a single-file checkpoint)."""
    return sorted(p for p in directory.glob(f"{kind}-*-of-*.safetensors") if p.is_file())


class PieceReader:
    """The pieces of every tensor stored in ``files``, indexed from their headers; ``read`` assembles any box.

    Args:
        files: piece files, or one whole-tensor file.
        check: called with a file before anything is read from it (a digest check: only the files a process reads
            are checked, by that process).

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from safetensors.torch import save_file
        >>> full = torch.arange(12.0).reshape(6, 2)
        >>> tmp = Path(tempfile.mkdtemp())
        >>> for rank, rows in enumerate((slice(0, 3), slice(3, 6))):  # two processes' shards of one tensor
        ...     meta = {"chunks": piece_metadata({"w": ((6, 2), (rows.start, 0))})}
        ...     save_file({"w": full[rows].contiguous()}, tmp / f"model-{rank:05d}-of-00002.safetensors", meta)
        >>> reader = PieceReader(piece_files(tmp, "model"))
        >>> reader.shape("w"), torch.equal(reader.read("w"), full), reader.read("w", (2, 0), (2, 2)).tolist()
        ((6, 2), True, [[4.0, 5.0], [6.0, 7.0]])
    """

    def __init__(self, files: Iterable[Path], check: Callable[[Path], None] | None = None) -> None:
        self.pieces: dict[str, list[Piece]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.files = [Path(f) for f in files]
        self.check, self.checked = check, set()  # check(file): called before the first read from that file
        for file in self.files:
            for name, piece, dtype in _pieces_of(file):
                self.pieces.setdefault(name, []).append(piece)
                if self.dtypes.setdefault(name, dtype) != dtype:
                    raise InputError(f"{file} stores {name} as {dtype}, another piece of it as {self.dtypes[name]}")
        for name, pieces in self.pieces.items():
            _check_cover(name, pieces)

    def names(self) -> list[str]:
        return sorted(self.pieces)

    def shape(self, name: str) -> tuple[int, ...]:
        """The global shape of ``name``."""
        return self.pieces[name][0].shape

    def read(self, name: str, offset: tuple | None = None, size: tuple | None = None) -> torch.Tensor:
        """The box of ``name`` starting at ``offset`` with shape ``size`` (default: the whole tensor), read from the
        pieces that overlap it (only their overlapping parts)."""
        shape = self.shape(name)
        offset = tuple(offset) if offset is not None else (0,) * len(shape)
        size = tuple(size) if size is not None else shape
        out = torch.empty(size, dtype=self.dtypes[name])
        if out.numel() == 0:
            return out
        for piece in self.pieces[name]:
            lo = [max(a, b) for a, b in zip(offset, piece.offset, strict=True)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, size, piece.offset, piece.size, strict=True)]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            if self.check is not None and piece.file not in self.checked:
                self.check(piece.file)
                self.checked.add(piece.file)
            within_piece = tuple(slice(a - p, b - p) for a, b, p in zip(lo, hi, piece.offset, strict=True))
            within_out = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset, strict=True))
            with safe_open(piece.file, "pt") as f:
                part = f.get_slice(name)[within_piece] if within_piece else f.get_tensor(name)
            out[within_out] = part
        return out

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor whole (a single process reading a sharded checkpoint)."""
        return {name: self.read(name) for name in self.names()}


def _pieces_of(file: Path):
    """(name, Piece, dtype) of every tensor in one file, from its header (checked first)."""
    check_header(file)
    with safe_open(file, "pt") as f:
        metadata = f.metadata() or {}
        chunks = json.loads(metadata[CHUNKS_KEY]) if CHUNKS_KEY in metadata else None
        for name in f.keys():
            part = f.get_slice(name)
            size = tuple(part.get_shape())
            dtype = _DTYPES[part.get_dtype()]
            if chunks is None:
                yield name, Piece(file, size, (0,) * len(size), size), dtype
                continue
            entry = chunks.get(name)
            if not isinstance(entry, dict) or len(entry.get("shape", ())) != len(size):
                raise InputError(f"{file} has no valid piece record for {name} (its chunks metadata is damaged)")
            yield name, Piece(file, tuple(entry["shape"]), tuple(entry["offset"]), size), dtype


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def _check_cover(name: str, pieces: list[Piece]) -> None:
    """The pieces of a tensor lie inside its shape, no two distinct ones overlap (the same piece twice is allowed: a
    tensor every process holds alike), and together they hold as many elements as it has: so they cover it."""
    shape = pieces[0].shape
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for piece in pieces:
        box = zip(piece.offset, piece.size, shape, strict=False)  # lengths differ only in a damaged record
        if piece.shape != shape or len(piece.offset) != len(shape) or any(o < 0 or o + n > s for o, n, s in box):
            raise InputError(f"a piece of {name} in {piece.file} lies outside its shape {shape}: damaged or mixed")
        if (piece.offset, piece.size) in boxes or _numel(piece.size) == 0:  # a repeat, or a process holding none
            continue
        for offset, size in boxes:
            if all(a < b + m and b < a + n for a, n, b, m in zip(piece.offset, piece.size, offset, size, strict=True)):
                raise InputError(f"two pieces of {name} overlap (one in {piece.file}): damaged or mixed files")
        boxes.append((piece.offset, piece.size))
    total = sum(_numel(size) for _, size in boxes)
    if total != _numel(shape):
        raise InputError(
            f"the pieces of {name} hold {total} of its {_numel(shape)} values: a process's file is missing or damaged"
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
