"""What the repository commits names no machine: no absolute path of a scratch or home directory.

Reports, benchmark results, logs and configs are read on other machines; a path such as ``/tmp/run3`` or a home
directory in them points nowhere there (and says where someone worked). Paths in artifacts are relative to their own
directory or to the repository. The fixtures under tests/fixtures are exempt (they may hold such paths on purpose),
so is this file (its own cases are such paths), and so are the few lines below that name a scratch directory as a
script's overridable default.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The roots of scratch and home directories on Linux, macOS and Windows; written in pieces so that this file's own
# text does not match. A path counts when the root starts it: after a quote, a space, '=', '(' or a line start.
_ROOTS = ["tmp", "home", "root", "work", "Users", "var/folders", "private/var", "mnt"]
_UNIX = r"(?:^|[\s\"'`=(:,\[])(/(?:" + "|".join(map(re.escape, _ROOTS)) + r")/[^\s\"'`)]*)"
ABSOLUTE = re.compile(_UNIX + r"|[A-Z]:\\{1,2}Users")
# (file, text of the line): overridable defaults of scratch directories, not paths of a machine's artifacts.
ALLOWED = {
    ("benchmarks/gpu.sh", "OUT=${OUT:-/tmp/gpu-out}"),
}


def committed_text_files() -> list[str]:
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an unpacked sdist): the committed files are unknown")
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    return [n for n in done.stdout.split("\0") if n and not n.startswith("tests/fixtures/") and n != this]


def machine_paths(name: str, text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if (name, line.strip()) in ALLOWED:
            continue
        found += [f"{name}:{number}: {m.group(0).strip()}" for m in ABSOLUTE.finditer(line)]
    return found


def test_the_pattern_finds_machine_paths_and_passes_relative_ones():
    # the check's own cases: each of these is a path of one machine, each of those is portable
    for line in ['"out": "/tmp/qb/M-diff"', "run=/home/alice/runs/a", "see /work/main/reports", "(/Users/bob/x)",
                 r"C:\\Users\\bob", "`/root/.cache/x`"]:  # fmt: skip
        assert machine_paths("x.json", line), line
    for line in ['"out": "reports/needle5"', "https://example.org/tmp/x", "a/tmp/b", "~/.cache/difftransformer",
                 "$TMPDIR/run", "benchmarks/results/gpu.json"]:  # fmt: skip
        assert not machine_paths("x.json", line), line


def test_no_committed_file_holds_an_absolute_machine_path():
    found = []
    for name in committed_text_files():
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (figures, archives)
            continue
        found += machine_paths(name, data.decode("utf-8", errors="replace"))
    assert not found, "absolute machine paths in committed files (make them relative):\n" + "\n".join(found[:40])
