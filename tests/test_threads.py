"""CPU threads (#48 part 1, #56): importing difftransformer, and so the command line, makes OpenMP's idle threads
wait passively (a spinning thread starved the working one when another program kept a core busy), every command
that computes takes --threads, the summary lines say what was used, and `difftx bench load` reads its verdict from
its rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from difftransformer.apps.cli import build_parser, main
from difftransformer.apps.cli.parsing import leaf_commands
from difftransformer.threads import describe

COMMANDS = dict(leaf_commands(build_parser()))
# the commands that compute nothing with torch (files, tokenizers, a table), and the study runner, whose --workers
# sets one thread per model it trains
NO_TORCH_WORK = {("data", "prepare"), ("data", "fetch"), ("data", "verify"), ("tokenizer", "train"), ("presets",),
                 ("repro",)}  # fmt: skip


def _openmp_spin(env: dict) -> str:
    """GNU OpenMP's spin count as the runtime itself reports it when `difftx presets` starts (OMP_DISPLAY_ENV):
    '0' when its idle threads wait passively."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    done = subprocess.run([sys.executable, "-m", "difftransformer", "presets"], env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    spin = [line for line in done.stderr.splitlines() if line.strip().startswith("GOMP_SPINCOUNT = ")]
    assert spin, f"OpenMP displayed no spin count:\n{done.stderr}"
    return spin[0].split("=", 1)[1].strip().strip("'")


@pytest.mark.slow  # a process or more of its own (the fast tier, make test-quick, stays within a minute)
def test_the_command_line_makes_openmp_wait_passively_unless_the_environment_chose():
    assert _openmp_spin({}) == "0"
    assert _openmp_spin({"OMP_WAIT_POLICY": "ACTIVE"}) != "0"  # the user's choice is kept
    assert _openmp_spin({"GOMP_SPINCOUNT": "1000"}) == "1000"


def _library(code: str, env: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
    return subprocess.run([sys.executable, "-c", code], env={**env, "OMP_DISPLAY_ENV": "VERBOSE"},
                          capture_output=True, text=True, check=True)  # fmt: skip


LIBRARY_FIRST = "import os, difftransformer, torch; torch.set_num_threads(2); print(os.environ.get('OMP_WAIT_POLICY'))"
TORCH_FIRST = "import os, torch; torch.set_num_threads(2); import difftransformer; import difftransformer.core"


@pytest.mark.slow
def test_importing_the_library_first_makes_openmp_wait_passively_as_the_command_line_does():
    """#56: the tutorial's train(cfg) took 51-58 s on a busy machine against 11 s with the passive wait only difftx
    set. Importing difftransformer before torch sets it, as OpenMP itself reports; the user's choice is kept."""
    done = _library(LIBRARY_FIRST, {})
    assert done.stdout.strip() == "PASSIVE" and "GOMP_SPINCOUNT = '0'" in done.stderr, done.stderr
    assert "SpinningThreadsWarning" not in done.stderr
    assert _library(LIBRARY_FIRST, {"OMP_WAIT_POLICY": "ACTIVE"}).stdout.strip() == "ACTIVE"
    assert "GOMP_SPINCOUNT = '1000'" in _library(LIBRARY_FIRST, {"GOMP_SPINCOUNT": "1000"}).stderr


@pytest.mark.slow
def test_a_program_that_imported_torch_first_is_told_once_with_the_fix():
    done = _library(TORCH_FIRST, {})
    warned = [line for line in done.stderr.splitlines() if "SpinningThreadsWarning" in line]
    assert len(warned) == 1 and warned[0].startswith("<string>:1:"), done.stderr  # at the user's import line
    assert "Import difftransformer before torch, or set OMP_WAIT_POLICY=PASSIVE" in warned[0]
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "1000"}):
        assert "SpinningThreadsWarning" not in _library(TORCH_FIRST, chosen).stderr, chosen
    one_thread = TORCH_FIRST.replace("set_num_threads(2)", "set_num_threads(1)")  # nothing spins beside one thread
    assert "SpinningThreadsWarning" not in _library(one_thread, {}).stderr


@pytest.mark.parametrize("path", sorted(set(COMMANDS) - NO_TORCH_WORK), ids=" ".join)
def test_every_command_that_computes_takes_threads(path):
    assert "--threads" in COMMANDS[path]._option_string_actions, f"difftx {' '.join(path)} has no --threads"


def test_threads_is_set_before_the_command_runs(tmp_path, capsys):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["generate", "--run", str(tmp_path / "missing"), "--prompt", "x", "--threads", "1"]) == 2
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "missing" in capsys.readouterr().err


def test_the_summary_names_threads_and_the_wait(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert describe(1) == "1 thread (OpenMP waits passively; --threads N sets the count)"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert describe(2) == "2 threads (OpenMP spins; --threads N sets the count)"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert describe(2) == "2 threads (OpenMP spins a while, its default; --threads N sets the count)"


def _row(condition, setting, work, ms):
    return {"condition": condition, "setting": setting, "work": work, "seconds": ms / 1e3}


def test_bench_loads_verdict_compares_the_default_with_the_best_and_the_old_default():
    from difftransformer.apps.bench_load import format_load, verdict

    ms = {  # training step, decode step
        ("idle", "1 thread, OpenMP's default"): (800, 3.0),
        ("idle", "2 threads, OpenMP's default"): (400, 3.0),
        ("idle", "1 thread, passive"): (800, 3.0),
        ("idle", "2 threads, passive"): (440, 3.3),
        ("one core busy", "1 thread, OpenMP's default"): (800, 3.2),
        ("one core busy", "2 threads, OpenMP's default"): (1600, 9.0),
        ("one core busy", "1 thread, passive"): (840, 3.3),
        ("one core busy", "2 threads, passive"): (880, 3.0),
        ("idle", "2 threads, importing difftransformer first"): (400, 3.3),
        ("one core busy", "2 threads, importing difftransformer first"): (960, 3.0),
    }
    rows = [_row(c, s, w, v[i]) for (c, s), v in ms.items() for i, w in enumerate(("training step", "decode step"))]
    result = {"shapes": {"threads": [1, 2]}, "rows": rows}
    assert verdict(result) == [
        "training step: one core busy, the default (2 threads, passive) takes 1.10x the best setting (1 thread, "
        "OpenMP's default); the old default took 2.00x. Idle, the default takes 1.10x the old default (2 threads, "
        "OpenMP's default). A program that imports difftransformer before torch (nothing set): one core busy, 1.20x "
        "the best setting; idle, 1.00x the old default",
        "decode step: one core busy, the default (2 threads, passive) takes 1.00x the best setting (2 threads, "
        "passive); the old default took 3.00x. Idle, the default takes 1.10x the old default (2 threads, OpenMP's "
        "default). A program that imports difftransformer before torch (nothing set): one core busy, 1.00x the best "
        "setting; idle, 1.10x the old default",
    ]
    result |= {"benchmark": "load", "dtype": "float32", "machine": {"cpu": "X", "torch": "2", "threads": 2}}
    result["shapes"] |= {"preset": "tiny", "attention": "diff", "batch": 16, "seq": 256, "cpus": [0, 1], "rounds": 1}
    assert "| one core busy | 2 threads, OpenMP's default | 1600 | 9.0 |" in format_load(result)


@pytest.mark.slow
def test_bench_load_runs_each_setting_as_it_says(monkeypatch, tmp_path):
    """The benchmark's processes really run at the thread count and wait policy their rows name: torch reports the
    threads, GNU OpenMP its spin count (300000 by default, 0 passive, 1000 as set). With OMP_WAIT_POLICY=PASSIVE in
    this process's environment (as difftx sets it), the 'default' settings still run at OpenMP's default. Run as
    `difftx bench load --help`'s example prints it, at a cut size (tests/test_cli_examples.py leaves it to this
    test)."""
    from difftransformer.apps.cli import build_parser, main
    from difftransformer.apps.cli.parsing import leaf_commands

    (example,) = dict(leaf_commands(build_parser()))[("bench", "load")].epilog.splitlines()[1:]
    assert example.strip() == "difftx bench load --threads 2 --json load.json"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.chdir(tmp_path)
    cut = ["--preset", "tiny", "--seq", "16", "--batch", "1", "--repeats", "1", "--rounds", "1"]
    assert main([*example.split()[1:], *cut]) == 0
    result = json.loads((tmp_path / "load.json").read_text())
    seen = {row["setting"]: row["seen"] for row in result["rows"]}
    assert seen == {
        "1 thread, OpenMP's default": {"threads": 1, "spin_count": 300000},
        "2 threads, OpenMP's default": {"threads": 2, "spin_count": 300000},
        "1 thread, passive": {"threads": 1, "spin_count": 0},
        "2 threads, passive": {"threads": 2, "spin_count": 0},
        "2 threads, spin 1000": {"threads": 2, "spin_count": 1000},
        "2 threads, importing difftransformer first": {"threads": 2, "spin_count": 0},  # as a user's program runs
    }
    assert {row["condition"] for row in result["rows"]} == {"idle", "one core busy"}
    assert all(len(row["all_seconds"]) == 1 and row["seconds"] > 0 for row in result["rows"])
