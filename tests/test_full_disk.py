"""A full disk for every command that writes (issue #47, part 4): the OS refuses a write (here a file-size limit,
which fails a write with EFBIG as a full disk does with ENOSPC), and the command says in one line what it could not
write and that nothing of it was left, exit 2, no traceback; nothing partial stays that a later command would take as
complete. (Training's own case, with its intact earlier checkpoint: tests/test_train_failures.py.)"""

import resource
import signal
import subprocess

import pytest
from conftest import difftx

LIMIT = 2000  # bytes a file may grow to: every writer below writes a larger file


def _limited():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


@pytest.fixture(scope="module")
def shared(module_data, run_and_hf):
    """What the commands read, built once and never written by them: a corpus, a trained run and its export."""
    return {"corpus": module_data[0], "run": run_and_hf[0], "hf": run_and_hf[1]}


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, output, what",
    [
        ("data prepare --input {corpus} --out {tmp}/out", "out", "data directory"),
        ("tokenizer train --input {corpus} --out {tmp}/out --vocab-size 300", "out", "tokenizer directory"),
        ("convert --run {run} --to hf --out {tmp}/out", "out", "output directory"),
        ("convert --from-hf {hf} --out {tmp}/out", "out", "output directory"),
        ("quantize --run {run} --scheme w8a16 --out {tmp}/out", "out", "output directory"),
        ("analyze outliers --run {run} --run {run} --tokens 256 --out {tmp}/out", "out", "output directory"),
        ("demo --part lm", "data/pydocs", "data directory"),
        ("demo --part icl --icl-steps 2", "runs/demo/icl", "the worker processes' step counter"),
    ],
)
def test_a_full_disk_is_a_clear_error_and_leaves_nothing_partial(shared, tmp_path, command, output, what):
    argv = command.format(tmp=tmp_path, **shared).split()
    proc = subprocess.run(difftx(*argv), cwd=tmp_path, capture_output=True, text=True, preexec_fn=_limited, timeout=900)
    name = "difftx " + " ".join(argv[:2] if argv[0] in ("data", "tokenizer", "analyze") else argv[:1])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{name}: error: [Errno 27] could not write {what} "), last
    assert "the file is larger than this file system (or the process's file size limit) allows; nothing of" in last
    assert not (tmp_path / output).exists()
    assert not [p for p in (tmp_path / output).parent.iterdir() if ".tmp-" in p.name]  # no temporary left
