"""In-context-learning calibration (issue #14): which training settings does each architecture learn, and how fast?

Trains one model per grid entry with the suite's own pieces (repro.fit.fit, repro.icl.sample) and prints one JSON
line per model: its setting, the learning curve (accuracy at C = 4 with 24 demonstrations, 256 fixed episodes) and
the final accuracy at C = 2, 4, 8 with 8 and 24 demonstrations (icl.episodes, 512 each).

    .venv/bin/python experiments/calibration/icl_calibration.py GRID.json OUT.jsonl [--workers 2]

GRID.json is a list of settings: attention, lr, steps, seed, shots ([fewest, most] demonstrations per training
episode, drawn per batch), classes (the C drawn per batch), and optionally init_std (default 0.07), d_model (64),
n_layers (2), n_heads (4, the standard model's; DIFF uses half). Results append to OUT.jsonl.
"""

from __future__ import annotations

from functools import partial

from needle_calibration import run_grid  # the same command line, from this folder

from difftransformer.apps.repro import icl
from difftransformer.apps.repro.fit import FitSpec, fit

FINAL = {"classes": (2, 4, 8), "shots": (8, 24), "size": 512}


def job(setting: dict) -> dict:
    s = {"d_model": 64, "n_layers": 2, "n_heads": 4, "init_std": 0.07, **setting}
    spec = FitSpec(
        d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"], seq_len=64, steps=s["steps"],
        batch_size=32, lr=s["lr"], init_std=s["init_std"], eval_every=max(1, s["steps"] // 8),
    )  # fmt: skip
    sample = partial(icl.sample, classes=s["classes"], shots=s["shots"])
    record, model = fit(s["attention"], s["seed"], spec, sample, partial(icl.curve_score, shots=24, size=256))
    final = {
        f"C={c},k={k}": round(icl.accuracy(model, icl.episodes(c, k, FINAL["size"])), 3)
        for c in FINAL["classes"]
        for k in FINAL["shots"]
    }
    curve = [(c["step"], c["seconds"], c["accuracy"]) for c in record["curve"]]
    return {**s, "seconds": record["seconds"], "curve": curve, "final": final}


if __name__ == "__main__":
    run_grid(job, __doc__.splitlines()[0])
