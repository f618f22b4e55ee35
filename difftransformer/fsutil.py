"""Files: text and JSON read with clear errors, and writes that never lose what already exists (new directories
appear complete or not at all; small files are replaced atomically)."""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from difftransformer.errors import InputError
from difftransformer.paths import RECORD_LIMIT, TEXT_LIMIT, check_output, errno_words, read_bytes

T = TypeVar("T")


def shell(path: str | Path) -> str:
    """A path as a shell reads it back, quoted when it must be: what a printed command line holds (a path with a
    space once broke the commands the messages suggest)."""
    return shlex.quote(str(path))


def read_text(path: str | Path, limit: int = TEXT_LIMIT, what: str = "") -> str:
    """A file's text (within ``limit`` bytes: paths.read_bytes), which must be UTF-8; a byte-order mark at its start
    is not text and is dropped (it once became three tokens at the start of a document). The error names the first
    bad byte and how to convert: a UTF-16 file says so by its byte-order mark; anything else is most often Latin-1."""
    path = Path(path)
    data = read_bytes(path, limit, what, hint="split it into smaller files" if limit == TEXT_LIMIT else "")
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        utf16 = data[:2] in (b"\xff\xfe", b"\xfe\xff")
        what = ", it starts with UTF-16's byte-order mark" if utf16 else ""
        raise InputError(
            f"{path} is not valid UTF-8{what} (byte {err.start}: {data[err.start : err.start + 4]!r}); convert it, "
            f"e.g. iconv -f {'utf-16' if utf16 else 'latin1'} -t utf-8"
        ) from None


def parse_json_object(text: str, where: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object; ``where`` names the source in the error. A key given twice in one object is
    refused (JSON leaves it undefined; Python's reader kept the last without a word)."""
    load = functools.partial(json.loads, object_pairs_hook=lambda pairs: _unique_keys(pairs, where))
    return parse_mapping(load, text, where, json.JSONDecodeError, "JSON", "a JSON object")


def parse_mapping(
    parse: Callable[[str], Any], text: str, where: str, errors: type[Exception], language: str, what: str
) -> dict[str, Any]:
    """``parse(text)``, which must be a mapping (``what``); its syntax ``errors``, a nesting too deep for the reader's
    recursion and any other type are refused by an InputError that names ``where``."""
    try:
        data = parse(text)
    except errors as err:
        raise InputError(f"{where} is not valid {language} ({' '.join(str(err).split())})") from None
    except RecursionError:
        raise InputError(f"{where} is nested too deeply to be read") from None
    if not isinstance(data, dict):
        raise InputError(f"{where} must hold {what}, got {type(data).__name__}")
    return data


def _unique_keys(pairs: list[tuple[str, Any]], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InputError(f"{where} gives the key {key!r} twice in one object; keep one")
        out[key] = value
    return out


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A JSON object the project reads back (a config, a manifest, a record), within RECORD_LIMIT bytes."""
    return parse_json_object(read_text(path, RECORD_LIMIT), str(path))


def write_atomic(path: str | Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through ``write(tmp)`` on a temporary sibling (same suffix), synced, then renamed into place
    in one step: a crash leaves the old file or the new one, never half of one."""
    path = Path(path)
    if not path.parent.is_dir():  # named here: the write's own error would name the temporary file
        raise FileNotFoundError(f"the directory {path.parent} of {path} does not exist: create it or choose another")
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}.tmp-", suffix=path.suffix, dir=path.parent)  # a new file
    os.fchmod(fd, 0o666 & ~_UMASK)  # as an ordinary new file would be (mkstemp makes it private)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        kept = "the earlier file is unchanged" if path.exists() else "nothing of it was left"
        if (failure := write_failure(err, path, kept)) is None:
            raise
        raise failure from err


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once, at import: setting it is process-wide, and another thread may be creating files


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically (see write_atomic)."""
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | Path, data: object, indent: int = 1) -> None:
    """Replace ``path`` with ``data`` as indented JSON atomically."""
    write_text_atomic(path, json.dumps(data, indent=indent) + "\n")


def check_new_dir(path: Path, what: str, allow: tuple[str, ...] = ()) -> None:
    """Refuse to write into a directory that already holds something (other than the names in ``allow``), or over a
    file: nothing existing is overwritten. The path must pass paths.check_output too."""
    path = check_output(path, what)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{what} {path} already exists and is a file, not a folder; choose another path")
    if path.is_dir() and any(p.name not in allow for p in path.iterdir()):
        raise FileExistsError(f"{what} {path} already exists and is not empty; choose another path or remove it")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(directory: Path, prefix: str) -> list[Path]:
    """Remove ``<prefix><pid>`` entries of ``directory`` left by processes that no longer run; return them."""
    removed = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        pid = entry.name[len(prefix) :]
        if entry.name.startswith(prefix) and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def write_new_dir(out: str | Path, what: str, write: Callable[[Path], T]) -> T:
    """Call ``write(tmp)`` on a temporary sibling of ``out``, then rename it to ``out``; on any error (a signal
    included) remove it. Temporaries of earlier writes that were killed are removed first; a live one (another
    process writing ``out`` now) is refused before any work. An ``out`` that is a link to an empty folder is written
    where the link points."""
    check_new_dir(Path(out), what)
    given, out = Path(out), Path(os.path.realpath(out))
    prefix = f".{out.name}.tmp-"
    remove_stale_temporaries(out.parent, prefix)
    others = [p.name[len(prefix) :] for p in out.parent.glob(f"{glob.escape(prefix)}*")]
    if busy := [pid for pid in others if pid.isdigit() and int(pid) != os.getpid()]:  # live: the stale are gone
        raise InputError(
            f"another process (pid {busy[0]}) is writing {what} {given} now; wait for it or choose another path"
        )
    tmp = out.parent / f"{prefix}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        result = write(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, KeyboardInterrupt):  # a signal: the one-line message says what was not written
            err.discarded = [*getattr(err, "discarded", []), f"{what} {given}"]
        if (failure := write_failure(err, f"{what} {given}")) is None:
            raise
        raise failure from err
    return result


def write_failure(err: BaseException, what: str | Path, kept: str = "nothing of it was left") -> OSError | None:
    """The one-line error of a write of ``what`` that ``err`` ended ("could not write WHAT: its cause in words; what
    was kept"), or None when ``err`` is not a failed read or write (then the caller re-raises it as it is)."""
    number = io_errno(err)
    return None if number is None else OSError(number, f"could not write {what}: {errno_words(number)}; {kept}")


def io_errno(err: BaseException) -> int | None:
    """The operating system's error number when ``err`` is a failed read or write (an OSError, or the error of a
    library written in Rust that wraps one, as safetensors and tokenizers say "(os error 28)"); None otherwise."""
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno
    found = re.search(r"\(os error (\d+)\)", str(err)) if isinstance(err, Exception) else None
    return int(found.group(1)) if found else None


def open_plan(
    out: Path,
    name: str,
    record: dict,
    what: str,
    other: Callable[[dict, Path], str],
    companions: tuple[str, ...] = (),
) -> dict:
    """The plan file ``out/name`` of a study that continues in its own directory: created with ``record`` in a new or
    empty ``out`` (or one that holds a companion plan file, another part of the same study), or read back when it
    holds the same record. A different record is refused with ``other(saved, path)`` (what the saved plan is and how
    to continue it), a directory with other things and no plan file too."""
    path = out / name
    if path.is_file():
        saved = read_json_object(path)
        if json.loads(json.dumps(record)) != saved:
            raise InputError(other(saved, path))
        return saved
    shared = any((out / c).is_file() for c in companions)
    if out.exists() and not shared and any(p.name != name for p in out.iterdir()):
        raise InputError(f"{out} is not empty and holds no {name}: give a new or empty `out` for a new {what}")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(record, indent=1) + "\n")
    return record
