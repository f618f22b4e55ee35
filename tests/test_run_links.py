"""A run directory cannot make a command write or delete anything outside it (issue #47, part 1): each of its entries
in turn is a symbolic link to a file or folder outside (a run copied from someone else), and train --resume,
generate, eval, convert and quantize run on it; nothing outside changes (hashes before and after), and training
refuses the link with a message that names it."""

import json
import os
import shutil

import pytest
from conftest import small_config, snapshot

from difftransformer.apps.cli import main
from difftransformer.errors import InputError
from difftransformer.store.checkpoint import list_checkpoints
from difftransformer.store.runs import RunLock
from difftransformer.training.loop import train

ENTRIES = [
    ".lock",
    "metrics.jsonl",
    "train_config.json",
    "model_config.json",
    "tokenizer_spec.json",
    "checkpoints",
    "checkpoints/step_00000004",
]


def _run(prepared, tmp_path):
    run = tmp_path / "run"
    train(small_config(prepared, run, max_steps=4, ckpt_interval=2, keep_last=0), quiet=True)
    return run


def _link_out(run, entry, outside):
    """Move ``entry`` of the run outside and leave a link to it in its place (the lock: a stand-in for a shell's
    start-up file, which the old lock truncated)."""
    path = run / entry
    target = outside / entry.replace("/", "_")
    if entry == ".lock":
        target.write_text("export PATH=$HOME/bin:$PATH\n")
        path.unlink(missing_ok=True)
    else:
        shutil.move(path, target)
    os.symlink(target, path)


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_linked_entry_never_makes_a_command_write_outside(prepared, tmp_path, capsys, entry):
    run = _run(prepared, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    _link_out(run, entry, outside)
    before = snapshot(outside)
    jsonl = tmp_path / "texts.jsonl"
    jsonl.write_text(json.dumps({"text": "attention noise cancels " * 8}) + "\n")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--max-steps", "6"]) == 2
    err = capsys.readouterr().err
    assert f"{run / entry} is a symbolic link (to {outside}" in err and "never follows a link" in err, err
    for command in (
        ["generate", "--run", str(run), "--prompt", "the", "--max-new-tokens", "3", "--device", "cpu"],
        ["eval", "--run", str(run), "--jsonl", str(jsonl)],
        ["convert", "--run", str(run), "--to", "hf", "--out", str(tmp_path / "hf")],
        ["quantize", "--run", str(run), "--scheme", "w8a16", "--out", str(tmp_path / "q")],
    ):
        assert main(command) in (0, 2), command  # reading through a link is allowed; a traceback is not
        shutil.rmtree(tmp_path / "hf", ignore_errors=True)
        shutil.rmtree(tmp_path / "q", ignore_errors=True)
    assert snapshot(outside) == before


def test_a_linked_lock_is_refused_and_its_target_kept(tmp_path):
    """The lock is opened without following a link (a new run into a folder holding only a lock takes this path)."""
    (tmp_path / "run").mkdir()
    profile = tmp_path / "profile"
    profile.write_text("export PATH=$HOME/bin:$PATH\n")
    os.symlink(profile, tmp_path / "run" / ".lock")
    with pytest.raises(InputError, match=r"\.lock is a symbolic link \(to .*profile\)"):
        RunLock(tmp_path / "run")
    assert profile.read_text() == "export PATH=$HOME/bin:$PATH\n"


def test_only_the_trainers_names_are_checkpoints(prepared, tmp_path):
    """keep-last and "the newest checkpoint" see only step_<digits>: a user's backup copy is never deleted and a
    damaged checkpoint renamed aside is not taken as the newest (issue #47, part 5)."""
    run = tmp_path / "run"
    cfg = small_config(prepared, run, max_steps=4, ckpt_interval=2, keep_last=2)
    train(cfg, quiet=True)
    backup = run / "checkpoints" / "step_00000002.keep"
    shutil.copytree(run / "checkpoints" / "step_00000002", backup)
    (run / "checkpoints" / "step_00000099.bad").mkdir()
    assert [p.name for p in list_checkpoints(run)] == ["step_00000002", "step_00000004"]
    assert main(["train", "--resume", str(run), "--max-steps", "8", "--keep-last", "1", "--quiet"]) == 0
    assert [p.name for p in list_checkpoints(run)] == ["step_00000008"] and backup.is_dir()
