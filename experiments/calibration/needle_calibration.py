"""Needle calibration (issue #14): which single-needle settings does each architecture learn, and how fast?

Trains one model per grid entry with the suite's own pieces (repro.fit.fit, tasks.needle_batch) and prints one JSON
line per model: its setting, the learning curve (accuracy on 256 fixed examples at the first N of ``needles``) and
the final accuracy at N = 1, 2, 4, 6 with the shares of each answer kind (needle.answer_kinds).

    .venv/bin/python experiments/calibration/needle_calibration.py GRID.json OUT.jsonl [--workers 2]

GRID.json is a list of settings: attention, vocab ("shared" or "disjoint"), key_noise, lr, steps, length, needles
(the N drawn per training batch), seed, and optionally: init_std (default 0.02), d_model, n_layers, n_heads (the
standard model's; DIFF uses half); queries (R per training sequence, every query's answer trained: a number, or
"all" for R = N; default 1); curve_n (the N of the learning curve; default the first stage's first N); curriculum
([[until_step, needles], ...], the N drawn before each step; the last entry's needles after its step).
Results append to OUT.jsonl.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context

from difftransformer.apps.repro import needle
from difftransformer.apps.repro.fit import FitSpec, fit

EVAL = 256
FINAL_N = (1, 2, 4, 6)


def curve_score(model, spec, n):
    nb = needle.eval_set(n, 1, spec.seq_len, EVAL, **needle.vocabulary(spec.task))
    return round(needle.outcomes(model, nb)["correct"], 3)


def job(setting: dict) -> dict:
    s = {"d_model": 64, "n_layers": 4, "n_heads": 8, "key_noise": 0.0, "seed": 0, "init_std": 0.02, **setting}
    spec = FitSpec(
        d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"], seq_len=s["length"], steps=s["steps"],
        batch_size=32, lr=s["lr"], init_std=s["init_std"], eval_every=max(1, s["steps"] // 8),
    )  # fmt: skip
    spec.task = {k: s[k] for k in ("needles", "vocab", "key_noise")}
    spec.task.update(queries=s.get("queries", 1), curriculum=s.get("curriculum"))
    score = partial(curve_score, spec=spec, n=s.get("curve_n", (s.get("curriculum") or [[0, s["needles"]]])[0][1][0]))
    record, model = fit(s["attention"], s["seed"], spec, needle.sampler(spec), score)
    words = needle.vocabulary(spec.task)
    final = {n: needle.outcomes(model, needle.eval_set(n, 1, spec.seq_len, EVAL, **words)) for n in FINAL_N}
    curve = [(c["step"], c["seconds"], c["accuracy"]) for c in record["curve"]]
    return {**s, "seconds": record["seconds"], "curve": curve, "final": final}


def run_grid(job, description: str) -> None:
    """The command line of a calibration: GRID.json OUT.jsonl [--workers N]; one JSON line per setting, printed and
    appended to OUT.jsonl as each finishes, ``job(setting)`` run in N worker processes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("grid")
    parser.add_argument("out")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    grid = json.loads(open(args.grid).read())
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        for result in pool.map(job, grid):
            line = json.dumps(result)
            print(line, flush=True)
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    run_grid(job, __doc__.splitlines()[0])
