"""Training when things go wrong: non-finite steps are skipped and too many stop the run, SIGINT/SIGTERM write a
checkpoint and exit 130/143, a full disk is a clear error; each time the last checkpoint stays intact and the run
resumes to the losses of one that never stopped."""

from __future__ import annotations

import copy
import os
import resource
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import difftx, last_logged_step, losses, metric_rows, small_config, snapshot, train_args

from difftransformer.apps.cli import main
from difftransformer.core.model import TransformerLM
from difftransformer.errors import TrainingDiverged
from difftransformer.store.checkpoint import list_checkpoints, load_checkpoint, newest_calm, save_checkpoint
from difftransformer.store.runs import load_run
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
    step4 = tmp_path / "run" / "checkpoints" / "step_00000004"
    assert (
        "3 steps in a row (to step 8) had a non-finite loss or gradient: the run stopped at step 8 without saving; "
        f"its newest checkpoint, {step4}, is intact. To go on, start a new run from {step4} (--init-from) with a lower "
        f"--lr (e.g. 0.00015): difftx train --data {prepared} --out {tmp_path / 'run'}-lr0.00015 --lr 0.00015 "
        f"--init-from {step4} --seq-len 32"
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
    while time.time() < deadline and last_logged_step(run) < 5:
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
    assert "(File too large); nothing was replaced: the newest checkpoint, step_00000008, is intact" in message
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
    while time.time() < deadline and last_logged_step(run) < 5:
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


def _probe_losses_finite(checkpoint) -> bool:
    """Whether a checkpoint's weights give a finite loss on a few windows of text (independent of the trainer)."""
    model, tokenizer = load_run(checkpoint)
    ids = torch.tensor(tokenizer.encode("attention noise cancels when two softmax maps are subtracted " * 3))
    with torch.no_grad():
        return bool(torch.isfinite(model(ids[None, :64])).all())


def _restart_argv(message: str) -> list[str]:
    """The `difftx train` command at the end of a divergence message, as an argv for main()."""
    return shlex.split(message.split(": difftx ", 1)[1])


@pytest.mark.slow
def test_a_diverging_run_keeps_a_healthy_checkpoint_and_its_advice_works(prepared, tmp_path, capsys):
    """The learning rate ramps up to 1 over 20 steps: the loss spikes, then turns NaN. The spike is noted before the
    first NaN; no checkpoint whose weights give a NaN loss is written; keep-last 3 keeps the newest checkpoint from
    before the spike as a fourth; a resume that can only skip steps fails and deletes nothing; the new run that the
    message prints trains without a skipped step."""
    run = tmp_path / "run"
    flags = train_args(prepared, lr=1, warmup_steps=20, max_steps=60, ckpt_interval=2, eval_interval=1000)
    assert main(["train", *flags, "--out", str(run)]) == 3
    err = capsys.readouterr().err
    message = err.strip().splitlines()[-1]
    assert message.startswith("difftx train: error: at step ") and "the weights give a non-finite loss" in message
    stopped = int(message.split("at step ")[1].split(",")[0])
    spike = [line for line in err.splitlines() if "a loss spike, which often comes before divergence" in line]
    skipped = [r["step"] for r in metric_rows(run) if "skipped" in r]
    assert spike and int(spike[0].split()[2].rstrip(":")) < min(skipped, default=stopped)  # noted before the NaN
    kept = list_checkpoints(run)
    calm = newest_calm(run)
    assert calm is not None and calm in kept and len(kept) <= 3 + 1
    assert f"the newest from before the spike is {calm}" in message or f"checkpoint, {calm}, is intact" in message
    for checkpoint in kept:  # every checkpoint on disk loads and gives a finite loss
        assert load_checkpoint(checkpoint)[2]["health"]["probe_loss"] < 1e4
        assert _probe_losses_finite(checkpoint), checkpoint

    before = snapshot(run / "checkpoints")
    assert main(["train", "--resume", str(run), "--max-nonfinite-steps", "50", "--max-steps", "80", "--quiet"]) == 3
    assert "the weights give a non-finite loss" in capsys.readouterr().err
    assert snapshot(run / "checkpoints") == before  # nothing written, nothing rotated away

    argv = _restart_argv(message)
    assert argv[:2] == ["train", "--data"] and "--init-from" in argv and str(calm) in argv and "--lr" in argv
    assert main(argv) == 0
    restarted = metric_rows(f"{run}-lr0.1")
    assert restarted[-1]["step"] == 60 and not [r for r in restarted if "skipped" in r]
    assert restarted[-1]["val_loss"] < 5.0  # below ln 257 = 5.55: it learned


def _blow_up(run, step: int) -> None:
    """Replace checkpoint ``step`` of ``run`` with one whose weights are finite but give a NaN loss (lambda =
    exp(lambda_q1 . lambda_k1) overflows), as a version without the health check could write."""
    path = list_checkpoints(run)[-1]
    model, optim, meta = load_checkpoint(path)
    for name in ("layers.0.attn.lambda_q1", "layers.0.attn.lambda_k1"):
        model[name] = torch.full_like(model[name], 30.0)
    for key in ("health", "probe_best", "loss_watch"):
        meta.pop(key, None)
    save_checkpoint(run, step, model, optim, meta, keep_last=0)


@pytest.mark.slow
def test_a_checkpoint_that_gives_nan_is_refused_by_resume_init_from_and_generate(prepared, tmp_path, capsys):
    run = tmp_path / "run"
    train(small_config(prepared, run, max_steps=8), quiet=True)
    _blow_up(run, 8)
    step8, step4 = run / "checkpoints" / "step_00000008", run / "checkpoints" / "step_00000004"
    before = snapshot(run)
    assert main(["train", "--resume", str(run), "--max-nonfinite-steps", "50", "--max-steps", "40", "--quiet"]) == 3
    err = capsys.readouterr().err.strip()
    assert err == (
        f"difftx train: error: the newest checkpoint of {run}, step_00000008, is not healthy: the weights give a "
        "non-finite loss (the run had diverged when it was written, by a version that did not check). To resume from "
        f"the one before it (step_00000004), move it away: mv {step8} "
        f"{run / 'checkpoints' / 'diverged-step_00000008'}; or start a new run from an earlier checkpoint with "
        "--init-from and a lower --lr"
    )
    for temperature in ("0", "0.8"):
        assert main(["generate", "--run", str(run), "--prompt", "the", "--temperature", temperature]) == 2
        assert "the model's scores for the next token of prompt 0 are not finite (NaN or infinity)" in (
            capsys.readouterr().err
        )
    new = ["train", "--data", str(prepared), "--seq-len", "32", "--batch-size", "4", "--max-steps", "2", "--quiet"]
    assert main([*new, "--out", str(tmp_path / "a"), "--init-from", str(run)]) == 2
    assert f"{step8} (init_from) is not healthy: the weights give a non-finite loss" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    assert snapshot(run) == before
    assert main([*new, "--out", str(tmp_path / "b"), "--init-from", str(step4)]) == 0
    assert main(["generate", "--run", str(step4), "--prompt", "the", "--max-new-tokens", "5"]) == 0
    step8.rename(run / "checkpoints" / "diverged-step_00000008")  # the advice
    assert main(["train", "--resume", str(run), "--quiet"]) == 0

    only = tmp_path / "only"  # a run whose only checkpoint is not healthy: the command that starts it again
    train(small_config(prepared, only, max_steps=4), quiet=True)
    _blow_up(only, 4)
    assert main(["train", "--resume", str(only), "--max-steps", "8", "--quiet"]) == 3
    message = capsys.readouterr().err.strip()
    assert "It is the run's only checkpoint: start again with a lower --lr (e.g. 0.00015): difftx train" in message
    assert main(_restart_argv(message)) == 0
    assert metric_rows(f"{only}-lr0.00015")[-1]["step"] == 8


@pytest.mark.slow
def test_weights_that_are_not_finite_are_refused_with_the_checkpoint_before(prepared, tmp_path, capsys):
    run = tmp_path / "run"
    train(small_config(prepared, run, max_steps=8), quiet=True)
    path = list_checkpoints(run)[-1]
    model, optim, meta = load_checkpoint(path)
    model["layers.1.ffn.up_proj.weight"][0, 0] = float("nan")
    save_checkpoint(run, 8, model, optim, meta, keep_last=0)
    assert main(["generate", "--run", str(run), "--prompt", "the"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"difftx generate: error: {path / 'model.safetensors'} holds weights that are not finite "
        "(layers.1.ffn.up_proj.weight has NaN or infinity): the run had diverged when it was written. Use an earlier "
        f"checkpoint: --run {run / 'checkpoints' / 'step_00000004'}"
    )


@pytest.mark.slow
def test_a_resume_whose_every_step_is_skipped_fails(prepared, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    train(small_config(prepared, run, max_steps=8), quiet=True)
    real = TransformerLM.forward
    monkeypatch.setattr(
        TransformerLM, "forward", lambda self, *a, **k: real(self, *a, **k) * (float("nan") if self.training else 1)
    )
    resume = ["train", "--resume", str(run), "--max-steps", "12", "--max-nonfinite-steps", "50", "--quiet"]
    assert main(resume) == 3
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith(
        "difftx train: error: every step from 9 to 12 had a non-finite loss or gradient and was skipped, so the "
        "weights never changed: the run stopped at step 12 without saving;"
    )
    for checkpoint in list_checkpoints(run):
        assert _probe_losses_finite(checkpoint)


def test_a_state_that_is_not_finite_is_never_saved(prepared, tmp_path):
    trainer = Trainer(small_config(prepared, tmp_path / "run"), quiet=True)
    trainer.fit(until=4)
    state = next(iter(trainer.optimizer.state.values()))
    state["exp_avg_sq"][0] = float("inf")
    with pytest.raises(TrainingDiverged, match="at step 4, the optimizer state is not finite: the run stopped"):
        trainer.save()
    trainer.close()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_00000004"]


@pytest.mark.slow
def test_a_first_checkpoint_the_disk_refuses_says_what_is_left(prepared, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        difftx("train", *train_args(prepared, max_steps=4, ckpt_interval=2), "--out", str(run)),
        capture_output=True,
        text=True,
        preexec_fn=_limit_file_size(20_000),  # the model file of the first checkpoint does not fit
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"difftx train: error: [Errno 27] could not write checkpoint step_00000002 in {run / 'checkpoints'} (File too "
        f"large); nothing was replaced: it was the first checkpoint, so there is no earlier one; {run}, which held no "
        "checkpoint, was removed: start again"
    )
    assert not run.exists()


def test_a_second_trainer_on_a_run_being_written_is_told_so(prepared, tmp_path, capsys):
    """Two trainers started on one --out: the second was told to resume the run or remove it while the first was
    writing it."""
    from difftransformer.apps.cli import main

    first = Trainer(small_config(prepared, tmp_path / "run"), quiet=True)  # holds the run, no checkpoint yet
    try:
        assert main(["train", *train_args(prepared, max_steps=2), "--out", str(tmp_path / "run")]) == 2
    finally:
        first.close()
    err = capsys.readouterr().err
    assert f"is being written by another process (pid {os.getpid()})" in err and "remove it" not in err
