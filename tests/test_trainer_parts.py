"""The parts the Trainer is made of, each alone (no Trainer, no data): the run directory's lifecycle, the metrics
log, the health guard, the checkpoint policy, the read of the steps and the stop signals. The Trainer that composes
them is tested end to end in tests/test_train.py, tests/test_runs.py and the others."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch

from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.errors import ConfigError, InputError, TrainingDiverged
from difftransformer.store.checkpoint import list_checkpoints
from difftransformer.store.runs import METRICS, MODEL_CONFIG, TRAIN_CONFIG, RunLock
from difftransformer.store.tokenizer import ByteTokenizer
from difftransformer.training.checkpointing import Checkpoints, lower_lr, rng_state
from difftransformer.training.config import TrainConfig
from difftransformer.training.distributed import World
from difftransformer.training.health import SPIKE_FACTOR, HealthGuard, check_health
from difftransformer.training.interrupts import StopSignals
from difftransformer.training.metrics import MetricsLog, step_of
from difftransformer.training.run_dir import RunDirectory
from difftransformer.training.step import StepResult, read_steps

MAIN, OTHER = World(), World(rank=1, size=2)
CONFIG = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)


def row(step: int, loss: float = 2.0, **extra) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens": 8 * step, "tokens_per_s": 1.0, **extra}


# the run directory ---------------------------------------------------------------------------------------------
def test_a_new_run_is_created_locked_and_released(tmp_path):
    run = RunDirectory(tmp_path / "run", MAIN)
    run.check_new()
    run.create({"lr": 0.001}, CONFIG, ByteTokenizer())
    assert json.loads((tmp_path / "run" / TRAIN_CONFIG).read_text()) == {"lr": 0.001}
    assert ModelConfig.from_json(tmp_path / "run" / MODEL_CONFIG) == CONFIG
    assert (tmp_path / "run" / METRICS).read_text() == ""
    with pytest.raises(InputError, match="being written by another process"):
        RunLock(tmp_path / "run")
    run.release()
    RunLock(tmp_path / "run").release()  # free again


def test_a_directory_holding_a_run_or_anything_is_refused_for_a_new_run(tmp_path):
    run = RunDirectory(tmp_path / "run", MAIN)
    run.create({}, CONFIG, ByteTokenizer())
    run.release()
    with pytest.raises(FileExistsError, match="stopped before its first checkpoint; resume it"):
        RunDirectory(tmp_path / "run", MAIN).check_new()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        RunDirectory(tmp_path / "other", MAIN).check_new()


def test_only_a_directory_this_process_created_is_removed(tmp_path):
    made = RunDirectory(tmp_path / "made", MAIN)
    made.create({}, CONFIG, ByteTokenizer())
    assert made.remove_created() and not (tmp_path / "made").exists()
    (tmp_path / "given").mkdir()  # an empty directory the user made: used, never removed
    given = RunDirectory(tmp_path / "given", MAIN)
    given.create({}, CONFIG, ByteTokenizer())
    given.release()
    assert not given.remove_created() and (tmp_path / "given" / TRAIN_CONFIG).is_file()


def test_only_the_main_process_writes_the_run_directory(tmp_path):
    RunDirectory(tmp_path / "run", OTHER).create({}, CONFIG, ByteTokenizer())
    assert not (tmp_path / "run").exists()


def test_a_resumed_run_without_its_data_names_the_field(tmp_path):
    (tmp_path / "run").mkdir()
    run = RunDirectory(tmp_path / "run", MAIN)
    with pytest.raises(ConfigError, match="data.*is not there \\(moved or deleted\\?\\)"):
        run.open_existing(tmp_path / "gone")
    run.release()


# the metrics log -----------------------------------------------------------------------------------------------
def test_metrics_are_cut_back_to_the_checkpoint_and_torn_lines_are_noted(tmp_path):
    log = MetricsLog(tmp_path, main=True)
    for step in (1, 2, 3):
        log.write(row(step))
    with open(tmp_path / METRICS, "a") as f:
        f.write('{"step": 4, "lo')  # a row cut by a kill
    notes = []
    log.keep_to(2, notes.append)
    assert [r["step"] for r in log.rows()] == [1, 2]
    assert len(notes) == 1 and "line 4" in notes[0] and "dropped" in notes[0]
    log.restart()
    assert log.rows() == [] and (tmp_path / METRICS).read_text() == ""


def test_metrics_of_other_processes_are_not_written(tmp_path):
    log = MetricsLog(tmp_path, main=False)
    log.write(row(1))
    log.keep_to(0, print)
    assert not (tmp_path / METRICS).exists()


def test_step_of_reads_only_metrics_rows():
    assert step_of(json.dumps(row(7))) == 7
    assert [step_of(text) for text in ('{"step": "7"}', "[1]", '{"ste', "")] == [None] * 4


# the health guard ----------------------------------------------------------------------------------------------
def guard(limit: int = 3, calm=None) -> tuple[HealthGuard, list[str]]:
    notes: list[str] = []
    return HealthGuard(limit, notes.append, lambda: calm), notes


def test_skipped_steps_in_a_row_stop_the_run_at_the_limit():
    watch, notes = guard(limit=2)
    skipped = dict(loss=math.nan, skipped="non-finite loss")
    assert watch.observe(row(1, **skipped)) is None and watch.nonfinite_in_a_row == 1
    assert watch.observe(row(2)) is None and watch.nonfinite_in_a_row == 0 and watch.updated
    assert watch.observe(row(3, **skipped)) is None
    assert watch.observe(row(4, **skipped)) == "2 steps in a row (to step 4) had a non-finite loss or gradient"
    assert len(notes) == 3 and "(2 in a row; the run stops at 2)" in notes[-1]


def test_only_skipped_steps_leave_the_weights_unchanged():
    watch, _ = guard()
    watch.observe(row(1, loss=math.nan, skipped="non-finite loss"))
    assert not watch.updated


def test_a_spike_is_marked_once_and_names_the_calm_checkpoint(tmp_path):
    watch, notes = guard(calm=tmp_path / "step_4")
    rows = [row(step, loss) for step, loss in enumerate((2.0, 2.0, 9.0, 9.0, 9.0), 1)]
    for r in rows:
        watch.observe(r)
    assert ["spike" in r for r in rows] == [False, False, True, False, False]
    assert len(notes) == 1 and f"from {tmp_path / 'step_4'}, the newest checkpoint from before it" in notes[0]


def test_the_guard_state_goes_through_a_checkpoint():
    watch, _ = guard()
    for step, loss in enumerate((3.0, 2.0, 2.5), 1):
        watch.observe(row(step, loss))
    watch.probe_best = 1.5
    again, _ = guard()
    again.restore(json.loads(json.dumps(watch.state())), probe=1.7)
    assert again.state() == watch.state()
    again.restore({}, probe=1.7)  # a checkpoint from before the guard's fields
    assert again.probe_best == 1.7 and again.nonfinite_in_a_row == 0 and again.watch.smoothed is None


def test_a_checkpoint_over_the_spike_factor_is_not_calm():
    watch, notes = guard()
    watch.probe_best = 2.0
    assert watch.calm_at(10, 2.0 * SPIKE_FACTOR) and not notes
    assert not watch.calm_at(11, 2.0 * SPIKE_FACTOR + 0.01)
    assert "step 11: this checkpoint is written during a loss spike" in notes[0]
    assert watch.probe_best == 2.0
    watch.calm_at(12, 1.0)
    assert watch.probe_best == 1.0


def test_unhealthy_first_weights_are_a_defect_or_a_bad_start(tmp_path):
    watch, _ = guard()
    with pytest.raises(RuntimeError, match="the initial weights are not healthy: the weights are not finite"):
        watch.begin([0.0, 1.0, 1.0], math.nan, None)
    with pytest.raises(InputError, match="step_3 \\(init_from\\) is not healthy: the weights give a non-finite loss"):
        watch.begin([1.0, 1.0, 0.0], math.nan, tmp_path / "step_3")
    watch.begin([1.0, 1.0, 1.0], 4.2, None)
    assert watch.probe_best == 4.2


def test_health_finds_non_finite_weights_and_loss():
    torch.manual_seed(0)
    model = TransformerLM(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters())
    probe = torch.randint(0, 256, (2, 9))
    flags, loss = check_health(model, optimizer, probe, MAIN)
    assert flags == [1.0, 1.0, 1.0] and math.isfinite(loss)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = math.inf
    flags, loss = check_health(model, optimizer, probe, MAIN)
    assert flags[0] == 0.0 and flags[1] == 1.0


# the checkpoint policy -----------------------------------------------------------------------------------------
def trained(seed: int) -> tuple[TransformerLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TransformerLM(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (2, 8))).float().mean().backward()
    optimizer.step()
    return model, optimizer


def test_a_checkpoint_written_is_read_back_into_another_model(tmp_path):
    (tmp_path / "run").mkdir()
    CONFIG.to_json(tmp_path / "run" / MODEL_CONFIG)
    policy = Checkpoints(tmp_path / "run", MAIN, keep_last=2, keep_best=False)
    model, optimizer = trained(0)
    generator = torch.get_rng_state()
    meta = {"rng_torch": generator.tolist(), "train_config": {"lr": 0.001}}
    path = policy.write(model, optimizer, 5, meta)
    assert path == list_checkpoints(tmp_path / "run")[-1] and path.name.endswith("5")
    other, other_optimizer = trained(1)
    read = policy.load(path, other, other_optimizer, CONFIG, ByteTokenizer(), {"lr": 0.001})
    assert read["step"] == 5
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(rng_state(read, path), generator)
    with pytest.raises(InputError, match="recipe"):  # another run's recipe in train_config.json
        policy.load(path, other, other_optimizer, CONFIG, ByteTokenizer(), {"lr": 0.002})


def test_a_damaged_generator_state_is_named(tmp_path):
    with pytest.raises(InputError, match="state.json is damaged: rng_torch"):
        rng_state({"rng_torch": [0, 300]}, tmp_path / "step_1")


def test_what_a_diverged_run_is_told(tmp_path):
    policy = Checkpoints(tmp_path / "run", MAIN, keep_last=2, keep_best=False)
    err = policy.diverged("it broke", 7, lr=0.003, init_from=None, removed=True)
    assert isinstance(err, TrainingDiverged) and err.lr == lower_lr(0.003) == 0.0003 and err.init_from is None
    assert f"it had written no checkpoint, so {tmp_path / 'run'} was removed" in str(err)
    assert "stopped at step 7" in str(err) and "start again with a lower `lr` (e.g. 0.0003)" in str(err)
    err = policy.diverged("it broke", 7, lr=0.003, init_from=str(tmp_path / "start"), removed=False)
    assert err.init_from == tmp_path / "start" and "start a new run from" in str(err)
    assert lower_lr(0.0123456) == 0.00123


# reading the steps ---------------------------------------------------------------------------------------------
def test_the_steps_are_read_with_their_speed_and_the_stop_flag():
    steps = [
        (3, StepResult(torch.tensor(2.5), torch.tensor(1.0), torch.tensor(False), 0.01), 10.0),
        (4, StepResult(torch.tensor(math.nan), torch.tensor(1.0), torch.tensor(True), 0.01), 11.0),
    ]
    rows, signum = read_steps(steps, torch.tensor([15.0]), None, tokens_per_step=100, start=8.0, start_step=2)
    assert signum == 15
    assert rows[0] == {"loss": 2.5, "lr": 0.01, "grad_norm": 1.0, "step": 3, "tokens": 300, "tokens_per_s": 50.0}
    assert rows[1]["skipped"] == "non-finite loss" and "lambda" not in rows[1]
    model = TransformerLM(CONFIG)
    rows, _ = read_steps(steps[:1], torch.tensor([0.0]), model, tokens_per_step=100, start=8.0, start_step=2)
    assert len(rows[0]["lambda"]) == CONFIG.n_layers


# the stop signals ----------------------------------------------------------------------------------------------
def test_the_first_signal_is_recorded_the_second_stops_and_handlers_come_back():
    before = signal.getsignal(signal.SIGINT)
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_train_config_records_absolute_paths_and_warns_past_four_passes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(data="data", out="run", max_steps=100, batch_size=4, seq_len=8)
    assert cfg.recipe()["data"] == str(tmp_path / "data") and "out" not in cfg.recipe()
    assert cfg.passes_note(800) is None  # 3200 tokens read: four passes
    assert "7.1 times over" in cfg.passes_note(450) and "set keep_best" in cfg.passes_note(450)
