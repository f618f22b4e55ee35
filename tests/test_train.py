"""The training loop: metrics, schedule, checkpoints, exact resume (also after SIGKILL), accumulation, compile."""

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import SMALL, difftx, last_logged_step, losses, small_config, train_args

from difftransformer.store import checkpoint
from difftransformer.store.checkpoint import list_checkpoints, load_checkpoint
from difftransformer.training.loop import TrainConfig, Trainer, resume_config, train
from difftransformer.training.step import lr_at


def cli(*args, env_extra=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return difftx(*args), env


@pytest.mark.slow
def test_run_writes_metrics_lambda_checkpoints_and_learns(prepared, tmp_path):
    rows = train(
        small_config(
            prepared, tmp_path / "run", max_steps=30, eval_interval=10, ckpt_interval=10, keep_last=2, lr=3e-3
        ),
        quiet=True,
    )
    run = tmp_path / "run"
    assert [p.name for p in list_checkpoints(run)] == ["step_00000020", "step_00000030"]  # keep_last=2
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [10, 20, 30] and evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert 0 < evals[-1]["val_bpb"] < 8.5
    assert len(rows[-1]["lambda"]) == 2 and all(isinstance(v, float) for v in rows[-1]["lambda"])
    for name in ("train_config.json", "model_config.json", "tokenizer_spec.json", "metrics.jsonl"):
        assert (run / name).is_file()
    model_sd, optim, meta = load_checkpoint(list_checkpoints(run)[-1])
    assert meta["step"] == 30 and meta["data_position"] == 30 and "layers.0.attn.lambda_q1" in model_sd
    assert any(k.endswith("exp_avg_sq") for k in optim["state"]["layers.0.attn.q_proj.weight"])


def test_schedule_warmup_then_cosine():
    cfg = TrainConfig(data="d", out="o", max_steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0) and lr_at(100, cfg) == pytest.approx(0.1)
    assert lr_at(55, cfg) == pytest.approx(0.55)
    assert TrainConfig(data="d", out="o", max_steps=2000).warmup_steps == 200
    assert TrainConfig(data="d", out="o", max_steps=40000).warmup_steps == 375


@pytest.mark.slow
def test_resume_in_process_is_bitwise_identical(prepared, tmp_path):
    train(small_config(prepared, tmp_path / "full"), quiet=True)
    Trainer(small_config(prepared, tmp_path / "part"), quiet=True).fit(until=8)  # stops after the step-8 checkpoint
    train(resume_config(tmp_path / "part"), resume=True, quiet=True)
    assert losses(tmp_path / "part") == losses(tmp_path / "full")


@pytest.mark.slow
def test_resume_after_sigkill_is_bitwise_identical(prepared, tmp_path):
    args = ["train", *train_args(prepared, max_steps=300, eval_interval=10, ckpt_interval=7)]
    cmd, env = cli(*args, "--out", str(tmp_path / "full"))
    subprocess.run(cmd, env=env, check=True, timeout=300)
    cmd, env = cli(*args, "--out", str(tmp_path / "killed"))
    proc = subprocess.Popen(cmd, env=env)
    # killed at a step drawn between the first checkpoint (7) and 200, wherever it falls in the checkpoint cycle: a
    # delay after the first checkpoint (0-2 s, as before) left 0.6 s to spare before the run's end on an idle core
    # here, and on a machine twice as fast about a third of the draws came after it
    target, deadline = random.Random(os.getpid()).randrange(8, 200), time.time() + 120
    while last_logged_step(tmp_path / "killed") < target and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    done = losses(tmp_path / "killed")
    assert done and done[-1][0] < 300  # it really was interrupted
    cmd, env = cli("train", "--resume", str(tmp_path / "killed"), "--quiet")
    subprocess.run(cmd, env=env, check=True, timeout=300)
    assert losses(tmp_path / "killed") == losses(tmp_path / "full")


def test_crash_while_writing_keeps_last_good_checkpoint(prepared, tmp_path, monkeypatch):
    Trainer(small_config(prepared, tmp_path / "run"), quiet=True).fit(until=8)
    good = list_checkpoints(tmp_path / "run")[-1]
    before = (good / "model.safetensors").read_bytes()
    real_save = checkpoint.save_file

    def crash_on_optimizer(tensors, path, **kwargs):
        if Path(path).name == "optimizer.safetensors":
            raise OSError("disk full")
        real_save(tensors, path, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", crash_on_optimizer)
    with pytest.raises(OSError, match="disk full"):
        train(resume_config(tmp_path / "run"), resume=True, quiet=True)
    assert list_checkpoints(tmp_path / "run")[-1] == good
    assert (good / "model.safetensors").read_bytes() == before
    monkeypatch.undo()
    train(resume_config(tmp_path / "run"), resume=True, quiet=True)  # the partial write is ignored
    assert list_checkpoints(tmp_path / "run")[-1].name == "step_00000012"


def test_gradient_accumulation_matches_one_big_batch(prepared, tmp_path):
    a = train(small_config(prepared, tmp_path / "a", batch_size=4, grad_accum=1, max_steps=3), quiet=True)
    b = train(small_config(prepared, tmp_path / "b", batch_size=4, grad_accum=2, max_steps=3), quiet=True)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b, strict=True):  # the same windows, split in two micro-steps
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-5)


def test_bad_inputs_are_refused_and_nothing_is_overwritten(prepared, tmp_path):
    train(small_config(prepared, tmp_path / "run", max_steps=4), quiet=True)
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(
        FileExistsError, match=r"run directory .* holds a run \(at step 4\); to train it further: difftx train --resume"
    ):
        train(small_config(prepared, tmp_path / "run", max_steps=4), quiet=True)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    with pytest.raises(FileNotFoundError, match="does not exist; create it with 'difftx data prepare'"):
        train(small_config(tmp_path / "missing", tmp_path / "r2"), quiet=True)
    with pytest.raises(ValueError, match="sets vocab_size 300, but the data's tokenizer has 257 tokens"):
        train(small_config(prepared, tmp_path / "r3", model={**SMALL, "vocab_size": 300}), quiet=True)
    with pytest.raises(ValueError, match="fewer than one window"):
        train(
            small_config(prepared, tmp_path / "r4", seq_len=20000, model={**SMALL, "max_seq_len": 100000}), quiet=True
        )
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        train(small_config(prepared, tmp_path / "r5", model={**SMALL, "n_heads": 5}), quiet=True)
    with pytest.raises(ValueError, match="batch_size 5 is not divisible by grad_accum 2"):
        small_config(prepared, tmp_path / "r6", batch_size=5, grad_accum=2)
    for name in ("r2", "r3", "r4", "r5"):
        assert not (tmp_path / name).exists()


def test_resume_refuses_other_data(prepared, tmp_path, corpus_dir):
    from difftransformer.store.corpus import find_files, iter_documents
    from difftransformer.store.data import prepare
    from difftransformer.store.tokenizer import train_bpe

    train(small_config(prepared, tmp_path / "run", max_steps=4), quiet=True)
    tok = train_bpe(iter_documents(find_files([corpus_dir])), 300, tmp_path / "tok")
    prepare(iter_documents(find_files([corpus_dir])), tok, tmp_path / "bpe")
    cfg = resume_config(tmp_path / "run", max_steps=8)
    cfg.data = str(tmp_path / "bpe")
    with pytest.raises(ValueError, match="resume with data prepared with the run's tokenizer"):
        Trainer(cfg, resume=True, quiet=True)


@pytest.mark.slow
def test_compile_smoke(prepared, tmp_path):
    """--compile (torch.compile per block, CPU inductor) trains and gives the eager losses."""
    eager = train(small_config(prepared, tmp_path / "eager", max_steps=2, model={**SMALL, "n_layers": 1}), quiet=True)
    compiled = train(
        small_config(prepared, tmp_path / "compiled", max_steps=2, model={**SMALL, "n_layers": 1}, compile=True),
        quiet=True,
    )
    for a, b in zip(eager, compiled, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4)


def test_optimizer_step_scores_only_the_targets_that_are_not_ignored():
    """The loss is the mean cross-entropy over targets other than -100 (the synthetic tasks score a few positions),
    averaged over micro-batches; the update is taken at the given learning rate."""
    from difftransformer.core.config import ModelConfig
    from difftransformer.core.model import TransformerLM
    from difftransformer.training.step import make_optimizer, optimizer_step

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny", n_layers=1))
    x = torch.randint(0, 256, (2, 8))
    y = torch.full((2, 8), -100)
    y[0, 3], y[1, 7] = 5, 9
    with torch.no_grad():
        logp = model(x).log_softmax(-1)
    expected = -(logp[0, 3, 5] + logp[1, 7, 9]).item() / 2
    optimizer = make_optimizer(model, small_config(".", "."))
    before = model.embed.weight.detach().clone()
    row = optimizer_step(model, optimizer, [(x, y), (x, y)], 0.01, 1.0, torch.device("cpu")).row()
    assert row["loss"] == pytest.approx(expected, rel=1e-5)
    assert row["lr"] == 0.01 and optimizer.param_groups[0]["lr"] == 0.01 and "skipped" not in row
    assert not torch.equal(model.embed.weight, before)


def test_a_standard_run_starts_a_new_run_without_attention(prepared, tmp_path, capsys):
    """--init-from a standard-attention run (every plain Llama import): the model's attention comes with it. The
    default 'diff' once refused it ("--attention is 'diff' ... drop it", though it was not given)."""
    from difftransformer.apps.cli import main
    from difftransformer.store.runs import load_run

    train(small_config(prepared, tmp_path / "std", attention="standard", max_steps=2, ckpt_interval=2), quiet=True)
    args = ["train", "--data", str(prepared), "--init-from", str(tmp_path / "std"), "--out", str(tmp_path / "next"),
            "--max-steps", "2", "--seq-len", "32", "--batch-size", "4", "--eval-tokens", "256", "--quiet"]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    assert load_run(tmp_path / "next")[0].config.attention == "standard"
    assert main([*args[:-3], "--attention", "standard", "--out", str(tmp_path / "other"), "--quiet"]) == 2
    assert "--attention cannot be given with --init-from" in capsys.readouterr().err  # the model sets it
