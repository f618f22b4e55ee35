"""fsutil: reads with clear errors, and writes that never lose what already exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from difftransformer.errors import InputError
from difftransformer.fsutil import (
    check_new_dir,
    parse_json_object,
    read_text,
    remove_stale_temporaries,
    write_atomic,
    write_json,
    write_new_dir,
    write_text_atomic,
)


def test_read_text_names_the_first_bad_byte(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(InputError, match=r"latin1.txt is not valid UTF-8 \(byte 3: b'\\xe9 au'\); convert it"):
        read_text(path)


def test_read_text_drops_a_byte_order_mark_and_names_utf16(tmp_path):
    """A BOM once became three tokens at the start of a document; a UTF-16 file was told to convert from Latin-1."""
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfTo be")
    assert read_text(path) == "To be"
    path.write_bytes("To be".encode("utf-16"))
    with pytest.raises(InputError, match=r"is not valid UTF-8, it starts with UTF-16's byte-order mark .* -f utf-16"):
        read_text(path)


def test_linked_folders_of_an_input_are_read_once(tmp_path):
    """data prepare skipped a linked folder without a word (linked files were read); a link back up the tree is not a
    loop."""
    from difftransformer.store.corpus import find_files

    (tmp_path / "corpus" / "own").mkdir(parents=True)
    (tmp_path / "corpus" / "own" / "a.txt").write_text("a")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.md").write_text("b")
    (tmp_path / "corpus" / "linked").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "corpus" / "own" / "up").symlink_to(tmp_path / "corpus")  # a loop
    assert [p.relative_to(tmp_path / "corpus").as_posix() for p in find_files([tmp_path / "corpus"])] == [
        "linked/b.md",
        "own/a.txt",
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object, got list"),
        ("[" * 100000, "is nested too deeply"),
    ],
)
def test_parse_json_object_refuses_what_is_not_an_object(text, message):
    with pytest.raises(InputError, match=f"^config.json {message}"):
        parse_json_object(text, "config.json")


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "result.json"
    path.write_text("old")
    write_json(path, {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]} and path.read_text().endswith("\n")
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "figure.png"
    path.write_bytes(b"old figure")
    seen = []

    def failing(tmp):
        seen.append(tmp)
        tmp.write_bytes(b"half a fig")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, failing)
    assert path.read_bytes() == b"old figure"
    assert seen[0].suffix == ".png" and seen[0].parent == tmp_path  # a sibling, so the rename stays on one disk
    assert [p.name for p in tmp_path.iterdir()] == ["figure.png"]


def test_a_write_into_a_missing_directory_names_the_directory_not_the_temporary(tmp_path):
    path = tmp_path / "reports" / "maps.png"
    with pytest.raises(FileNotFoundError) as err:
        write_atomic(path, lambda tmp: tmp.write_bytes(b"png"))
    assert str(err.value) == f"the directory {path.parent} of {path} does not exist: create it or choose another"
    assert list(tmp_path.iterdir()) == []


def test_write_text_atomic_writes_utf8(tmp_path):
    write_text_atomic(tmp_path / "t.md", "λ = 0.8")
    assert (tmp_path / "t.md").read_bytes() == "λ = 0.8".encode()


def test_write_new_dir_appears_complete_or_not_at_all(tmp_path):
    out = tmp_path / "run"

    def failing(tmp):
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        write_new_dir(out, "output directory", failing)
    assert list(tmp_path.iterdir()) == []
    assert write_new_dir(out, "output directory", lambda tmp: (tmp / "a").write_text("x")) == 1
    assert [p.name for p in out.iterdir()] == ["a"]
    with pytest.raises(FileExistsError, match=f"output directory {out} already exists and is not empty"):
        write_new_dir(out, "output directory", lambda tmp: None)
    assert (out / "a").read_text() == "x"


def test_check_new_dir_accepts_an_empty_directory_and_the_allowed_names(tmp_path):
    check_new_dir(tmp_path / "missing", "out")
    (tmp_path / "empty").mkdir()
    check_new_dir(tmp_path / "empty", "out")
    (tmp_path / "empty" / "plan.json").write_text("{}")
    check_new_dir(tmp_path / "empty", "out", allow=("plan.json",))
    with pytest.raises(FileExistsError):
        check_new_dir(tmp_path / "empty", "out")


def test_stale_temporaries_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f".run.tmp-{dead_pid}").mkdir()
    (tmp_path / f".run.tmp-{os.getppid()}").mkdir()  # a live process (this one's parent)
    (tmp_path / ".run.tmp-notapid").mkdir()
    removed = remove_stale_temporaries(tmp_path, ".run.tmp-")
    assert [p.name for p in removed] == [f".run.tmp-{dead_pid}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".run.tmp-{os.getppid()}", ".run.tmp-notapid"])


def test_an_atomic_write_makes_an_ordinary_file(tmp_path):
    """Its temporary is made with exclusive creation (mkstemp), which makes it private (0600): the written file has
    the mode a new file gets from the process's umask instead, and no temporary stays."""
    from difftransformer import fsutil

    write_text_atomic(tmp_path / "a.json", "{}")
    (tmp_path / "b.json").write_text("{}")  # an ordinary new file
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == (tmp_path / "b.json").stat().st_mode & 0o777
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o666 & ~fsutil._UMASK
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]
