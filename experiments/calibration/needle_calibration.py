"""Needle calibration (issue #14): which single-needle settings does each architecture learn, and how fast?

Trains one model per grid entry with the suite's own pieces (repro.fit.fit, tasks.needle_batch) and prints one JSON
line per model: its setting, the learning curve (accuracy on 256 fixed examples at the first N of ``needles``) and
the final accuracy at N = 1, 2, 4, 6 with the shares of each answer kind (needle.answer_kinds).

    .venv/bin/python experiments/calibration/needle_calibration.py GRID.json OUT.jsonl [--workers 2]

GRID.json is a list of settings: attention, vocab ("shared" or "disjoint"), key_noise, lr, steps, length, needles
(the N drawn per training batch), seed, and optionally d_model, n_layers and curriculum: [[until_step, needles],
...], the N drawn before each step (the last entry's needles after its step). Results append to OUT.jsonl.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context

import torch

from difftransformer.apps.repro import needle
from difftransformer.apps.repro.fit import FitSpec, fit
from difftransformer.apps.repro.tasks import needle_batch

EVAL = 256
FINAL_N = (1, 2, 4, 6)


class Sampler:
    """Training batches; N drawn from the curriculum's needles of the current step (one call per step)."""

    def __init__(self, curriculum, length, vocab, key_noise):
        self.curriculum, self.task, self.step = curriculum, dict(vocab=vocab, key_noise=key_noise), 0
        self.length = length

    def __call__(self, gen, batch):
        needles = next((n for until, n in self.curriculum if self.step < until), self.curriculum[-1][1])
        self.step += 1
        n = needles[int(torch.randint(0, len(needles), (), generator=gen))]
        nb = needle_batch(gen, batch, self.length, n, 1, **self.task)
        return nb.tokens, nb.targets


def eval_set(length, n, vocab, key_noise):
    return needle_batch(torch.Generator().manual_seed(999 + n), EVAL, length, n, 1, vocab=vocab, key_noise=key_noise)


def curve_score(model, length, n, vocab, key_noise):
    return round(needle.outcomes(model, eval_set(length, n, vocab, key_noise))["correct"], 3)


def job(setting: dict) -> dict:
    s = {"d_model": 64, "n_layers": 4, "key_noise": 0.0, "seed": 0, **setting}
    spec = FitSpec(
        d_model=s["d_model"], n_layers=s["n_layers"], n_heads=8, seq_len=s["length"], steps=s["steps"],
        batch_size=32, lr=s["lr"], eval_every=max(1, s["steps"] // 8),
    )  # fmt: skip
    task = dict(length=s["length"], vocab=s["vocab"], key_noise=s["key_noise"])
    curriculum = s.get("curriculum") or [[s["steps"], s["needles"]]]
    score = partial(curve_score, n=curriculum[0][1][0], **task)
    record, model = fit(s["attention"], s["seed"], spec, Sampler(curriculum, **task), score)
    final = {n: needle.outcomes(model, eval_set(n=n, **task)) for n in FINAL_N}
    curve = [(c["step"], c["seconds"], c["accuracy"]) for c in record["curve"]]
    return {**s, "seconds": record["seconds"], "curve": curve, "final": final}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    main()
