"""A run's metrics as the trainer writes them: metrics.jsonl, the record a resume keeps (cut back to the step of the
checkpoint it resumes from), and the sinks ``log_to`` names (training/tracking.py), all written by the main process.
"""

from __future__ import annotations

import json
from pathlib import Path

from difftransformer.fsutil import write_text_atomic
from difftransformer.store.runs import METRICS, read_metrics
from difftransformer.training.tracking import open_sinks, parse_sinks


class MetricsLog:
    """The metrics of the run in ``run_dir``; only the main process (``main``) writes."""

    def __init__(self, run_dir: Path, main: bool) -> None:
        self.run_dir, self.main = Path(run_dir), main
        self.sinks: list = []

    def rows(self) -> list[dict]:
        """The rows of metrics.jsonl (store/runs.read_metrics)."""
        return read_metrics(self.run_dir)[0]

    def restart(self) -> None:
        """Empty metrics.jsonl: a run resumed before its first checkpoint starts again from step 0."""
        if self.main:
            write_text_atomic(self.run_dir / METRICS, "")

    def keep_to(self, step: int, note) -> None:
        """Drop the rows after ``step`` (a checkpoint's: they will be written again) and the lines that are not
        JSON, telling ``note`` about the latter."""
        if not self.main:
            return
        rows, torn = read_metrics(self.run_dir)
        if torn:
            note(f"{self.run_dir / METRICS} has lines that are not JSON (line {torn[0]}); they are dropped")
        write_text_atomic(self.run_dir / METRICS, "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))

    def open(self, log_to: str, recipe: dict) -> None:
        """Open the sinks besides jsonl (TensorBoard's rebuilt from the rows kept)."""
        if self.main:
            self.sinks = open_sinks(parse_sinks(log_to), self.run_dir, self.rows(), recipe)

    def write(self, row: dict) -> None:
        if self.main:
            with open(self.run_dir / METRICS, "a") as f:
                f.write(json.dumps(row) + "\n")
            for sink in self.sinks:
                sink.write(row)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()


def step_of(row: str) -> int | None:
    """The step of a metrics.jsonl line (None for a line that is not a metrics row)."""
    try:
        step = json.loads(row).get("step")
    except (json.JSONDecodeError, AttributeError):
        return None
    return step if isinstance(step, int) else None
