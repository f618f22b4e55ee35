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


def _ninja_dir(tmp_path: Path, name: str) -> str:
    """A folder holding an executable named ninja (a stand-in for the system's)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "ninja").write_text("#!/bin/sh\nexit 1\n")
    (folder / "ninja").chmod(0o755)
    return str(folder)


def test_the_ninja_installed_with_this_python_goes_first_on_path(tmp_path, monkeypatch):
    """Another ninja ahead on PATH (a system one, as when the environment is not activated) is put behind ours."""
    import shutil

    ours = os.path.dirname(sys.executable)
    assert os.access(os.path.join(ours, "ninja"), os.X_OK), "the test environment installs ninja (requirements)"
    other = _ninja_dir(tmp_path, "system")
    for path in (f"{other}{os.pathsep}/usr/bin{os.pathsep}{ours}", f"{ours}{os.pathsep}{other}", other):
        monkeypatch.setenv("PATH", path)
        cpu_kernel._put_ninja_on_path()
        assert shutil.which("ninja") == os.path.join(ours, "ninja")
        entries = os.environ["PATH"].split(os.pathsep)
        assert entries.count(ours) == 1 and other in entries


@pytest.mark.slow
def test_switching_between_an_activated_shell_and_make_rebuilds_nothing(tmp_path):
    """The issue's case: `make` runs .venv/bin/python with the system's PATH (a system ninja first), an activated
    shell puts .venv/bin first; with two ninjas of different versions each switch rebuilt the kernel."""
    system = shutil_which_elsewhere("ninja", os.path.dirname(sys.executable))
    if system is None:
        system = _ninja_dir(tmp_path, "system")  # a ninja that fails: any build through it would fail loudly
    else:
        system = os.path.dirname(system)
    ours = os.path.dirname(sys.executable)
    env = {**os.environ, "DIFFTX_CACHE": str(tmp_path / "cache")}
    outputs = []
    for path in (f"{system}{os.pathsep}{os.environ['PATH']}", f"{ours}{os.pathsep}{system}{os.pathsep}/usr/bin"):
        run = subprocess.run([sys.executable, "-c", BUILD], env={**env, "PATH": path}, capture_output=True, text=True)
        assert run.returncode == 0 and "kernel: ready" in run.stdout, run.stdout + run.stderr
        outputs.append(run.stderr)
    assert "building the fused CPU attention kernel" in outputs[0]
    assert "rebuilt" not in outputs[1] and "building" not in outputs[1], outputs[1]


def shutil_which_elsewhere(name: str, besides: str) -> str | None:
    """The first ``name`` on PATH that is not in the folder ``besides``."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(folder, name)
        if folder and folder != besides and os.access(candidate, os.X_OK) and os.path.isfile(candidate):
            return candidate
    return None
