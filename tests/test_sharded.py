"""Sharded checkpoints (FSDP): each process writes its pieces of every tensor (store/shards.py), any number of
processes reads back exactly its part, and one process reads the whole. The store layer on hand-made pieces, then
whole runs under torchrun: resumed with the same process count bit for bit, with another (2 -> 1, 1 -> 2) from a
loaded state that is the saved one bit for bit."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import difftx, losses, train_args
from safetensors import safe_open

from difftransformer.errors import InputError
from difftransformer.store.checkpoint import (
    is_sharded,
    list_checkpoints,
    load_checkpoint,
    load_model,
    new_checkpoint_dir,
    publish_checkpoint,
    write_pieces,
)
from difftransformer.store.runs import load_run
from difftransformer.store.shards import PieceReader, piece_files


def _split(full: torch.Tensor, world: int) -> list[tuple[torch.Tensor, tuple, tuple]]:
    """FSDP2's split of dim 0: chunks of ceil(n / world) rows (the last ones shorter, possibly empty)."""
    rows = -(-full.shape[0] // world)
    out = []
    for rank in range(world):
        start = min(rank * rows, full.shape[0])
        piece = full[start : start + rows].contiguous()
        out.append((piece, tuple(full.shape), (start,) + (0,) * (full.dim() - 1)))
    return out


def _sharded_checkpoint(run: Path, model: dict, optim: dict, world: int, step: int = 4) -> Path:
    """A checkpoint as `world` FSDP processes write it: every tensor split by rows, one file per process and kind."""
    tmp = new_checkpoint_dir(run, step, "-sharded")
    files = {}
    for rank in range(world):
        for kind, tensors in (("model", model), ("optimizer", optim)):
            pieces = {name: _split(t, world)[rank] for name, t in tensors.items()}
            name, digest = write_pieces(tmp, kind, rank, world, pieces)
            files[name] = digest
    params = sorted({name.rsplit("/", 1)[0] for name in optim})
    meta = {"optimizer": {"param_groups": [{"params": params, "lr": 1e-3}], "scalars": {}}}
    return publish_checkpoint(run, step, tmp, files, meta, keep_last=0)


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = {"embed.weight": torch.randn(7, 4, generator=g), "norm.weight": torch.randn(5, generator=g),
             "lambda_q1": torch.randn(1, generator=g)}  # fmt: skip
    optim = {f"{name}/exp_avg": torch.randn(t.shape, generator=g) for name, t in model.items()}
    return model, optim


@pytest.mark.parametrize("world", [1, 2, 3])
def test_pieces_written_by_any_process_count_read_back_whole_and_in_any_split(tmp_path, world):
    model, optim = _tensors()
    checkpoint = _sharded_checkpoint(tmp_path / "run", model, optim, world)
    assert is_sharded(checkpoint) and len(piece_files(checkpoint, "model")) == world
    loaded, optim_sd, meta = load_checkpoint(checkpoint)
    for name, tensor in model.items():
        assert torch.equal(loaded[name], tensor), name
        assert torch.equal(optim_sd["state"][name]["exp_avg"], optim[f"{name}/exp_avg"])
    reader = PieceReader(piece_files(checkpoint, "model"))
    for new_world in (1, 2, 4):  # every process of another count reads exactly its rows
        for piece, _, offset in _split(model["embed.weight"], new_world):
            assert torch.equal(reader.read("embed.weight", offset, tuple(piece.shape)), piece)


def test_a_single_files_tensors_are_whole_pieces(tmp_path):
    from safetensors.torch import save_file

    full = torch.arange(10.0).reshape(5, 2)
    save_file({"w": full}, tmp_path / "model.safetensors")
    reader = PieceReader([tmp_path / "model.safetensors"])
    assert reader.shape("w") == (5, 2) and torch.equal(reader.read("w", (3, 0), (2, 2)), full[3:])


def test_damaged_missing_or_foreign_pieces_are_refused(tmp_path):
    model, optim = _tensors()
    checkpoint = _sharded_checkpoint(tmp_path / "run", model, optim, 2)
    first = piece_files(checkpoint, "model")[0]
    backup = first.read_bytes()
    data = bytearray(backup)
    data[-3] ^= 0xFF  # a value's byte
    first.write_bytes(bytes(data))
    with pytest.raises(InputError, match="does not match its checksum"):
        load_model(checkpoint)
    first.unlink()
    with pytest.raises(InputError, match=r"the pieces of \S+ hold \d+ of its \d+ values: a process's file is missing"):
        load_model(checkpoint)
    other = _sharded_checkpoint(tmp_path / "other", *_tensors(seed=1), 2)
    shutil.copy(piece_files(other, "model")[0], first)  # another run's file under the right name
    with pytest.raises(InputError, match="is not the file .* was written with"):
        load_model(checkpoint)
    first.write_bytes(backup)
    torch.testing.assert_close(load_model(checkpoint)[0]["embed.weight"], model["embed.weight"], rtol=0, atol=0)


# --- whole runs under torchrun ----------------------------------------------------------------------------------

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], **kw) -> None:
    import os

    proc = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _train(prepared, out: Path, processes: int, *extra: str) -> None:
    args = train_args(prepared, max_steps=8, ckpt_interval=4, eval_interval=8)
    command = difftx("train", *args, "--out", str(out), *extra)
    _run(command if processes == 1 else [*TORCHRUN, *command[2:], "--parallel", "fsdp"])


def _resume(run: Path, processes: int) -> None:
    command = difftx("train", "--resume", str(run))
    _run(command + ["--parallel", "none"] if processes == 1 else [*TORCHRUN, *command[2:], "--parallel", "fsdp"])


def _from_step_4(run: Path, copy: Path) -> Path:
    """A copy of ``run`` as it stood at its step-4 checkpoint (as if killed before step 8)."""
    shutil.copytree(run, copy)
    shutil.rmtree(list_checkpoints(copy)[-1])
    rows = [r for r in (copy / "metrics.jsonl").read_text().splitlines() if json.loads(r)["step"] <= 4]
    (copy / "metrics.jsonl").write_text("".join(r + "\n" for r in rows))
    return copy


def _resaved(run: Path, processes: int) -> None:
    """Resume ``run`` with ``processes`` and write its step-4 checkpoint again at once: the state as loaded."""
    script = Path(__file__).with_name("resave_checkpoint.py")
    command = [sys.executable, str(script), str(run), "none" if processes == 1 else "fsdp"]
    _run(command if processes == 1 else [*TORCHRUN, *command[1:]])


def _state(checkpoint: Path) -> tuple[dict, dict]:
    model, optim, _ = load_checkpoint(checkpoint)
    return model, {(n, k): torch.as_tensor(v) for n, s in optim["state"].items() for k, v in s.items()}


def _bitwise(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    for x, y in zip(a, b, strict=True):
        assert sorted(x) == sorted(y)
        for name in x:
            assert torch.equal(x[name], y[name]), name


def _whole_rows(checkpoint: Path, name: str) -> torch.Tensor:
    """A tensor of a sharded checkpoint put together from its process files by hand (rows in rank order)."""
    parts = []
    for file in piece_files(checkpoint, "model"):
        with safe_open(file, "pt") as f:
            parts.append(f.get_tensor(name))
    return torch.cat(parts)


@pytest.mark.slow
def test_sharded_runs_resume_across_process_counts(prepared, tmp_path):
    """2 -> 2: bit for bit an uninterrupted run. 2 -> 1 and 1 -> 2: the loaded state is the saved one bit for bit
    (written again at once, in the other layout), and the run goes on to the uninterrupted one's weights within the
    float32 rounding that another count's reductions make."""
    _train(prepared, tmp_path / "two", 2)
    two = list_checkpoints(tmp_path / "two")
    assert [p.name for p in two] == ["step_00000004", "step_00000008"] and all(is_sharded(p) for p in two)
    assert len(piece_files(two[0], "model")) == len(piece_files(two[0], "optimizer")) == 2
    state = _state(two[0])
    assert torch.equal(state[0]["embed.weight"], _whole_rows(two[0], "embed.weight"))
    model, _ = load_run(tmp_path / "two")  # what sampling, eval and convert read: the pieces put together
    final = _state(two[-1])[0]
    assert all(torch.equal(t, final[name]) for name, t in model.state_dict().items())
    _run(difftx("convert", "--run", str(tmp_path / "two"), "--to", "hf", "--out", str(tmp_path / "hf")))

    again = _from_step_4(tmp_path / "two", tmp_path / "two-two")  # 2 -> 2
    _resume(again, 2)
    assert losses(again) == losses(tmp_path / "two")
    _bitwise(_state(list_checkpoints(again)[-1]), _state(two[-1]))

    one = _from_step_4(tmp_path / "two", tmp_path / "two-one")  # 2 -> 1
    _resaved(one, 1)
    assert not is_sharded(list_checkpoints(one)[-1])
    _bitwise(_state(list_checkpoints(one)[-1]), state)
    _resume(one, 1)
    _close(_state(list_checkpoints(one)[-1]), _state(two[-1]))

    _train(prepared, tmp_path / "one", 1)  # 1 -> 2
    single = list_checkpoints(tmp_path / "one")
    back = _from_step_4(tmp_path / "one", tmp_path / "one-two")
    _resaved(back, 2)
    assert is_sharded(list_checkpoints(back)[-1])
    _bitwise(_state(list_checkpoints(back)[-1]), _state(single[0]))
    _resume(back, 2)
    _close(_state(list_checkpoints(back)[-1]), _state(single[-1]))


def _close(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    """Within float32 rounding of sums taken in another order (one ulp of the values here, 1e-7 to 1e-6)."""
    for x, y in zip(a, b, strict=True):
        for name in x:
            torch.testing.assert_close(x[name], y[name], rtol=1e-5, atol=1e-6, msg=str(name))


def test_overlapping_pieces_are_refused_even_when_their_count_adds_up(tmp_path):
    """Two pieces that overlap and leave a gap of the same size would fill the count: the gap's values would be
    whatever memory held (a crafted or mixed set of files)."""
    from safetensors.torch import save_file

    from difftransformer.store.shards import piece_metadata

    full = torch.arange(8.0).reshape(4, 2)
    for rank, start in enumerate((0, 1)):  # rows 0-1 and 1-2: row 3 is missing, row 1 twice
        meta = {"chunks": piece_metadata({"w": ((4, 2), (start, 0))})}
        save_file(
            {"w": full[start : start + 2].contiguous()}, tmp_path / f"model-{rank:05d}-of-00002.safetensors", meta
        )
    with pytest.raises(InputError, match="two pieces of w overlap"):
        PieceReader(piece_files(tmp_path, "model"))
