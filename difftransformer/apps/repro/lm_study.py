"""The language-model study's runners: `difftx repro lm` (the short-budget parts, ``run``) and its long part
(``run_long``), each training what is missing into a study directory and then writing the report. The plans and the
trainers are ``lm`` and ``lm_long``; the report is ``lm_report``, which reads the plans, so the runners live here,
above both (no module of the study imports one that imports it back).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from difftransformer.apps.repro import lm, lm_long, lm_report
from difftransformer.errors import InputError
from difftransformer.training.config import device_problem


def run(
    out: str | Path,
    scale: str = "cpu",
    parts: tuple[str, ...] = lm.PARTS,
    seeds: list[int] | None = None,
    workers: int | None = None,
    steps: int | None = None,
    corpora: list[str | Path] | None = None,
) -> dict:
    """Run (or continue) the study's ``parts`` into ``out`` and write its report; returns the results."""
    if scale not in lm.SCALES:
        raise InputError(f"unknown scale {scale!r}; choose one of {', '.join(lm.SCALES)}")
    plan = lm.SCALES[scale]
    if steps is not None:
        plan = dataclasses.replace(plan, steps=(steps, max(1, steps // 2)), ckpt_every=min(plan.ckpt_every, steps))
    seeds = list(range(3)) if seeds is None else seeds
    out = Path(out)
    corpora = list(lm.DEFAULT_CORPORA if corpora is None else corpora)
    if device_problem(plan.device) is not None:  # everything here is checked before anything is written
        raise InputError(
            f"`scale` {scale} trains on {plan.device!r}, which this machine lacks (no CUDA GPU, or torch is a CPU "
            "build); use `scale` cpu here"
        )
    if not (out / "data" / "manifest.json").is_file():
        lm.study_documents(corpora, read=False)
    if "sweep" not in parts:
        lm.best_lrs(plan, lm.read_measures(out))
    lm.open_study(out, plan, seeds)
    data = lm.ensure_data(out, plan, corpora)
    workers = plan.workers if workers is None else workers
    for part in lm.PARTS:
        if part not in parts:
            continue
        start = time.perf_counter()
        if part == "sweep":
            runs = lm.sweep_runs(plan)
        else:
            best = lm.best_lrs(plan, lm.read_measures(out))
            runs = lm.grid_runs(plan, best, seeds) if part == "grid" else lm.ablation_runs(plan, best, seeds)
        try:
            lm.execute(runs, plan, out, data, workers)
        finally:
            total = lm.add_time(out, part, time.perf_counter() - start)
        print(f"difftx repro lm: {part} done, {total / 60:.1f} min of training in all", flush=True)
    return lm_report.write(out, plan, seeds, lm.read_measures(out))


def run_long(
    out: str | Path,
    scale: str = "cpu",
    seeds: list[int] | None = None,
    workers: int | None = None,
    steps: int | None = None,
    corpora: list[str | Path] | None = None,
) -> dict:
    """Run (or continue) the long part into ``out`` and write the study's report; returns the results."""
    if scale not in lm_long.PLANS:
        raise InputError(f"unknown scale {scale!r}; choose one of {', '.join(lm_long.PLANS)}")
    plan = lm_long.PLANS[scale]
    if steps is not None:
        plan = dataclasses.replace(plan, steps=(steps, max(1, steps // 4)), ckpt_every=min(plan.ckpt_every, steps))
    seeds = list(range(3)) if seeds is None else seeds
    out = Path(out)
    corpora = list(lm.DEFAULT_CORPORA if corpora is None else corpora)
    if device_problem(plan.device) is not None:
        raise InputError(
            f"`scale` {scale} trains on {plan.device!r}, which this machine lacks (no CUDA GPU, or torch is a CPU "
            "build); use `scale` cpu here"
        )
    if not (out / "data" / "manifest.json").is_file():
        lm.study_documents(corpora, read=False)
    lm_long.open_long(out, plan, seeds)
    data = lm.ensure_data(out, plan, corpora)
    workers = plan.workers if workers is None else workers
    plan = lm_long.decided_plan(plan, out, data, seeds)
    stages = (("long-tune", lambda: lm_long.tune_stage(plan, out, data, workers)),
              ("long", lambda: lm_long.long_stage(plan, out, data, workers, seeds)),
              ("long-timing", lambda: lm_long.timing_stage(plan, out, data, seeds)))  # fmt: skip
    for name, stage in stages:
        start = time.perf_counter()
        try:
            stage()
        finally:
            total = lm.add_time(out, name, time.perf_counter() - start)
        print(f"difftx repro lm: {name} done, {total / 60:.1f} min in all", flush=True)
    return lm_report.write_study(out)
