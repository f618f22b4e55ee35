"""The one rule for every path a command reads or writes, checked before anything is opened.

- An input is a regular file or a folder (links followed only to those): a FIFO would block its reader forever, a
  device (``/dev/zero``) would be read without end, so both, and sockets, are refused by name. Files are read within
  a stated size bound (``read_bytes``), opened without blocking, so that a FIFO put in place after the check is
  refused too.
- An output is a new path: never empty, never a FIFO or device, never the working directory or a folder holding it
  (replacing it would pull the folder out from under the shell), never inside a run's ``checkpoints`` folder
  (which only training writes).
- An empty path (as an unset shell variable gives) is refused everywhere: ``Path("")`` is the working directory.
- A failed write names the path and the cause in words (``errno_words``), not one advice for every failure.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from difftransformer.errors import InputError

TEXT_LIMIT = 1 << 30  # one input text file (data prepare, tokenizer train, eval, a prompt): 1 GiB, read whole
RECORD_LIMIT = 64 << 20  # a JSON, TOML or YAML file the project reads back (configs, states, manifests): 64 MiB
RUN_CHECKPOINTS = ("checkpoints", "model_config.json")  # a run's checkpoints folder, known by its run's config

_SPECIAL = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def special_kind(mode: int) -> str | None:
    """What a file of this mode is when it is neither a regular file nor a folder (None when it is one of them)."""
    return next((name for test, name in _SPECIAL if test(mode)), None)


def refuse_empty(path: str | Path | None, what: str) -> None:
    if path is not None and str(path) == "":
        raise InputError(f"{what} is an empty path (an unset shell variable gives one): give a path")


def check_input(path: str | Path, what: str, folder: bool = True, missing_ok: bool = False) -> Path:
    """``path`` as an input: not empty, present (unless ``missing_ok``: the caller says what to make), and (links
    followed) a regular file, or a folder when ``folder``.

    Raises:
        InputError: an empty path, or a FIFO, device or socket (named as such).
        FileNotFoundError: nothing is there (a dangling link included).
    """
    refuse_empty(path, what)
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError) as err:
        if missing_ok:
            return path
        part = " (a part of it is a file)" if isinstance(err, NotADirectoryError) else ""
        raise FileNotFoundError(f"{what} {path} does not exist{part}") from None
    refuse_special(path, mode, what)
    if stat.S_ISDIR(mode) and not folder:
        raise InputError(f"{what} {path} is a folder: give a file")
    return path


def refuse_special(path: Path, mode: int, what: str) -> None:
    kind = special_kind(mode)
    if kind is not None:
        linked = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
        raise InputError(
            f"{what} {path}{linked} is {kind}, not a regular file or a folder: give a file (a FIFO would block the "
            "read, a device be read without end)"
        )


def open_regular(path: str | Path, what: str = ""):
    """``path`` opened for binary reading when it is a regular file. It is opened without blocking and checked after
    opening, so a FIFO or device is refused by name however it got there (a FIFO put in place after a check
    included); ``what`` names the file's role in the message."""
    refuse_empty(path, what or "a file")
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:  # a socket cannot be opened at all (ENXIO): say what it is
        if err.errno == errno.ENXIO:
            refuse_special(path, os.stat(path).st_mode, what or "the file")
        raise
    try:
        mode = os.fstat(fd).st_mode
        refuse_special(path, mode, what or "the file")
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, f"{f'{what} ' if what else ''}{path} is a folder, not a file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | Path, limit: int = RECORD_LIMIT, what: str = "", hint: str = "") -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``), at most ``limit`` of them: ``hint`` says what to
    do with a file over the bound."""
    name = f"{what} {path}" if what else str(path)
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise InputError(f"{name} has {size:,} bytes, over the {limit:,} read here{hint and '; ' + hint}")
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew while being read
        raise InputError(f"{name} grew past {limit:,} bytes while being read{hint and '; ' + hint}")
    return data


def check_output(path: str | Path, what: str) -> Path:
    """``path`` as an output a command creates: not empty, not a FIFO, device or socket, not the working directory
    or a folder that holds it, and not inside a run's checkpoints folder. Whether it may exist already is the
    writer's rule (a new directory may be empty; a study's own store is continued)."""
    refuse_empty(path, what)
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and special_kind(mode) is not None:
        raise InputError(f"{what} {path} is {special_kind(mode)}: give the path of a new file or folder")
    real, here = os.path.realpath(path), os.path.realpath(os.getcwd())
    if real == here or here.startswith(real.rstrip(os.sep) + os.sep):
        raise InputError(
            f"{what} {path} is the working directory{'' if real == here else ' or a folder that holds it'}: give a "
            "new folder's name (e.g. runs/mine)"
        )
    for parent in Path(real).parents:
        if parent.name == RUN_CHECKPOINTS[0] and (parent.parent / RUN_CHECKPOINTS[1]).is_file():
            raise InputError(
                f"{what} {path} is inside the checkpoints folder of the run {parent.parent}, which only training "
                "writes: choose a path outside it"
            )
    return path


_WORDS = {
    errno.ENOSPC: "the disk is full: free some space",
    errno.EDQUOT: "the disk quota is used up: free some space",
    errno.EFBIG: "the file is larger than this file system (or the process's file size limit) allows",
    errno.EACCES: "permission denied: choose a folder you may write to",
    errno.EPERM: "the operation is not permitted here: choose a folder you may write to",
    errno.EROFS: "the file system is read-only: choose another place",
    errno.ENOTDIR: "a part of the path is a file, not a folder: choose another path",
    errno.EEXIST: "something of that name appeared meanwhile (another process?): choose another path",
    errno.ENOTEMPTY: "something of that name appeared meanwhile (another process?): choose another path",
    errno.ENAMETOOLONG: "a name in the path is too long: choose a shorter one",
    errno.EIO: "an input/output error (a failing disk, or a network mount that went away)",
    errno.ENOENT: "a folder of the path was removed meanwhile",
    errno.EMFILE: "too many files are open in this process",
    errno.EXDEV: "the temporary copy lies on another file system than the destination",
}


def errno_words(number: int) -> str:
    """What a failed write's error number means for the user, and what to do when the user can do something."""
    return _WORDS.get(number, os.strerror(number))
