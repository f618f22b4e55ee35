"""A soak: 2,000 steps of a tiny model with a checkpoint every 20 and keep-last 3, stopped by SIGTERM five times at
random steps and resumed each time, against the same run never stopped: the same weights and optimizer state bit
for bit, never more than keep-last + 1 checkpoints on disk, and a flat memory (the resident set at the end within
10% of step 200's). DIFFTX_SOAK_REPORT=path writes those numbers as JSON."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import difftx, last_logged_step, losses, train_args

from difftransformer.store.checkpoint import list_checkpoints, load_checkpoint

STEPS, EVERY, KEEP = 2000, 20, 3


def _rss_kib(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    line = next((x for x in status.splitlines() if x.startswith("VmRSS:")), None)
    return int(line.split()[1]) if line else None


class Watch:
    """Polls a training process: its last logged step, its resident memory, and how many checkpoints are on disk."""

    def __init__(self, run: Path) -> None:
        self.run, self.most_on_disk, self.rss = run, 0, {}

    def poll(self, proc: subprocess.Popen) -> int:
        step = last_logged_step(self.run)
        root = self.run / "checkpoints"
        if root.is_dir():  # complete checkpoints and writes in progress alike
            self.most_on_disk = max(self.most_on_disk, len(list(root.iterdir())))
        if (rss := _rss_kib(proc.pid)) is not None:
            self.rss[step] = rss
        return step


def _train(flags: list[str], watch: Watch, stop_at: int | None) -> int:
    """Run `difftx train` until it ends, or send SIGTERM once it has logged step ``stop_at``; its exit code."""
    proc = subprocess.Popen(difftx("train", *flags), stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        if stop_at is not None and watch.poll(proc) >= stop_at:
            proc.send_signal(signal.SIGTERM)
            stop_at = None
        watch.poll(proc)
        time.sleep(0.05)
    err = proc.stderr.read()
    assert proc.returncode in (0, 143), err[-2000:]
    return proc.returncode


def _state(run: Path):
    model, optim, meta = load_checkpoint(list_checkpoints(run)[-1])
    return model, optim["state"], meta["step"]


@pytest.mark.slow
def test_soak_sigterm_five_times_and_resume(prepared, tmp_path):
    flags = train_args(prepared, max_steps=STEPS, ckpt_interval=EVERY, keep_last=KEEP, eval_interval=500)
    flags += ["--log-interval", "10"]
    full = Watch(tmp_path / "full")
    assert _train([*flags, "--out", str(full.run)], full, stop_at=None) == 0

    run = Watch(tmp_path / "run")
    stops = sorted(random.Random(28).sample(range(50, STEPS - 50, 10), 5))
    assert _train([*flags, "--out", str(run.run)], run, stop_at=stops[0]) == 143
    for stop in [*stops[1:], None]:
        code = _train(["--resume", str(run.run), "--quiet"], run, stop_at=stop)
        assert code == (143 if stop is not None else 0)

    assert losses(run.run) == losses(full.run)
    (model, optim, step), (model_full, optim_full, step_full) = _state(run.run), _state(full.run)
    assert step == step_full == STEPS
    for name, tensor in model_full.items():
        assert torch.equal(model[name], tensor), name
    for name, state in optim_full.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(optim[name][key]), torch.as_tensor(value)), (name, key)
    assert 0 < run.most_on_disk <= KEEP + 1 and full.most_on_disk <= KEEP + 1
    assert len(list_checkpoints(run.run)) == KEEP
    early = min((s for s in full.rss if s >= 200), default=None)
    late = max(full.rss)
    assert early is not None and late >= STEPS - 100, sorted(full.rss)[:5]
    assert full.rss[late] <= 1.10 * full.rss[early], (full.rss[early], full.rss[late])
    if report := os.environ.get("DIFFTX_SOAK_REPORT"):  # the numbers, for a closing note
        numbers = {"stops": stops, "most_on_disk": [run.most_on_disk, full.most_on_disk]}
        numbers["rss_kib"] = {early: full.rss[early], late: full.rss[late]}
        Path(report).write_text(json.dumps(numbers) + "\n")
