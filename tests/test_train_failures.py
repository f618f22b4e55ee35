"""Training when things go wrong: non-finite steps are skipped and too many stop the run, SIGINT/SIGTERM write a
checkpoint and exit 130/143, a full disk is a clear error; each time the last checkpoint stays intact and the run
resumes to the losses of one that never stopped."""

from __future__ import annotations

import copy
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import difftx, losses, metric_rows, small_config, train_args

from difftransformer.apps.cli import main
from difftransformer.core.model import TransformerLM
from difftransformer.training.checkpoint import list_checkpoints, load_checkpoint
from difftransformer.training.loop import Trainer, train


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_a_nonfinite_step_is_skipped_without_touching_weights_or_optimizer(prepared, tmp_path, capsys, where):
    trainer = Trainer(small_config(prepared, tmp_path / "run"), quiet=True)
    trainer.fit(until=2)
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    optimizer = copy.deepcopy(trainer.optimizer.state_dict())
    if where == "loss":
        poison = trainer.model.register_forward_hook(lambda _m, _a, out: out * float("nan"))
    else:
        poison = trainer.model.layers[0].attn.q_proj.weight.register_hook(lambda g: g * float("inf"))
    skipped = trainer.fit(until=3)[-1]
    poison.remove()
    assert skipped["step"] == 3 and skipped["skipped"] == f"non-finite {where}"
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    after = trainer.optimizer.state_dict()
    for key, state in optimizer["state"].items():
        for name, value in state.items():
            assert torch.equal(after["state"][key][name], value), (key, name)
    rest = trainer.fit()
    trainer.close()
    assert rest[-1]["step"] == 12 and all("skipped" not in r for r in rest)
    assert f"step 3: non-finite {where}" in capsys.readouterr().err
    assert [r["step"] for r in metric_rows(tmp_path / "run") if "skipped" in r] == [3]


@pytest.mark.slow
def test_nonfinite_steps_in_a_row_stop_the_run_with_its_last_checkpoint_intact(prepared, tmp_path, monkeypatch, capsys):
    train_calls = {"n": 0}
    real = TransformerLM.forward

    def forward(self, tokens, *args, **kwargs):
        out = real(self, tokens, *args, **kwargs)
        if self.training:
            train_calls["n"] += 1
            if train_calls["n"] > 5:  # steps 6, 7, 8, ...: NaN
                return out * float("nan")
        return out

    monkeypatch.setattr(TransformerLM, "forward", forward)
    flags = train_args(prepared, max_steps=12, ckpt_interval=4, eval_interval=4, max_nonfinite_steps=3)
    assert main(["train", *flags, "--out", str(tmp_path / "run")]) == 3
    err = capsys.readouterr().err
    assert (
        "3 steps in a row (to step 8) had a non-finite loss or gradient: the run stopped without saving; its last "
        "checkpoint (step 4) is intact"
    ) in err
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_00000004"]
    assert load_checkpoint(list_checkpoints(tmp_path / "run")[-1])[2]["step"] == 4  # loads: digests match
    monkeypatch.undo()
    assert main(["train", "--resume", str(tmp_path / "run"), "--quiet"]) == 0
    train(small_config(prepared, tmp_path / "full", ckpt_interval=4, eval_interval=4), quiet=True)
    assert losses(tmp_path / "run") == losses(tmp_path / "full")


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_finishes_the_step_writes_a_checkpoint_and_resumes_exactly(prepared, tmp_path, signum, code):
    flags = train_args(prepared, max_steps=200, eval_interval=50, ckpt_interval=1000)
    subprocess.run(difftx("train", *flags, "--out", str(tmp_path / "full")), check=True, timeout=600)
    run = tmp_path / "run"
    proc = subprocess.Popen(
        difftx("train", *flags, "--out", str(run)), stderr=subprocess.PIPE, text=True, env={**os.environ}
    )
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and len(metric_rows(run)) >= 5):
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    step = metric_rows(run)[-1]["step"]
    assert 5 <= step < 200  # it stopped early, after the step it was in
    assert [p.name for p in list_checkpoints(run)] == [f"step_{step:08d}"]  # written by the interrupt
    last = err.strip().splitlines()[-1]
    assert last == (
        f"difftx train: interrupted: stopped by {signal.Signals(signum).name} at step {step}; checkpoint "
        f"{run / 'checkpoints' / f'step_{step:08d}'}. Resume with: difftx train --resume {run}"
    )
    subprocess.run(difftx("train", "--resume", str(run), "--quiet"), check=True, timeout=600)
    assert losses(run) == losses(tmp_path / "full")


def _limit_file_size(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@pytest.mark.slow
def test_a_failed_checkpoint_write_is_a_clear_error_and_the_last_one_stays(prepared, tmp_path):
    """A write that the OS refuses (here: a file-size limit, as a full disk would) while writing a checkpoint."""
    train(small_config(prepared, tmp_path / "full"), quiet=True)
    run = tmp_path / "run"
    trainer = Trainer(small_config(prepared, run), quiet=True)
    trainer.fit(until=8)
    trainer.close()
    sizes = {p.name: p.stat().st_size for p in list_checkpoints(run)[-1].iterdir()}
    limit = (sizes["model.safetensors"] + sizes["optimizer.safetensors"]) // 2  # the model fits, the optimizer not
    proc = subprocess.run(
        difftx("train", "--resume", str(run), "--quiet"),
        capture_output=True,
        text=True,
        preexec_fn=_limit_file_size(limit),
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("difftx train: error: [Errno 27] could not write checkpoint step_00000012 in ")
    assert "(File too large); nothing was replaced: the earlier checkpoints are intact" in message
    assert [p.name for p in list_checkpoints(run)] == ["step_00000004", "step_00000008"]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]  # no temporary left
    load_checkpoint(list_checkpoints(run)[-1])
    subprocess.run(difftx("train", "--resume", str(run), "--quiet"), check=True, timeout=600)
    assert losses(run) == losses(tmp_path / "full")


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_process_at_the_same_step(prepared, tmp_path):
    """torchrun passes SIGTERM to its workers; they agree on the step to stop after (an all-reduce each step), the
    main process writes the checkpoint, and the run resumes in one process to the losses of one that never
    stopped."""
    flags = train_args(prepared, max_steps=300, eval_interval=50, ckpt_interval=1000)
    subprocess.run(difftx("train", *flags, "--out", str(tmp_path / "full")), check=True, timeout=600)
    run = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.Popen(
        [*torchrun, "-m", "difftransformer", "train", *flags, "--out", str(run), "--parallel", "ddp"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.time() + 180
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and len(metric_rows(run)) >= 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    step = metric_rows(run)[-1]["step"]
    assert 5 <= step < 300
    assert [p.name for p in list_checkpoints(run)] == [f"step_{step:08d}"]
    said = [line for line in err.splitlines() if line.startswith("difftx train: interrupted")]
    assert said == [
        f"difftx train: interrupted: stopped by SIGTERM at step {step}; checkpoint "
        f"{run / 'checkpoints' / f'step_{step:08d}'}. Resume with: difftx train --resume {run}"
    ]
    subprocess.run(difftx("train", "--resume", str(run), "--parallel", "none", "--quiet"), check=True, timeout=600)
    for (s1, a), (s2, b) in zip(losses(run), losses(tmp_path / "full"), strict=True):
        assert s1 == s2 and abs(a - b) < 1e-5
