"""Writing new directories safely: nothing existing is overwritten, and a crash leaves no half-written output."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def check_new_dir(path: Path, what: str) -> None:
    """Refuse to write into a directory that already holds something: nothing existing is overwritten."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{what} {path} already exists and is not empty; choose another path or remove it")


def write_new_dir(out: str | Path, what: str, write: Callable[[Path], T]) -> T:
    """Call ``write(tmp)`` on a temporary sibling of ``out``, then rename it to ``out``; on any error remove it."""
    out = Path(out)
    check_new_dir(out, what)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        result = write(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result
