"""A kernel build that was stopped never blocks a later command: the builder holds an flock the system releases when
it dies, PyTorch's own lock file left by a dead builder is removed with a message, and a wait for a live builder
says what it waits for."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from difftransformer.core.attention import cpu_kernel

BUILD = "from difftransformer.core.attention import cpu_kernel; print(cpu_kernel.build(), flush=True)"


def test_a_lock_file_left_by_a_dead_builder_is_removed_with_a_word(tmp_path, capsys):
    (tmp_path / "lock").write_text("")  # PyTorch's FileBaton of a build that was killed
    with cpu_kernel.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        assert (tmp_path / cpu_kernel.BUILDER).read_text() == str(os.getpid())
    assert f"removed {tmp_path / 'lock'}, left by a kernel build that was stopped" in capsys.readouterr().err


def test_a_wait_for_a_live_builder_names_it_and_ends_when_it_does(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cpu_kernel, "WAIT_NOTE_S", 0.3)
    holder = os.open(tmp_path / cpu_kernel.BUILDER, os.O_RDWR | os.O_CREAT)  # another open file: another holder
    fcntl.flock(holder, fcntl.LOCK_EX)
    os.write(holder, b"4242")
    threading.Timer(1.0, os.close, (holder,)).start()  # the builder finishes after a second
    started = time.monotonic()
    with cpu_kernel.build_lock(tmp_path):
        waited = time.monotonic() - started
    assert 0.9 < waited < 30
    err = capsys.readouterr().err
    assert f"waiting for process 4242, which is building the fused CPU attention kernel in {tmp_path}" in err


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    """Until ``path`` exists (the build has started compiling), or fail if ``proc`` ends first."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_build_killed_by_sigterm_or_sigkill_never_blocks_the_next_command(tmp_path):
    """The issue's case: `difftx generate` of a new user stopped by SIGTERM while it builds, then a builder killed by
    SIGKILL (which nothing can catch), then the next command builds the kernel and runs."""
    from difftransformer import ModelConfig, TransformerLM
    from difftransformer.store.runs import save_run
    from difftransformer.store.tokenizer import ByteTokenizer

    run = save_run(TransformerLM(ModelConfig.preset("tiny", vocab_size=257)), ByteTokenizer(), tmp_path / "run", {})
    env = {**os.environ, "DIFFTX_CACHE": str(tmp_path / "cache")}
    where = "from difftransformer.core.attention import cpu_kernel as k; print(k.build_directory())"
    name = subprocess.run([sys.executable, "-c", where], env=env, capture_output=True, text=True, check=True).stdout
    name = name.strip()
    baton = Path(name) / "lock"
    generate = [sys.executable, "-m", "difftransformer", "generate", "--run", str(run), "--prompt", "x"]
    generate += ["--max-new-tokens", "2", "--device", "cpu"]

    first = subprocess.Popen(generate, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(baton, first)
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, err

    second = subprocess.Popen([sys.executable, "-c", BUILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _wait_for(baton, second)
    second.kill()
    second.communicate(timeout=120)
    assert baton.exists()  # what a killed builder leaves, on which every later build used to wait forever

    third = subprocess.run(generate, env=env, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr
    assert f"removed {baton}, left by a kernel build that was stopped" in third.stderr
    assert not baton.exists() and list(Path(name).glob("*.so"))
