"""`--log-to`: TensorBoard event files and W&B offline runs hold metrics.jsonl's scalars, and a resumed run is one
curve with one value per step. The event files are read back with TensorBoard's own reader; the W&B files with a
reader of their documented record format (LevelDB's log format: 32 KiB blocks of CRC, length, type, payload)."""

import json
import math
import re
import struct
import subprocess
import sys

import pytest
from conftest import difftx, metric_rows, optional, small_config, train_args

from difftransformer.errors import ConfigError
from difftransformer.training.config import resume_config
from difftransformer.training.loop import Trainer

pytestmark = pytest.mark.slow


def expected_scalars(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} from metrics.jsonl rows, written out here from the names the docs give."""
    out: dict[str, list[tuple[int, float]]] = {}

    def put(tag, step, value):
        out.setdefault(tag, []).append((step, value))

    for row in rows:
        step = row["step"]
        put("train/loss", step, row["loss"])
        put("train/lr", step, row["lr"])
        put("train/grad_norm", step, row["grad_norm"])
        put("train/tokens_per_s", step, row["tokens_per_s"])
        put("train/skipped", step, 1.0 if "skipped" in row else 0.0)
        if "val_loss" in row:
            put("val/loss", step, row["val_loss"])
            put("val/bpb", step, row["val_bpb"])
        for layer, value in enumerate(row.get("lambda") or ()):
            put(f"lambda/layer_{layer:02d}", step, value)
    return out


def same(actual: dict, expected: dict, rel: float) -> None:
    assert sorted(actual) == sorted(expected)
    for tag, points in expected.items():
        got = actual[tag]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        for (step, value), (_, want) in zip(got, points, strict=True):
            assert value == pytest.approx(want, rel=rel) or (math.isnan(value) and math.isnan(want)), (tag, step)


def interrupted_and_resumed(prepared, run, **overrides) -> None:
    """Train 6 steps of 12 (the checkpoint is at step 4: steps 5 and 6 are trained again), then resume to the end."""
    trainer = Trainer(small_config(prepared, run, **overrides), quiet=True)
    trainer.fit(until=6)
    trainer.close()
    trainer = Trainer(resume_config(run), resume=True, quiet=True)
    trainer.fit()
    trainer.close()


def tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    event_accumulator = optional("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_the_jsonl_scalars_and_a_resumed_run_is_one_curve(prepared, tmp_path):
    run = tmp_path / "run"
    interrupted_and_resumed(prepared, run, log_to="tensorboard")
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert len(list((run / "tensorboard").iterdir())) == 1  # one event file: the resume rebuilt it
    scalars = tensorboard_scalars(run / "tensorboard")
    assert "lambda/layer_01" in scalars and "val/bpb" in scalars
    same(scalars, expected_scalars(rows), rel=1e-6)  # event files hold float32


def test_tensorboard_added_at_resume_gets_the_run_from_its_first_step(prepared, tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(small_config(prepared, run), quiet=True)
    trainer.fit(until=6)
    trainer.close()
    assert not (run / "tensorboard").exists()
    trainer = Trainer(resume_config(run, log_to="jsonl,tensorboard"), resume=True, quiet=True)
    trainer.fit()
    trainer.close()
    same(tensorboard_scalars(run / "tensorboard"), expected_scalars(metric_rows(run)), rel=1e-6)


def wandb_records(path):
    """The payloads of a .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB log records."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            yield parts
            parts = b""


def wandb_history(path) -> dict[str, list[tuple[int, float]]]:
    pb = optional("wandb.proto.wandb_internal_pb2")
    out: dict[str, list[tuple[int, float]]] = {}
    for raw in wandb_records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                out.setdefault(key, []).append((record.history.step.num, float(json.loads(item.value_json))))
    return out


def test_wandb_offline_writes_one_run_whose_resume_starts_after_its_checkpoint(prepared, tmp_path, monkeypatch):
    optional("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    interrupted_and_resumed(prepared, run, log_to="jsonl,wandb")
    run_id = (run / "wandb" / "wandb_id").read_text().strip()
    # one W&B run, two invocations: W&B names each invocation's folder offline-run-<second>-<id>, with "-1" added when
    # the resume starts within the same second as the first invocation (wandb_init's set_sync_dir_suffix)
    folders = {m.group(1, 2): d for d in (run / "wandb").glob("offline-run-*")
               if (m := re.fullmatch(rf"offline-run-(\d{{8}}_\d{{6}})-{run_id}(?:-(\d+))?", d.name))}  # fmt: skip
    assert len(folders) == 2 == len(list((run / "wandb").glob("offline-run-*"))), sorted(folders)
    first, second = (folders[k] for k in sorted(folders, key=lambda k: (k[0], int(k[1] or 0))))
    rows = metric_rows(run)
    same(wandb_history(second / f"run-{run_id}.wandb"), expected_scalars(rows[4:]), rel=1e-12)
    stopped = wandb_history(first / f"run-{run_id}.wandb")
    assert [s for s, _ in stopped["train/loss"]] == list(range(1, 7))
    to_checkpoint = expected_scalars(rows[:4])  # the steps up to the checkpoint are the ones the run kept
    same({tag: [p for p in points if p[0] <= 4] for tag, points in stopped.items() if tag in to_checkpoint},
         to_checkpoint, rel=1e-12)  # fmt: skip


def test_log_to_names_what_it_accepts(prepared, tmp_path):
    with pytest.raises(ConfigError, match="log_to must be a comma-separated list of jsonl, tensorboard, wandb, got"):
        small_config(prepared, tmp_path / "run", log_to="jsonl,tensorbord")
    assert small_config(prepared, tmp_path / "run", log_to=["wandb", "tensorboard"]).log_to == "jsonl,tensorboard,wandb"


def test_a_missing_tracker_names_its_extra_and_leaves_nothing_behind(prepared, tmp_path):
    """tensorboard made unimportable in the child process: the start fails before the run directory is made."""
    run = tmp_path / "run"
    code = (
        "import sys; sys.modules['tensorboard'] = None\n"
        "from difftransformer.apps.cli import main\n"
        f"sys.exit(main({['train', *train_args(prepared, out=run, max_steps=2, log_to='tensorboard')]!r}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert (
        "this needs tensorboard, an optional dependency: in this checkout, `make test` installs every extra into .venv"
        " (or, for this one alone: .venv/bin/pip install -e '.[track]' -c requirements-dev.txt)" in proc.stderr
    )
    assert not run.exists()


def test_the_cli_flag_writes_event_files(prepared, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run(
        difftx("train", *train_args(prepared, out=run, max_steps=3, log_to="jsonl,tensorboard")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "train_config.json").read_text())["log_to"] == "jsonl,tensorboard"
    same(tensorboard_scalars(run / "tensorboard"), expected_scalars(metric_rows(run)), rel=1e-6)
