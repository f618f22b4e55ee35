"""The one rule for every path (difftransformer/paths.py): inputs are regular files or folders, read within a bound
and never waited on; outputs are new paths, never the working directory, a device or a run's checkpoints folder;
an empty path is refused everywhere. Every path flag of every command is checked here with each kind of bad path."""

from __future__ import annotations

import argparse
import errno
import os
import re
import shlex
import socket
import subprocess
import sys
import time

import pytest

from difftransformer.apps.cli import build_parser, main
from difftransformer.apps.cli.parsing import PathArg, leaf_commands
from difftransformer.errors import InputError
from difftransformer.fsutil import write_new_dir
from difftransformer.paths import check_input, check_output, errno_words, read_bytes


@pytest.fixture
def specials(tmp_path):
    """A FIFO, a link to /dev/zero, a socket and a dangling link, each named like a text file."""
    os.mkfifo(tmp_path / "fifo.txt")
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    (tmp_path / "gone.txt").symlink_to(tmp_path / "nothing")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock.txt"))
    yield tmp_path
    sock.close()


@pytest.mark.parametrize(
    "name, kind",
    [("fifo.txt", "a FIFO (named pipe)"), ("zero.txt", "a character device"), ("sock.txt", "a socket")],
)
def test_an_input_that_is_not_a_regular_file_is_refused_by_name(specials, name, kind):
    with pytest.raises(InputError, match=rf"input .*{name}.* is {re.escape(kind)}, not a regular file or a folder"):
        check_input(specials / name, "input")
    with pytest.raises(InputError, match=rf"is {re.escape(kind)}"):  # opened without blocking, refused after opening
        read_bytes(specials / name)


def test_a_link_to_a_device_says_where_it_points(specials):
    with pytest.raises(InputError, match=r"zero.txt \(a link to /dev/zero\) is a character device"):
        check_input(specials / "zero.txt", "--input")


def test_empty_and_missing_inputs(specials):
    with pytest.raises(InputError, match=r"^--input is an empty path \(an unset shell variable gives one\)"):
        check_input("", "--input")
    with pytest.raises(FileNotFoundError, match=r"gone.txt does not exist"):
        check_input(specials / "gone.txt", "input")
    with pytest.raises(InputError, match="is a folder: give a file"):
        check_input(specials, "--config", folder=False)


def test_a_fifo_is_refused_without_waiting_for_a_writer(specials):
    """Opening a FIFO for reading blocks until a writer comes: the reader opens without blocking and checks after."""
    code = f"from difftransformer.paths import read_bytes; read_bytes({str(specials / 'fifo.txt')!r})"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "is a FIFO (named pipe)" in done.stderr and time.monotonic() - started < 30


def test_reads_are_bounded(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b" " * 101)
    assert read_bytes(path, limit=101) == b" " * 101
    with pytest.raises(InputError, match=r"big.json has 101 bytes, over the 100 read here; split it"):
        read_bytes(path, limit=100, hint="split it")


def test_outputs_that_would_lose_the_working_directory_or_break_a_run_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    with pytest.raises(InputError, match=r"^--out \. is the working directory"):
        check_output(".", "--out")
    monkeypatch.chdir(tmp_path / "sub")
    with pytest.raises(InputError, match=r"is the working directory or a folder that holds it"):
        check_output(tmp_path, "--out")
    with pytest.raises(InputError, match=r"^--out is an empty path"):
        check_output("", "--out")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "model_config.json").write_text("{}")
    with pytest.raises(InputError, match=r"inside the checkpoints folder of the run .*run, which only training writes"):
        check_output(run / "checkpoints" / "step_99999999", "--out")
    check_output(run / "attention.png", "--out")  # beside the checkpoints, a run holds what its user puts there


def test_failed_writes_say_the_cause_in_words():
    assert errno_words(errno.ENOSPC) == "the disk is full: free some space"
    assert errno_words(errno.EACCES).startswith("permission denied")
    assert errno_words(errno.ENOTEMPTY).startswith("something of that name appeared meanwhile")
    assert errno_words(errno.ECHILD) == os.strerror(errno.ECHILD)  # anything else as the system says it


def test_a_new_directory_through_a_link_to_an_empty_folder_is_written_where_it_points(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    write_new_dir(tmp_path / "link", "data directory", lambda tmp: (tmp / "a").write_text("x"))
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "a").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]


def test_a_second_writer_of_the_same_directory_is_refused_before_its_work(tmp_path):
    """Two `data prepare` into one --out: the second is told at once (the first's temporary names its pid), instead
    of failing after its work."""
    live = tmp_path / f".data.tmp-{os.getppid()}"  # a live process's temporary (this one's parent)
    live.mkdir()
    work = []
    with pytest.raises(InputError, match=rf"another process \(pid {os.getppid()}\) is writing data directory"):
        write_new_dir(tmp_path / "data", "data directory", work.append)
    assert work == [] and live.is_dir()


# ---- every path flag of every command ------------------------------------------------------------------------

COMMANDS = dict(leaf_commands(build_parser()))
PATH_FLAGS = [
    (path, action)
    for path, parser in COMMANDS.items()
    for action in parser._actions
    if isinstance(action.type, PathArg)
]
# flags that take text that is not a path (checked by the completeness test below: a new text flag is one or other)
TEXT_FLAGS = {
    "--prompt", "--stop", "--text-field", "--license", "--dataset", "--preset", "--device", "--model", "--log-to",
}  # fmt: skip


def test_every_flag_that_takes_text_is_a_path_flag_or_known_text():
    for path, parser in COMMANDS.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.type not in (None, str) or action.choices:
                continue
            if action.nargs == 0 or isinstance(action, argparse._StoreConstAction):
                continue
            flag = action.option_strings[-1] if action.option_strings else action.dest
            assert flag in TEXT_FLAGS, f"difftx {' '.join(path)} {flag}: a path (type INPUT or OUTPUT) or text?"
    assert len(PATH_FLAGS) >= 30


def _argv_with(path: tuple[str, ...], action: argparse.Action, value: str) -> list[str]:
    """The command's first example with ``value`` given to ``action`` (replacing the example's value)."""
    argv = shlex.split(COMMANDS[path].epilog.splitlines()[1])[1:]
    if not action.option_strings:  # a positional: the first word after the command's words
        return [*argv[: len(path)], value, *argv[len(path) + 1 :]]
    flag = next((f for f in action.option_strings if f in argv), None)
    if flag is None:
        return [*argv, action.option_strings[-1], value]
    i = argv.index(flag) + 1
    j = next((k for k in range(i, len(argv)) if argv[k].startswith("--")), len(argv))
    return [*argv[:i], value, *argv[j:]]


@pytest.mark.parametrize("bad", ["empty", "fifo", "device", "link to a device"])
@pytest.mark.parametrize("path, action", PATH_FLAGS, ids=[f"{' '.join(p)} {a.dest}" for p, a in PATH_FLAGS])
def test_every_path_flag_refuses_an_empty_path_a_fifo_and_a_device(specials, capsys, path, action, bad):
    link = specials / "zero.txt"
    values = {"empty": "", "fifo": specials / "fifo.txt", "device": "/dev/null", "link to a device": link}
    argv = _argv_with(path, action, str(values[bad]))
    assert main(argv) == 2, argv
    message = capsys.readouterr().err.strip()
    flag = action.option_strings[-1] if action.option_strings else action.dest.upper()
    expected = {
        "empty": f"{flag} is an empty path",
        "fifo": "is a FIFO (named pipe)",
        "device": "/dev/null is a character device",
        "link to a device": "is a character device",
    }[bad]
    assert len(message.splitlines()) == 1 and f": error: {flag}" in message and expected in message, message


def test_a_folder_holding_a_fifo_or_a_device_under_a_text_files_name_is_refused_by_name(specials, tmp_path):
    """Inside an input folder too: a FIFO named like a text file would block the reader, a link to /dev/zero never end;
    other names are not read, so not looked at."""
    from difftransformer.store.corpus import find_files

    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("text")
    (folder / "notes.sock").symlink_to(specials / "sock.txt")  # not a text file's name: never opened
    assert find_files([folder]) == [folder / "a.txt"]
    os.mkfifo(folder / "b.md")
    with pytest.raises(InputError, match=r"input .*corpus/b.md is a FIFO \(named pipe\)"):
        find_files([folder])
