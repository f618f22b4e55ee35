"""The live progress line (difftransformer.progress) and what the commands print around long work: start and end
summaries of train, the demo's context, third-party noise filtered from eval."""

from __future__ import annotations

import io
import subprocess
import sys
import time

import pytest
import torch

from difftransformer import progress as progress_module
from difftransformer.progress import Progress, duration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", fake)
    return fake


def test_duration():
    assert [duration(s) for s in (0, 12.4, 59.6, 61, 3599, 3600, 7325)] == ["0s", "12s", "1m00s", "1m01s", "59m59s",
                                                                           "1h00m", "2h02m"]  # fmt: skip
    assert duration(float("inf")) == "?"


def test_log_lines_are_spaced_and_show_rate_eta_and_loss(clock):
    out = io.StringIO()
    p = Progress(100, "train x", stream=out, every_s=30)
    for step in range(1, 101):  # 1 step per second, 512 tokens per step
        clock.now += 1.0
        p.update(step, tokens=512 * step, loss=5.0 - step / 100)
    lines = out.getvalue().splitlines()
    # the first update, then one line per 30 seconds, and the last
    assert [line.split("  ")[1] for line in lines] == ["1/100 steps", "31/100 steps", "61/100 steps", "91/100 steps",
                                                       "100/100 steps"]  # fmt: skip
    assert lines[2] == "train x  61/100 steps  loss 4.3900  512 tok/s  1m01s elapsed, 39s left"
    assert lines[-1].endswith("1m40s elapsed, 0s left")


def test_rate_is_smoothed_over_a_slow_step(clock):
    out = io.StringIO()
    p = Progress(1000, stream=out, every_s=0)
    for step in range(1, 51):
        clock.now += 1.0
        p.update(step, tokens=100 * step)
    clock.now += 10.0  # one step ten times slower (a validation, a busy machine)
    p.update(51, tokens=5100)
    shown = out.getvalue().splitlines()[-1]
    rate = float(shown.split("  ")[1].split()[0].replace(",", ""))
    assert 60 < rate < 100  # smoothed: neither the last interval's 10 tok/s nor the earlier 100


def test_time_left_does_not_swing_over_pauses(clock):
    """240 steps of a second with a pause of a minute every 40 (a validation on a slow machine): once a pause has
    been seen (step 45 on), elapsed plus time left, the total each line predicts, stays within a factor of 1.3 of
    the true 540 s (420 to 598; the smoothed recent pace predicted 325 to 3,007 s)."""
    out = io.StringIO()
    p = Progress(240, stream=out, every_s=0)
    for step in range(1, 241):
        clock.now += 1.0 + (60.0 if step % 40 == 1 and step > 1 else 0.0)
        p.update(step)
    predicted = []
    for line in out.getvalue().splitlines()[44:-1]:
        elapsed, left = line.split("  ")[-1].split(" elapsed, ")
        predicted.append(_seconds(elapsed) + _seconds(left.removesuffix(" left")))
    assert clock.now - 1000.0 == 540.0
    assert 540 / 1.3 < min(predicted) and max(predicted) < 540 * 1.3, (min(predicted), max(predicted))


def _seconds(text: str) -> float:
    """The seconds of duration()'s 12s, 3m05s, 1h02m."""
    if "h" in text:
        hours, minutes = text.removesuffix("m").split("h")
        return 3600 * int(hours) + 60 * int(minutes)
    if "m" in text:
        minutes, secs = text.removesuffix("s").split("m")
        return 60 * int(minutes) + int(secs)
    return float(text.removesuffix("s"))


def test_a_terminal_line_is_rewritten_in_place_and_lines_go_above_it(clock, capsys):
    term = Terminal()
    p = Progress(10, "demo", stream=term)
    clock.now += 1.0
    p.update(1)
    clock.now += 1.0
    p.update(2)
    p.write("a table row")
    p.close()
    text = term.getvalue()
    assert text.startswith("\r[##------------------] demo  1/10 steps")
    assert "\r[####----------------] demo  2/10 steps" in text and "\n" not in text[:-1]
    assert text.endswith("\n")
    assert capsys.readouterr().out == "a table row\n"


def test_disabled_progress_prints_nothing(clock):
    out = io.StringIO()
    p = Progress(10, stream=out, enabled=False)
    p.update(5, loss=1.0)
    p.close()
    assert out.getvalue() == ""


def test_watching_polls_a_counter_until_the_block_ends():
    out = io.StringIO()
    count = {"n": 0}
    with Progress(4, "repro x", stream=out, every_s=0).watching(lambda: count["n"], every_s=0.01, after="evaluating"):
        for _ in range(4):
            count["n"] += 1
            time.sleep(0.05)
        deadline = time.monotonic() + 10  # the count is complete, the block still works: until the poller notes it
        while "evaluating" not in out.getvalue() and time.monotonic() < deadline:  # (a fixed wait could miss it)
            time.sleep(0.01)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("repro x  ") and lines[-1].startswith("repro x  4/4 steps")
    noted = [line for line in lines if "evaluating" in line]
    assert noted and all("4/4 steps" in line for line in noted) and "evaluating" not in lines[-1]


NOISY = """
import os, subprocess, sys
from difftransformer.inference.evaluate import quiet_third_party

with quiet_third_party():
    print("[Task: t] metric bits_per_byte is defined, but aggregation is not. using default", file=sys.stderr)
    subprocess.run(["git", "describe", "--always"], cwd="/", check=False)  # fatal: not a git repository
    os.write(2, b"Running loglikelihood requests: 100%|####| 1/1 [00:00<00:00, 158.05it/s]\\n")
    print("a real warning", file=sys.stderr)
print("done")
"""


def test_third_party_noise_is_filtered_and_real_messages_kept():
    """In a process of its own: under pytest, sys.stderr does not write to file descriptor 2."""
    done = subprocess.run([sys.executable, "-c", NOISY], capture_output=True, text=True, check=True)
    assert done.stderr == "a real warning\n" and done.stdout == "done\n"


@pytest.mark.slow
def test_train_says_what_it_will_do_and_what_it_did(prepared, tmp_path, capsys, monkeypatch):
    from difftransformer.apps.cli import main

    run = tmp_path / "run"
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # as `difftx` sets it before torch loads
    flags = ["--max-steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-interval", "2", "--warmup-steps", "1",
             "--threads", "1"]  # fmt: skip
    before = torch.get_num_threads()
    try:
        assert main(["train", "--data", str(prepared), "--out", str(run), *flags]) == 0
    finally:
        torch.set_num_threads(before)
    out, err = capsys.readouterr()
    first, done, after = out.splitlines()
    assert first.startswith("difftx train: diff model, 1,345,984 parameters (tiny preset); 4 steps of 4 x 32 tokens = ")
    assert first.endswith(
        f"training tokens of {prepared}) on cpu, 1 thread (OpenMP waits passively; --threads N sets the count) in "
        f"float32; writing to {run}"
    )
    assert done.startswith(f"difftx train: done: {run} at step 4; training loss ")
    assert done.endswith(f"checkpoint {run / 'checkpoints' / 'step_00000004'}")
    assert after.startswith(f"next: difftx generate --run {run} --prompt 'Your text'")
    assert "train run  4/4 steps  loss " in err and "step 2: validation loss" in err


def test_a_study_reads_each_runs_progress_from_its_metrics(tmp_path):
    from difftransformer.apps.repro.lm import _trained_steps

    assert _trained_steps(tmp_path / "missing") == 0
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in (10, 20, 30)))
    assert _trained_steps(tmp_path) == 30
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 40, "lo')  # a row being written
    assert _trained_steps(tmp_path) == 30


@pytest.mark.slow
def test_each_benchmark_counts_exactly_the_timed_calls_it_plans(capsys):
    import re

    from difftransformer.apps import bench

    bench.bench_attention([16, 32], dim=32, heads=4, repeats=2, plain_max_seq=16)
    bench.bench_train("tiny", [16], batch=1, repeats=1)
    bench.bench_decode([8], "tiny", tokens=2, repeats=2)
    err = capsys.readouterr().err
    for what in ("attention", "train", "decode"):
        done, total = re.findall(rf"^bench {what}  (\d+)/(\d+) timed calls", err, re.M)[-1]
        assert done == total, f"bench {what}: the line ends at {done}/{total}"


def _steps(p: Progress, clock: Clock, first: int, last: int, seconds: float) -> None:
    for step in range(first, last + 1):
        clock.now += seconds
        p.update(step)


def test_a_pace_that_stays_far_below_the_runs_best_is_named(clock):
    """#48: a run slowed 5x by other programs showed only a longer time left; the line says so once the slow pace
    has lasted SLOW_FOR_S, and stops saying it when the pace is back."""
    out = io.StringIO()
    p = Progress(10_000, stream=out, every_s=0, watch_pace=True)
    _steps(p, clock, 1, 60, 1.0)  # 1 step/s for a minute: the best pace
    assert "pace" not in out.getvalue()
    _steps(p, clock, 61, 66, 5.0)  # 5 s a step: for 30 s the line says nothing yet
    assert "below" not in out.getvalue().splitlines()[-1]
    _steps(p, clock, 67, 80, 5.0)
    assert "below this run's best: other programs may be using the cores" in out.getvalue().splitlines()[-1]
    _steps(p, clock, 81, 200, 1.0)
    assert "below" not in out.getvalue().splitlines()[-1]


def test_a_pause_such_as_a_validation_is_not_named_slow(clock):
    out = io.StringIO()
    p = Progress(10_000, stream=out, every_s=0, watch_pace=True)
    _steps(p, clock, 1, 60, 1.0)
    clock.now += 25.0  # a 25 s validation, then the same pace
    _steps(p, clock, 61, 200, 1.0)
    assert "below" not in out.getvalue()


def test_work_of_unequal_units_is_not_watched_unless_asked(clock):
    """A benchmark's calls differ (longer sequences take longer): its line never calls that slow."""
    out = io.StringIO()
    p = Progress(10_000, stream=out, every_s=0)
    _steps(p, clock, 1, 60, 1.0)
    _steps(p, clock, 61, 100, 10.0)
    assert "below" not in out.getvalue()


def test_a_pace_far_below_the_expected_one_is_named_from_the_start(clock):
    out = io.StringIO()
    p = Progress(10_000, stream=out, every_s=0, expected=(1.0, "the pace of 2 idle cores"))
    _steps(p, clock, 1, 10, 4.0)
    assert "pace 4.0x below the pace of 2 idle cores: other programs may be using the cores" in out.getvalue()
    out2 = io.StringIO()
    p = Progress(10_000, stream=out2, every_s=0, expected=(1.0, "the pace of 2 idle cores"))
    _steps(p, clock, 1, 40, 2.0)  # 2x below: within SLOW
    assert "below" not in out2.getvalue()


class Emulated(io.StringIO):
    """A terminal of ``columns`` columns (pyte's emulator, which wraps at the right margin as terminals do); what is
    written goes through the tty's newline translation (\\n to \\r\\n) to the emulated screen."""

    def __init__(self, columns: int) -> None:
        import pyte

        super().__init__()
        self.screen = pyte.Screen(columns, 12)
        self.feed = pyte.Stream(self.screen).feed

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.feed(text.replace("\n", "\r\n"))
        return super().write(text)

    def rows(self) -> list[str]:
        return [row.rstrip() for row in self.screen.display if row.strip()]


@pytest.mark.parametrize("columns", [80, 120])
def test_the_live_line_fits_the_terminal_and_leaves_nothing_behind(clock, monkeypatch, columns):
    """#56: a 171-246 character line rewritten with a bare \\r left wrapped pieces in a 100-column terminal, worst
    once the pace warning was added. On an emulated terminal the screen holds the rows written above the line and
    the line alone, which keeps the count and the time left, ends with what the last update said, and is at most
    the terminal's width less one."""
    monkeypatch.setenv("COLUMNS", str(columns))
    term = Emulated(columns)
    p = Progress(5000, "train a-run-directory-with-a-long-name", stream=term, watch_pace=True)
    _steps(p, clock, 1, 60, 1.0)
    p.write("step 60: validation loss 3.2100", stream=term)
    rows = term.rows()
    assert rows[0] == "step 60: validation loss 3.2100" and len(rows) == 2, rows
    _steps(p, clock, 61, 100, 6.0)  # the pace warning appears
    _steps(p, clock, 101, 103, 6.0)
    rows = term.rows()
    assert len(rows) == 2 and rows[0] == "step 60: validation loss 3.2100", rows
    line = rows[1]
    assert len(line) <= columns - 1 and line.count("103/5000 steps") == 1 and line.endswith(" left"), line
    assert "pace 5.9x below this run's best" in line or "pace 6.0x below this run's best" in line, line
    if columns >= 120:  # room for the explanation too
        assert "other programs may be using the cores" in line, line
    p.close()
    assert term.screen.cursor.x == 0 and term.screen.cursor.y == 2  # the line ends with a newline


def test_fields_go_in_the_stated_order_as_the_width_shrinks():
    from difftransformer.progress import DROPPED, fit

    fields = {"bar": "[####----]", "label": "train x", "count": "3/9 steps", "loss": "loss 1.2345", "rate": "9 tok/s",
              "note": "saving", "pace": "pace 3.0x below best", "why": ": busy", "elapsed": "1m00s elapsed",
              "left": "2m00s left"}  # fmt: skip
    full = fit(fields)
    assert full == ("[####----] train x  3/9 steps  loss 1.2345  9 tok/s  saving  pace 3.0x below best: busy  "
                    "1m00s elapsed, 2m00s left")  # fmt: skip
    kept = []
    for width in range(len(full), 0, -1):
        line = fit(fields, width)
        assert len(line) <= width
        kept.append({name for name, text in fields.items() if text in line})
    gone = [name for name in DROPPED if any(name not in k for k in kept)]
    first_gone = sorted(gone, key=lambda name: next(i for i, k in enumerate(kept) if name not in k))
    assert first_gone == list(DROPPED)  # each field leaves in DROPPED's order
    assert fit(fields, 21) == "3/9 steps  2m00s left"  # the count and the time left stay
    assert fit(fields, 8) == "3/9 step"  # narrower still: cut


def test_the_time_left_counts_down_within_a_step_and_moves_by_at_most_a_third(clock):
    """#56: early on the time left jumped within one step (18m04s, 30m03s, 17m59s): it was re-estimated from a step
    still running. Now it counts down between steps, and after warm-up each line's time left is within a third of
    the one before, over steps of uneven length (1 to 3 s) and a 40 s validation every 50 steps."""
    term = Terminal()
    p = Progress(400, stream=term)
    clock.now += 2.0
    p.update(1)
    shown = []
    for _poll in range(8):  # the second step runs 4 s; a watcher polls 4 times a second
        clock.now += 0.5
        p.update(1, note="")
        shown.append(_seconds(term.getvalue().split("\r")[-1].split(", ")[-1].split()[0]))
    assert shown == sorted(shown, reverse=True), shown  # never up within the step
    lefts = []
    for step in range(2, 401):
        clock.now += 1.0 + (step * 7919 % 5) / 2 + (40.0 if step % 50 == 0 else 0.0)
        p.update(step)
        lefts.append(_seconds(term.getvalue().split("\r")[-1].split(", ")[-1].split()[0]))
    steps_before = [(a, b) for a, b in zip(lefts[3:], lefts[4:], strict=False) if a >= 60]
    assert all(2 / 3 * a - 4 <= b <= 4 / 3 * a for a, b in steps_before), steps_before
    assert lefts[-1] == 0
