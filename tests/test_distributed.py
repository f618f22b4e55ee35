"""Parallelism (training/distributed.py): two processes (DDP, FSDP2) match one, activation checkpointing, and the
helpers on a single process."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import difftx, last_logged_step, losses, metric_rows, small_config, train_args

from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.store.checkpoint import list_checkpoints, load_checkpoint
from difftransformer.training.distributed import (
    World,
    all_reduce_max,
    all_reduce_mean,
    full_state,
    init_world,
    load_full_state,
    parallelize,
    unwrap,
)
from difftransformer.training.loop import train
from difftransformer.training.step import make_optimizer


def cli(*args, env_extra=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return difftx(*args), env


LEAVES_THE_GROUP = """import sys
import torch.distributed as dist
from difftransformer.apps.cli import main
code = main(sys.argv[1:])
print("group still joined" if dist.is_initialized() else "group left", flush=True)
sys.exit(code)
"""


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one(prepared, tmp_path, parallel):
    args = train_args(prepared, max_steps=6, eval_interval=6, ckpt_interval=6)
    cmd, env = cli("train", *args, "--out", str(tmp_path / "one"))
    subprocess.run(cmd, env=env, check=True, timeout=300)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd, env = cli(
        "train", *args, "--out", str(tmp_path / "two"), "--parallel", parallel, env_extra={"OMP_NUM_THREADS": "1"}
    )
    program = tmp_path / "difftx_then_report_the_group.py"
    program.write_text(LEAVES_THE_GROUP)
    proc = subprocess.run(torchrun + [str(program)] + cmd[3:], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each process left the group before exiting: joined at the interpreter's shutdown, gloo's threads could abort a
    # run that had finished (SIGABRT, "terminate called without an active exception"), failing the group
    assert proc.stdout.count("group left") == 2, proc.stdout[-2000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [s for s, _ in one] == [s for s, _ in two] == list(range(1, 7))
    for (_, a), (_, b) in zip(one, two, strict=True):
        assert abs(a - b) < 1e-5
    lam_one, lam_two = (
        json.loads(r.read_text().splitlines()[-1])["lambda"]
        for r in (tmp_path / "one" / "metrics.jsonl", tmp_path / "two" / "metrics.jsonl")
    )
    assert len(lam_two) == 2 and max(abs(a - b) for a, b in zip(lam_one, lam_two, strict=True)) < 1e-5
    # the checkpoint written by the group resumes in a single process
    sd, _, meta = load_checkpoint(list_checkpoints(tmp_path / "two")[-1])
    sd_one, _, _ = load_checkpoint(list_checkpoints(tmp_path / "one")[-1])
    assert meta["step"] == 6
    for name, tensor in sd_one.items():
        torch.testing.assert_close(sd[name], tensor, rtol=1e-4, atol=1e-5)


def test_activation_checkpointing_same_losses_less_memory(prepared, tmp_path):
    from difftransformer.apps.bench import _lm_loss, saved_activation_bytes

    plain = train(small_config(prepared, tmp_path / "plain", max_steps=3), quiet=True)
    ac = train(small_config(prepared, tmp_path / "ac", max_steps=3, checkpoint_activations=True), quiet=True)
    for a, b in zip(plain, ac, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    x = torch.randint(0, 256, (2, 65))
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny", n_layers=4))
    full = saved_activation_bytes(lambda: _lm_loss(model, x))
    wrapped = parallelize(model, "none", World(), checkpoint_activations=True)
    assert "layers.0.attn.q_proj.weight" in wrapped.state_dict()  # names unchanged
    assert saved_activation_bytes(lambda: _lm_loss(wrapped, x)) < full / 2


def test_one_process_world_and_reductions_are_identities():
    world = init_world("cpu")
    assert (world.rank, world.size, world.device, world.is_main) == (0, 1, torch.device("cpu"), True)
    value = torch.tensor([1.5, -2.0])
    assert torch.equal(all_reduce_mean(value), value) and torch.equal(all_reduce_max(value), value)


def test_parallelize_refuses_unknown_modes_and_a_missing_process_group():
    model = TransformerLM(ModelConfig.preset("tiny", n_layers=1))
    with pytest.raises(ValueError, match="`parallel` must be one of"):
        parallelize(model, "zero3", World())
    with pytest.raises(ValueError, match="needs a process group: launch with torchrun"):
        parallelize(model, "ddp", World())
    assert parallelize(model, "none", World()) is model and unwrap(model) is model


def test_fsdp_on_cpu_is_refused_before_torch_2_7(monkeypatch):
    """torch 2.6's FSDP2 calls CUDA streams and fails on CPU (seen in the floor environment); 2.7 runs."""
    model = TransformerLM(ModelConfig.preset("tiny", n_layers=1))
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    with pytest.raises(ValueError, match=r"fsdp on CPU needs torch 2.7 or newer \(FSDP2 in torch 2.6.0\+cu124"):
        parallelize(model, "fsdp", World())
    monkeypatch.setattr(torch, "__version__", "2.7.0")
    with pytest.raises(ValueError, match="needs a process group"):  # past the version check
        parallelize(model, "fsdp", World())


def test_full_state_round_trips_model_and_optimizer():
    torch.manual_seed(0)
    cfg = small_config(".", ".")
    model = TransformerLM(ModelConfig.preset("tiny", n_layers=1))
    optimizer = make_optimizer(model, cfg)
    model(torch.randint(0, 256, (2, 9))).sum().backward()
    optimizer.step()
    model_sd, optim_sd = full_state(model, optimizer)
    torch.manual_seed(1)
    other = TransformerLM(ModelConfig.preset("tiny", n_layers=1))
    other_optimizer = make_optimizer(other, cfg)
    load_full_state(other, other_optimizer, model_sd, optim_sd)
    for name, tensor in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], tensor), name
    again_model, again_optim = full_state(other, other_optimizer)
    first = [v for s in optim_sd["state"].values() for v in s.values() if torch.is_tensor(v)]
    second = [v for s in again_optim["state"].values() for v in s.values() if torch.is_tensor(v)]
    assert len(first) == len(second) > 0 and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _ranks(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the worker processes torchrun started."""
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    found = {}
    for pid in children:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = [e for e in env if e.startswith(b"RANK=")]
        if rank:
            found[int(rank[0][5:])] = int(pid)
    return found


def _final_state(run):
    model, optim, meta = load_checkpoint(list_checkpoints(run)[-1])
    return model, optim["state"], meta["step"]


@pytest.mark.slow
def test_a_killed_process_restarts_the_group_which_resumes_bitwise(prepared, tmp_path):
    """SIGKILL to one of two DDP processes after the step-10 checkpoint: torchrun (--max-restarts 1) restarts the
    group, which resumes the run from its newest checkpoint (the same command, no --resume), and ends with the
    weights and optimizer state of a group that was never interrupted, bit for bit (DDP with the same world size:
    the same sums in the same order)."""
    import time

    flags = train_args(prepared, max_steps=40, ckpt_interval=10, eval_interval=20) + ["--parallel", "ddp"]
    train = ["-m", "difftransformer", "train", *flags]
    subprocess.run([*TORCHRUN, *train, "--out", str(tmp_path / "full")], env=ONE_THREAD, check=True, timeout=600)
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        [*TORCHRUN, "--max-restarts", "1", *train, "--out", str(run)], env=ONE_THREAD, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 300
    while time.time() < deadline and not (
        (run / "checkpoints" / "step_00000010").is_dir() and last_logged_step(run) >= 13
    ):
        time.sleep(0.05)
    ranks = _ranks(launcher)
    os.kill(ranks[1], signal.SIGKILL)
    _, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 0, err[-3000:]
    assert "difftx train: torchrun restart 1: resuming" in err
    assert losses(run) == losses(tmp_path / "full")
    (model, optim, step), (model_full, optim_full, step_full) = _final_state(run), _final_state(tmp_path / "full")
    assert step == step_full == 40
    for name, tensor in model_full.items():
        assert torch.equal(model[name], tensor), name
    for name, state in optim_full.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(optim[name][key]), torch.as_tensor(value)), (name, key)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_a_failing_process_ends_the_group_with_its_error_once(prepared, tmp_path, fault):
    """One process of two fails at step 5 (an error only it sees, or a hang). Every process ends, within a bound:
    the other one at once when the failing one exits (its connections close), or after the collective timeout (5 s
    here) when it hangs, and torchrun stops the rest. The error is printed once, the other process says in one
    line why it stopped (exit 4), no traceback; the checkpoints written before stay."""
    import time

    run = tmp_path / "run"
    flags = train_args(prepared, max_steps=40, ckpt_interval=2, collective_timeout=5) + ["--parallel", "ddp"]
    env = {**ONE_THREAD, "DIFFTX_FAULT_RANK": "1", "DIFFTX_FAULT_STEP": "5", "DIFFTX_FAULT": fault}
    start = time.time()
    proc = subprocess.run(
        [*TORCHRUN, str(Path(__file__).parent / "faults.py"), "train", *flags, "--out", str(run)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    seconds = time.time() - start
    assert proc.returncode != 0 and seconds < 150, (seconds, proc.stderr[-3000:])
    lines = proc.stderr.splitlines()
    injected = [line for line in lines if "is damaged (injected at step 5" in line]
    assert injected == ([] if fault == "hang" else ["difftx train: error: shard train_000.bin of rank 1 is damaged "
                        "(injected at step 5 by tests/faults.py)"])  # fmt: skip
    failed = [line for line in lines if "the process group failed" in line]  # process 0's line, unless torchrun's
    assert len(failed) == (1 if fault == "hang" else len(failed[:1]))  # SIGTERM comes first after an exit
    assert all(f.startswith("difftx train: error: process 0 of 2 stopped: the process group failed (") for f in failed)
    assert fault != "hang" or "Timed out waiting 5000ms for recv operation to complete" in failed[0]
    assert not [line for line in lines if line.startswith("[rank")]  # no worker traceback
    assert [p.name for p in list_checkpoints(run)][-1] == "step_00000004"
    load_checkpoint(list_checkpoints(run)[-1])


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_every_collective_tensor_is_on_the_worlds_device(prepared, tmp_path, parallel):
    """Two processes train through the real CLI (steps, reads, a checkpoint, validation, the end) with every
    torch.distributed collective checked (tests/collective_devices.py): each tensor must be on the world's device,
    as NCCL requires, including those made during training, where a tensor made without a device is caught."""
    flags = train_args(prepared, max_steps=6, eval_interval=3, ckpt_interval=3, log_interval=2)
    proc = subprocess.run(
        [*TORCHRUN, str(Path(__file__).parent / "collective_devices.py"), "train", *flags, "--parallel", parallel,
         "--out", str(tmp_path / "run")],
        env=ONE_THREAD, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # found anywhere in stderr, not by line: the two processes share the pipe (a run here saw their lines run together)
    counts = dict(re.findall(r"rank (\d) checked collectives: (\{[^}]*\})", proc.stderr))
    assert sorted(counts) == ["0", "1"] and all("'all_reduce'" in c for c in counts.values()), proc.stderr[-3000:]
    assert len(metric_rows(tmp_path / "run")) == 6 // 2 + 1  # steps 2, 3 (validation), 4, 6


@pytest.mark.slow
def test_fsdp_mixed_precision_matches_one_process_within_bfloat16s_own_error(prepared, tmp_path):
    """FSDP2 with --dtype bfloat16 on 2 gloo processes (MixedPrecisionPolicy: bfloat16 parameters in forward and
    backward, float32 gradient reduction and sharded float32 weights; CPU autocast) against one process with bfloat16
    autocast. The tolerance is bfloat16's own error, measured: one process in bfloat16 against one in float32 (eps,
    the largest gap over the steps' losses, and over the final weights). Each of the two bfloat16 runs carries about
    that error and FSDP2 also rounds the parameters themselves to bfloat16 (norm weights and lambda vectors too), so
    the two may differ by up to 3 eps; a defect (a lost reduction, a wrong shard) moves the losses by far more."""
    args = train_args(prepared, max_steps=12, eval_interval=12, ckpt_interval=12)
    runs = {}
    for name, dtype, processes in (("bf16", "bfloat16", 1), ("fp32", "float32", 1), ("fsdp", "bfloat16", 2)):
        one_thread = {"OMP_NUM_THREADS": "1"}
        cmd, env = cli("train", *args, "--dtype", dtype, "--out", str(tmp_path / name), env_extra=one_thread)
        if processes > 1:
            cmd = [*TORCHRUN, "-m", "difftransformer", *cmd[3:], "--parallel", "fsdp"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = ([loss for _, loss in losses(tmp_path / name)], _final_state(tmp_path / name)[0])
    assert "FSDP2 mixed precision: bfloat16 parameters" in proc.stdout

    def gaps(a, b):
        loss = max(abs(x - y) for x, y in zip(runs[a][0], runs[b][0], strict=True))
        weights = max(float((runs[a][1][n] - runs[b][1][n]).abs().max()) for n in runs[b][1])
        return loss, weights

    eps_loss, eps_weights = gaps("bf16", "fp32")
    loss, weights = gaps("fsdp", "bf16")
    assert 0 < eps_loss < 0.02 and 0 < eps_weights  # bfloat16 does round: the tolerance is not zero
    assert loss <= 3 * eps_loss, (loss, eps_loss)
    assert weights <= 3 * eps_weights, (weights, eps_weights)


def test_difftx_leaves_an_intact_group_and_keeps_its_outcome_if_leaving_fails(monkeypatch, capsys):
    """`main` leaves the process group after every outcome but a broken group's (exit 4: torchrun ends that one,
    and destroying it could wait on a dead process); a failure to leave is a warning, not a new outcome."""
    from difftransformer.apps.cli import exits
    from difftransformer.training import distributed

    left = []
    monkeypatch.setattr(distributed, "leave_world", lambda: left.append(True))
    for code, leaves in ((0, True), (2, True), (130, True), (exits.GROUP_FAILED, False)):
        left.clear()
        monkeypatch.setattr(exits, "_main", lambda argv, code=code: code)
        assert exits.main([]) == code and left == ([True] if leaves else [])

    def refuses():
        raise RuntimeError("the store went away")

    monkeypatch.setattr(distributed, "leave_world", refuses)
    monkeypatch.setattr(exits, "_main", lambda argv: 0)
    capsys.readouterr()
    assert exits.main([]) == 0
    assert "leaving the process group failed (RuntimeError: the store went away)" in capsys.readouterr().err
