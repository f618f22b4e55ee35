"""Run directories: copies and moves resume where they are, flags given with --resume apply or are refused,
finished and failed runs say what happened, one trainer per run, killed writes are tidied up."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import losses, small_config, snapshot

from difftransformer.apps.cli import main
from difftransformer.errors import InputError
from difftransformer.store.checkpoint import list_checkpoints, load_checkpoint
from difftransformer.store.data import verify_data
from difftransformer.training.loop import Trainer, resume_config, train


@pytest.fixture
def full(prepared, tmp_path):
    """An uninterrupted 12-step run to compare resumed runs with."""
    train(small_config(prepared, tmp_path / "full"), quiet=True)
    return losses(tmp_path / "full")


def half_run(prepared, out: Path) -> Path:
    """A run stopped after its step-8 checkpoint (of 12)."""
    trainer = Trainer(small_config(prepared, out), quiet=True)
    trainer.fit(until=8)
    trainer.close()
    return out


@pytest.mark.slow
def test_copied_run_resumes_into_the_copy(prepared, tmp_path, full, capsys):
    original = half_run(prepared, tmp_path / "a")
    before = snapshot(original)
    shutil.copytree(original, tmp_path / "b")
    assert main(["train", "--resume", str(tmp_path / "b"), "--quiet"]) == 0
    assert f"done: {tmp_path / 'b'} at step 12;" in capsys.readouterr().out
    assert snapshot(original) == before  # the original is untouched: no checkpoint written or pruned there
    assert [p.name for p in list_checkpoints(tmp_path / "b")][-1] == "step_00000012"
    assert losses(tmp_path / "b") == full


@pytest.mark.slow
def test_moved_run_resumes_from_another_working_directory(prepared, tmp_path, full, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(prepared, tmp_path / "data-here")
    cfg = small_config("data-here", "runs/x")  # relative paths, as on a command line
    trainer = Trainer(cfg, quiet=True)
    trainer.fit(until=8)
    trainer.close()
    saved = json.loads((tmp_path / "runs" / "x" / "train_config.json").read_text())
    assert saved["data"] == str(tmp_path / "data-here") and "out" not in saved  # absolute; the run names no place
    (tmp_path / "elsewhere").mkdir()
    shutil.move(tmp_path / "runs" / "x", tmp_path / "elsewhere" / "y")
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["train", "--resume", "y", "--quiet"]) == 0
    assert losses(tmp_path / "elsewhere" / "y") == full


@pytest.mark.slow
def test_moved_data_is_named_and_found_again_with_data(prepared, tmp_path, full, capsys):
    data = tmp_path / "data-copy"
    shutil.copytree(prepared, data)
    run = half_run(data, tmp_path / "run")
    before = snapshot(run)
    data.rename(tmp_path / "moved")
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"--data {data} of the run {run} is not there (moved or deleted?); give its new location with --data" in err
    assert snapshot(run) == before
    assert main(["train", "--resume", str(run), "--data", str(tmp_path / "moved"), "--quiet"]) == 0
    assert json.loads((run / "train_config.json").read_text())["data"] == str(tmp_path / "moved")
    assert losses(run) == full  # the same data, in a new place: nothing changed


@pytest.mark.slow
def test_resume_flags_apply_or_are_refused(prepared, tmp_path, capsys):
    run = half_run(prepared, tmp_path / "run")
    before = snapshot(run)
    for flags, message in (
        (["--lr", "0.01"], "--lr cannot change when resuming (the run has 0.0015)"),
        (["--batch-size", "8"], "--batch-size cannot change when resuming (the run has 4)"),
        (["--seed", "3"], "--seed cannot change when resuming"),
        (["--preset", "small"], "--preset cannot change when resuming"),
        (["--out", str(tmp_path / "else")], "--out cannot be given when resuming"),
    ):
        assert main(["train", "--resume", str(run), *flags]) == 2
        assert message in capsys.readouterr().err
        assert snapshot(run) == before
    # repeating the saved value is not a change; --max-steps and the intervals may change
    assert main(["train", "--resume", str(run), "--lr", "0.0015", "--max-steps", "16", "--log-interval", "2"]) == 0
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 16 and [r["step"] for r in rows if r["step"] > 8] == [10, 12, 14, 16]
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["max_steps"] == 16 and saved["log_interval"] == 2  # the run's config says how it now trains
    assert load_checkpoint(list_checkpoints(run)[-1])[2]["train_config"]["max_steps"] == 16


def test_resuming_a_finished_run_says_so_and_changes_nothing(prepared, tmp_path, capsys):
    train(small_config(prepared, tmp_path / "run"), quiet=True)
    before = snapshot(tmp_path / "run")
    assert main(["train", "--resume", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out.strip()
    assert out == (
        f"difftx train: {tmp_path / 'run'} is complete (step 12 of 12); nothing to do. To train further, resume with "
        "--max-steps larger than 12"
    )
    assert snapshot(tmp_path / "run") == before


def test_a_failed_start_leaves_nothing_behind(prepared, tmp_path, monkeypatch):
    def crash(self):
        raise RuntimeError("boom at the first step")

    monkeypatch.setattr(Trainer, "train_step", crash)
    with pytest.raises(RuntimeError, match="boom"):
        train(small_config(prepared, tmp_path / "run"), quiet=True)
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    train(small_config(prepared, tmp_path / "run"), quiet=True)  # the same command works now
    assert list_checkpoints(tmp_path / "run")[-1].name == "step_00000012"


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_resumes_from_step_0(prepared, tmp_path, full, capsys):
    Trainer(small_config(prepared, tmp_path / "run"), quiet=True).close()  # what SIGKILL at step 1 leaves
    assert not list_checkpoints(tmp_path / "run")
    assert main(["train", "--data", str(prepared), "--out", str(tmp_path / "run")]) == 2
    assert "stopped before its first checkpoint; resume it" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "run"), "--quiet"]) == 0
    assert "has no checkpoint yet: the run starts again from step 0" in capsys.readouterr().err
    assert losses(tmp_path / "run") == full


@pytest.mark.slow
def test_killed_writes_are_tidied_and_an_interrupted_swap_is_undone(prepared, tmp_path, full, capsys):
    run = half_run(prepared, tmp_path / "run")
    ckpts = run / "checkpoints"
    (ckpts / ".tmp-step_00000012-99999").mkdir()  # a write killed before its rename
    (ckpts / ".tmp-step_00000012-99999" / "model.safetensors").write_bytes(b"half")
    (ckpts / "step_00000008").rename(ckpts / ".old-step_00000008-99999")  # killed between the swap's renames
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "removed" in err and ".tmp-step_00000012-99999" in err
    assert f"restored {ckpts / 'step_00000008'} from .old-step_00000008-99999" in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004", "step_00000008", "step_00000012"]
    assert losses(run) == full


def test_one_trainer_per_run(prepared, tmp_path):
    run = half_run(prepared, tmp_path / "run")
    first = Trainer(resume_config(run), resume=True, quiet=True)
    with pytest.raises(InputError, match=f"run {run} is being written by another process"):
        Trainer(resume_config(run), resume=True, quiet=True)
    first.close()
    second = Trainer(resume_config(run), resume=True, quiet=True)
    second.close()


def test_damaged_shard_is_caught_at_start(prepared, tmp_path, capsys):
    assert verify_data(prepared) == 2  # hashed both shards, then remembered them
    assert verify_data(prepared) == 0
    shard = prepared / "train_000.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    assert main(["train", "--data", str(prepared), "--out", str(tmp_path / "run"), "--max-steps", "2"]) == 2
    assert f"shard {shard} does not match its checksum" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_data_prepared_again_in_place_is_noted(prepared, tmp_path, capsys):
    from conftest import write_corpus

    from difftransformer.store.corpus import find_files, iter_documents
    from difftransformer.store.data import prepare
    from difftransformer.store.tokenizer import ByteTokenizer

    data = tmp_path / "data-here"
    shutil.copytree(prepared, data)
    run = half_run(data, tmp_path / "run")
    shutil.rmtree(data)
    other = write_corpus(tmp_path / "other-corpus", seed=1)
    prepare(iter_documents(find_files([other])), ByteTokenizer(), data, val_every=10)
    assert main(["train", "--resume", str(run), "--quiet"]) == 0
    assert f"the data in {data} differs from the data step 8 was trained on" in capsys.readouterr().err


def test_a_run_started_from_another_takes_its_model_and_says_so(prepared, tmp_path):
    """init_from gives the model (config and weights): model overrides and another attention were ignored without a
    word while train_config.json recorded them; now they are refused, and the record says what the run is."""
    from difftransformer.errors import ConfigError

    train(small_config(prepared, tmp_path / "start", max_steps=4, attention="standard"), quiet=True)
    base = dict(init_from=str(tmp_path / "start"), max_steps=2)
    with pytest.raises(ConfigError, match=r"TrainConfig.model cannot be given with init_from .*'standard' model"):
        Trainer(small_config(prepared, tmp_path / "a", **base), quiet=True)  # small_config sets model
    with pytest.raises(ConfigError, match=r"TrainConfig.attention is 'diff', but init_from .* is a 'standard' model"):
        Trainer(small_config(prepared, tmp_path / "b", model={}, **base), quiet=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    train(small_config(prepared, tmp_path / "c", model={}, attention="standard", **base), quiet=True)
    saved = json.loads((tmp_path / "c" / "train_config.json").read_text())
    assert saved["preset"] is None and saved["attention"] == "standard" and saved["model"] == {}
    assert saved["init_from"] == str(tmp_path / "start")
    assert main(["train", "--resume", str(tmp_path / "c"), "--max-steps", "4", "--quiet"]) == 0
