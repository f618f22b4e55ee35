"""SIGTERM, SIGHUP (a closed terminal) and SIGINT while a command writes: one line that says it stopped and what was
not written, the exit code 128 + the signal, and nothing half-written left behind (the temporary folder removed). The
demo's report too: its models stay saved, and a resume writes the report."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import optional, small_config

from difftransformer.training.loop import train

# the demo's language-model part alone, at a tiny shape (test_demo_icl tests part 1)
DEMO_SHAPE = {"steps": 2, "eval_every": 2, "seq_len": 32, "batch_size": 4, "sample_tokens": 4, "part": "lm"}

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("signal_at_write.py")


@pytest.fixture(scope="module")
def run(module_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    train(small_config(module_data[1], root / "run", max_steps=2, ckpt_interval=2, eval_interval=2), quiet=True)
    return root / "run"


def _heard() -> None:
    """In the child: every stop signal at its default, as in a terminal (a shell's background job, as a test run may
    be, starts its children ignoring SIGINT, and a process keeps a signal it was started ignoring ignored)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


COMMANDS = [  # (command, what it writes, the signal)
    ("data prepare --input {corpus} --out {out}", "data directory", "TERM"),
    ("tokenizer train --input {corpus} --out {out} --vocab-size 300", "tokenizer directory", "INT"),
    ("convert --run {run} --to hf --out {out}", "output directory", "HUP"),
    ("quantize --run {run} --scheme w8a16 --out {out}", "output directory", "TERM"),
    ("analyze outliers --run {run} --tokens 256 --out {out}", "output directory", "INT"),
]


@pytest.mark.parametrize("line, what, name", COMMANDS, ids=[c[0].split(" --")[0] for c in COMMANDS])
def test_a_signal_while_a_command_writes_leaves_nothing_and_says_so(module_data, run, tmp_path, line, what, name):
    out = tmp_path / "out"
    argv = line.format(corpus=module_data[0], run=run, out=out).split()
    env = {**os.environ, "DIFFTX_SIGNAL": name}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], env=env, capture_output=True, text=True, timeout=600, preexec_fn=_heard
    )
    signum = getattr(signal, f"SIG{name}")
    assert done.returncode == 128 + signum, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    command = " ".join(argv[:2] if argv[0] in ("data", "tokenizer", "analyze") else argv[:1])
    assert last == (
        f"difftx {command}: interrupted: stopped by SIG{name}; {what} {out} was not written (nothing of it was left)"
    ), last
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no temporary


def test_a_signal_while_the_demo_writes_its_report_keeps_the_models_and_a_resume_writes_it(
    tmp_path, prepared, monkeypatch
):
    from difftransformer.apps import demo
    from difftransformer.errors import Interrupted, Stopped

    optional("matplotlib")
    shape = {**DEMO_SHAPE, "data": prepared}
    real = demo.write_text_atomic

    def stopped(path, text):
        if Path(path).name == "report.md":
            raise Stopped(signal.SIGTERM)  # what the handler difftx installs raises
        return real(path, text)

    monkeypatch.setattr(demo, "write_text_atomic", stopped)
    with pytest.raises(Interrupted) as stop:
        demo.run_demo(out=tmp_path / "demo", **shape)
    assert str(stop.value) == (
        f"stopped by SIGTERM while writing the report of {tmp_path / 'demo'}; the models are trained and saved: "
        f"difftx demo --resume --out {tmp_path / 'demo'} writes it"
    )
    assert stop.value.signum == signal.SIGTERM and not (tmp_path / "demo" / "report.md").exists()
    monkeypatch.setattr(demo, "write_text_atomic", real)
    demo.run_demo(out=tmp_path / "demo", resume=True, **shape)
    assert (tmp_path / "demo" / "report.md").read_text().startswith("# Demo")


def test_a_full_disk_while_the_demo_writes_its_report_names_the_file_and_the_way_to_write_it(
    tmp_path, prepared, monkeypatch
):
    """The report on a full disk: "[Errno 28]" named no file, a 0-byte report.md was left, and `demo --resume` then
    refused ("holds a finished demo"): the trained models never got their report."""
    import errno

    from difftransformer.apps import demo
    from difftransformer.fsutil import write_atomic

    optional("matplotlib")
    shape = {**DEMO_SHAPE, "data": prepared}

    def full(path, text):
        def half(tmp):
            tmp.write_text(text[:10])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        write_atomic(path, half)

    monkeypatch.setattr(demo, "write_text_atomic", full)
    with pytest.raises(OSError) as failed:
        demo.run_demo(out=tmp_path / "demo", **shape)
    report = tmp_path / "demo" / "report.md"
    assert str(failed.value).startswith(f"[Errno 28] could not write {report}: the disk is full: free some space; ")
    assert f"the models are trained and saved: once that is fixed, difftx demo --resume --out {tmp_path / 'demo'}" in (
        str(failed.value)
    )
    assert not report.exists() and not [p for p in report.parent.iterdir() if ".tmp-" in p.name]
    monkeypatch.undo()
    demo.run_demo(out=tmp_path / "demo", resume=True, **shape)
    assert report.read_text().startswith("# Demo")


def _train_for_a_minute(attention: str, seed: int) -> dict:
    import time

    time.sleep(60)
    return {}


def test_a_signal_stops_an_experiments_models_training_in_other_processes(monkeypatch):
    """SIGTERM now raises in every command: an experiment's pool of spawned workers must end with it, not run every
    queued model to its end first (what leaving the pool's block does)."""
    import time

    from difftransformer.apps.repro.fit import run_pairs
    from difftransformer.errors import Stopped

    def stop(signum, _frame):
        raise Stopped(signal.SIGTERM)  # what difftx's handler raises

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(5)  # the workers have started their models by then
    started = time.monotonic()
    try:
        with pytest.raises(Stopped):
            run_pairs(_train_for_a_minute, [0, 1], workers=2, steps=1, label="signal test")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 40  # the four queued minutes were not waited for


def test_a_signal_the_command_was_started_ignoring_stays_ignored(run, tmp_path):
    """`nohup difftx ...` starts it ignoring SIGHUP, so that closing the terminal does not stop it: it stays so."""
    out = tmp_path / "out"
    argv = ["quantize", "--run", str(run), "--scheme", "w8a16", "--out", str(out)]

    def ignoring_sighup() -> None:
        _heard()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    env = {**os.environ, "DIFFTX_SIGNAL": "HUP"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], env=env, capture_output=True, text=True, timeout=600,
        preexec_fn=ignoring_sighup,
    )  # fmt: skip
    assert "the signal did not stop the command" in done.stderr and done.returncode == 1  # the script's own failure
