"""The language-model study's runners: `difftx repro lm` (the short-budget parts, ``run``) and its long part
(``run_long``), each training what is missing into a study directory and then writing the report. The plans and the
trainers are ``lm`` and ``lm_long``; the report is ``lm_report``, which reads the plans, so the runners live here,
above both (no module of the study imports one that imports it back).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from difftransformer.apps.repro import lm, lm_long, lm_norm, lm_report
from difftransformer.devices import device_problem
from difftransformer.errors import InputError


def run(
    out: str | Path,
    scale: str = "cpu",
    parts: tuple[str, ...] = lm.PARTS,
    seeds: list[int] | None = None,
    workers: int | None = None,
    steps: int | None = None,
    corpora: list[str | Path] | None = None,
    log_to: str = "jsonl",
) -> dict:
    """Run (or continue) the study's ``parts`` into ``out`` and write its report; returns the results. Each model's
    metrics go to ``log_to`` (TrainConfig.log_to) in its run directory under out/runs."""
    plan, out, corpora = _checked(lm.SCALES, scale, steps, 2, out, corpora)  # before anything is written
    seeds = list(range(3)) if seeds is None else seeds
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
            lm.execute(runs, plan, out, data, workers, log_to)
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
    log_to: str = "jsonl",
) -> dict:
    """Run (or continue) the long part into ``out`` and write the study's report; returns the results."""
    plan, out, corpora = _checked(lm_long.PLANS, scale, steps, 4, out, corpora)
    seeds = list(range(3)) if seeds is None else seeds
    lm_long.open_long(out, plan, seeds)
    data = lm.ensure_data(out, plan, corpora)
    workers = plan.workers if workers is None else workers
    plan = lm_long.decided_plan(plan, out, data, seeds)
    _stages(out, (("long-tune", lambda: lm_long.tune_stage(plan, out, data, workers, log_to)),
                  ("long", lambda: lm_long.long_stage(plan, out, data, workers, seeds, log_to)),
                  ("long-timing", lambda: lm_long.timing_stage(plan, out, data, seeds))))  # fmt: skip
    return lm_report.write_study(out)


def run_norm(
    out: str | Path,
    scale: str = "cpu",
    workers: int | None = None,
    steps: int | None = None,
    corpora: list[str | Path] | None = None,
    log_to: str = "jsonl",
) -> dict:
    """Run (or continue) the norm part (``lm_norm``) into ``out`` and write the study's report, of which the norm
    part's section and figures (``lm_norm_report``) are a part; returns the norm part's numbers."""
    plan, out, corpora = _checked(lm_norm.PLANS, scale, steps, 1, out, corpora)
    lm_norm.open_norm(out, plan)
    data = lm.ensure_data(out, plan, corpora)
    workers = plan.workers if workers is None else workers
    plan = lm_norm.decided_plan(plan)
    _stages(out, (("norm-tune", lambda: lm_norm.tune_stage(plan, out, data, workers, log_to)),
                  ("norm-final", lambda: lm_norm.final_stage(plan, out, data, workers, log_to))))  # fmt: skip
    return lm_report.write_study(out)["norm"]


def _stages(out: Path, stages) -> None:
    """Run each (name, stage) in order, adding its seconds to the study's timings (even when it fails)."""
    for name, stage in stages:
        start = time.perf_counter()
        try:
            stage()
        finally:
            total = lm.add_time(out, name, time.perf_counter() - start)
        print(f"difftx repro lm: {name} done, {total / 60:.1f} min in all", flush=True)


def _checked(plans: dict, scale: str, steps: int | None, short: int, out, corpora):
    """The scale's plan (``steps`` overriding its budget, the short budget ``steps // short``), the study directory
    and the corpora, after the checks that need nothing written: the scale, its device, the corpora."""
    if scale not in plans:
        raise InputError(f"unknown scale {scale!r}; choose one of {', '.join(plans)}")
    plan = plans[scale]
    if steps is not None:
        plan = dataclasses.replace(plan, steps=(steps, max(1, steps // short)), ckpt_every=min(plan.ckpt_every, steps))
    out = Path(out)
    corpora = list(lm.DEFAULT_CORPORA if corpora is None else corpora)
    if device_problem(plan.device) is not None:
        raise InputError(
            f"`scale` {scale} trains on {plan.device!r}, which this machine lacks (no CUDA GPU, or torch is a CPU "
            "build); use `scale` cpu here"
        )
    if not (out / "data" / "manifest.json").is_file():
        lm.study_documents(corpora, read=False)
    return plan, out, corpora
