"""Training that does not silently overfit: the note when a run passes over its training tokens more than
OVERFIT_PASSES times, --keep-best (the checkpoint with the lowest validation loss survives keep-last, across a
resume, and the end summary names it), and the note when validation loss has risen without it."""

import json
import re

import pytest

from tests.conftest import metric_rows, train_args

pytestmark = pytest.mark.slow


@pytest.fixture
def shifted(tmp_path):
    """Data whose validation text (x, y, z) shares no character with its training text (a, b): training lowers the
    probability of every validation byte, so the validation loss rises from the first steps on, as an overfitting
    run's does, and the lowest one is at the first validation."""
    from difftransformer.store.data import prepare
    from difftransformer.store.tokenizer import ByteTokenizer

    docs = ["ab ba ab " * 8 if i % 2 == 0 else "xyz zyx " * 8 for i in range(10)]  # odd documents: validation
    out = tmp_path / "shifted"
    prepare(docs, ByteTokenizer(), out, val_every=2, split="documents")
    return out


def _write_checkpoint(root, step: int, **state) -> None:
    path = root / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"step": step, "health": {"calm": True}, **state}))


@pytest.mark.parametrize(
    ("val_losses", "keep_best", "kept"),
    [
        ({2: 1.0, 4: 0.5, 6: 0.7, 8: 0.9}, True, [4, 8]),  # the lowest is old: kept besides the newest
        ({2: 1.0, 4: 0.5, 6: 0.7, 8: 0.9}, False, [8]),
        ({2: 1.0, 4: 0.9, 6: 0.7, 8: 0.5}, True, [8]),  # the lowest is the newest: nothing more
        ({2: 0.5, 4: 0.5, 6: 0.7, 8: 0.9}, True, [2, 8]),  # equal ones: the earliest
        ({2: None, 4: None, 6: None, 8: None}, True, [8]),  # none validated when written
        ({2: float("nan"), 4: 0.9, 6: None, 8: 1.0}, True, [4, 8]),  # a NaN loss is never the lowest
    ],
)
def test_pruning_keeps_the_checkpoint_with_the_lowest_validation_loss(tmp_path, val_losses, keep_best, kept):
    from difftransformer.store.checkpoint import _stale, list_checkpoints

    for step, loss in val_losses.items():
        _write_checkpoint(tmp_path, step, **({} if loss is None else {"val_loss": loss}))
    stale = _stale(list_checkpoints(tmp_path), keep_last=1, keep_best=keep_best)
    assert sorted(int(p.name[5:]) for p in set(list_checkpoints(tmp_path)) - set(stale)) == kept


def _kept_steps(run) -> list[int]:
    return sorted(int(p.name[len("step_") :]) for p in (run / "checkpoints").iterdir())


def test_keep_best_keeps_the_lowest_validation_loss_across_a_resume_and_names_it(shifted, tmp_path, capsys):
    """A whole sequence: train with --keep-best and keep-last 1, resume further; at each end the kept checkpoints
    are the newest and the one whose step has the lowest validation loss in metrics.jsonl, each checkpoint records
    the validation loss metrics.jsonl has for its step, and the summary names the kept one and samples from it."""
    from difftransformer.apps.cli import main

    run = tmp_path / "run"
    flags = dict(max_steps=6, ckpt_interval=2, keep_last=1, eval_interval=100, warmup_steps=1, lr=0.01)
    assert main(["train", *train_args(shifted, out=run, **flags), "--keep-best"]) == 0
    assert main(["train", "--resume", str(run), "--max-steps", "10", "--quiet"]) == 0
    out, _ = capsys.readouterr()
    validated = {r["step"]: r["val_loss"] for r in metric_rows(run) if "val_loss" in r}
    assert sorted(validated) == [2, 4, 6, 8, 10]  # every checkpoint step, though eval_interval is 100
    best = min(validated, key=validated.get)
    assert best < 10, "the shifted data's validation loss did not rise: the test no longer tests keeping"
    assert _kept_steps(run) == [best, 10]
    for step in _kept_steps(run):
        state = json.loads((run / "checkpoints" / f"step_{step:08d}" / "state.json").read_text())
        assert state["val_loss"] == validated[step]
    kept = run / "checkpoints" / f"step_{best:08d}"
    summaries = [line for line in out.splitlines() if "kept by --keep-best" in line]
    assert len(summaries) == 2 and summaries[-1] == (
        f"difftx train: lowest validation loss {validated[best]:.4f} at {kept.name}, kept by --keep-best: {kept}"
    )
    assert out.splitlines()[-1].startswith(f"next: difftx generate --run {kept} --prompt")


def test_a_run_that_passes_over_its_data_many_times_is_told_and_its_rising_loss_noted(shifted, tmp_path, capsys):
    """Without --keep-best: the note at the start gives the passes (steps x batch x window over the training
    tokens the manifest counts), and the end notes that validation loss has risen from its lowest."""
    from difftransformer.apps.cli import main

    manifest = json.loads((shifted / "manifest.json").read_text())
    have = sum(shard["tokens"] for shard in manifest["splits"]["train"]["shards"])
    run = tmp_path / "run"
    flags = dict(max_steps=16, eval_interval=4, ckpt_interval=16, warmup_steps=1, lr=0.01)
    assert main(["train", *train_args(shifted, out=run, **flags)]) == 0
    out, err = capsys.readouterr()
    passes = 16 * 4 * 32 / have
    assert passes > 4
    assert (
        f"note: this run reads its {have:,} training tokens {passes:.1f} times over (16 steps of 4 x 32 tokens): after "
        "about 4 passes a model starts to memorise its training text" in err
    )
    assert "difftx train --keep-best" in err
    validated = [(r["val_loss"], r["step"]) for r in metric_rows(run) if "val_loss" in r]
    lowest, at = min(validated)
    assert at < 16 and re.search(
        rf"note: the validation loss was lowest at step {at} \({lowest:.4f}\) and is {validated[-1][0]:.4f} now", err
    )
    assert "kept by --keep-best" not in out and _kept_steps(run) == [16]


def test_a_run_within_a_few_passes_is_not_told(prepared, tmp_path, capsys):
    from difftransformer.apps.cli import main

    flags = dict(max_steps=2, eval_interval=2, warmup_steps=1)
    assert main(["train", *train_args(prepared, out=tmp_path / "run", **flags)]) == 0
    assert "memorise" not in capsys.readouterr().err
