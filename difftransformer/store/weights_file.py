"""A safetensors file's header checked before any reader trusts it: weights of runs, checkpoints, quantized runs and
Hugging Face directories come from elsewhere, and a damaged or crafted file must be a clear error, not a traceback
from deep inside a reader (or a reader sized by a garbage header).

The layout (safetensors' format): 8 bytes, the header's length n (little-endian); n bytes of JSON: per tensor its
dtype, shape and [begin, end) byte offsets in the data that follows, plus an optional ``__metadata__`` of strings.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from difftransformer.errors import InputError
from difftransformer.paths import open_regular

MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
ITEM_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2,
    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


def check_header(path: str | Path, fix: str = "") -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of a safetensors file, after checking that its header is whole JSON of known dtypes,
    with each tensor's bytes inside the file, of its shape's size, and no two tensors sharing bytes.

    Args:
        path: the file.
        fix: what the error adds after naming the damage (e.g. which checkpoint to use instead).

    Raises:
        InputError: naming the file and what is wrong with it.

    Examples:
        >>> import tempfile, torch
        >>> from safetensors.torch import save_file
        >>> path = f"{tempfile.mkdtemp()}/w.safetensors"
        >>> save_file({"w": torch.zeros(2, 3)}, path)
        >>> check_header(path)
        {'w': ('F32', (2, 3))}
    """
    path = Path(path)

    def damaged(what: str) -> InputError:
        return InputError(f"{path} is damaged or not a safetensors file: {what}" + (f"; {fix}" if fix else ""))

    with open_regular(path) as f:  # a FIFO named model.safetensors is refused, not waited on
        size = os.fstat(f.fileno()).st_size
        start = f.read(8)
        if len(start) < 8:
            raise damaged(f"it has {size} bytes, fewer than a header's length")
        (length,) = struct.unpack("<Q", start)
        if length > min(MAX_HEADER, size - 8):
            raise damaged(f"its header claims {length} bytes, the file holds {size - 8} after the length")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise damaged("its header is not valid JSON (truncated or overwritten)") from None
    if not isinstance(header, dict):
        raise damaged("its header is not a JSON object")
    data = size - 8 - length
    spans, tensors = [], {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise damaged("its __metadata__ is not a table of strings")
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise damaged(f"the entry of {name!r} is not a tensor's (dtype, shape, data_offsets)")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in ITEM_BYTES:
            raise damaged(f"{name!r} has the unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_count(n) for n in shape):
            raise damaged(f"{name!r} has the shape {shape!r}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(n) for n in offsets):
            raise damaged(f"{name!r} has the offsets {offsets!r}")
        begin, end = offsets
        expected = ITEM_BYTES[dtype] * _product(shape)
        if not begin <= end <= data:
            raise damaged(f"{name!r} lies at bytes {begin} to {end} of {data} (the file is truncated)")
        if end - begin != expected:
            raise damaged(f"{name!r} has {end - begin} bytes, its shape {tuple(shape)} of {dtype} needs {expected}")
        spans.append((begin, end, name))
        tensors[name] = (dtype, tuple(shape))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):  # neighbours
        if begin < end:
            raise damaged(f"{first!r} and {second!r} share bytes")
    return tensors


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _product(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
