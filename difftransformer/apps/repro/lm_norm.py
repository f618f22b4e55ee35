"""`difftx repro lm --part norm`: the per-head norm's initial scale (issue #49). Does DIFF V1's small-scale deficit go
away when its per-head norm starts at ``ModelConfig(head_norm_gain="matched")``, and why: the initial scale, the
learned weight's changed step size, or the norm itself? Every variant is tuned at the very schedule it is compared at.

The variants (``NORM_VARIANTS``), at the long part's size (``lm_long``, 267k non-embedding parameters, 20 tokens per
parameter, one pass over the corpus): the standard model; DIFF V1 as the paper has it; V1 with the rule; V1 without the
per-head norm; V1 whose norm weight starts at 1 but whose output is multiplied by the rule's gain as a constant (the
initial scale without the changed step size, ``head_norm_gain_fixed``); the standard model with the per-head norm at
the rule's gain; DIFF V2 with the standard model's parameter count.

Two stages, each continuing where an interrupted study stopped (the same command again):

1. ``tune``: every variant at its grid of learning rates (``NormScale.grids``: three rates a factor of 2 apart around
   where its best was expected), ``tune_seeds`` seeds, each run the whole budget with the final runs' warm-up and
   decay; a variant whose best rate (the lowest mean loss over the seeds) is at an edge of its grid gets the next rate
   beyond it, until the best is inside (or the grid holds ``MAX_RATES``);
2. ``final``: every variant at its best rate, every seed; the tuning seeds' runs at that rate are the same runs (a
   tuning run is a final run), so the seeds beyond them are the ones trained here.

Budget (issue #49: 8 hours of machine time, two runs at a time, one thread each): a run took 9-14 minutes two at a time
on the project's 2-core machine (medians by variant; V2 the slowest), and the study took 7.2 hours of the machine's wall
clock: tuning 5.3 hours (54 runs: 42 at the first grids, 12 at the 6 rates added beyond a grid's edge; two of them are
the long part's bit-identical standard runs, reused), the 21 further final seeds 1.9 hours. The issue's second size (3
times the parameters at 20 tokens per parameter: 9 times the compute of a run, 4 variants x 3 seeds plus their tuning)
would take about 36 more hours here, so it is cut from this budget; the GPU plan of ``lm_long`` (width 256, 12 times the
parameters) is where it fits.

The runs live in the same study directory as the other parts (the same prepared corpus, ``runs/``, ``measures/``):
a run the long part trained with the same size, budget, variant, rate and seed is the same run and is not trained
again. The plan is recorded in ``NORM_PLAN``.

The committed report (``experiments/reports/lm-norm``) is the norm part's own: its study directory was seeded with the
long part's three standard runs only. The long part's DIFF runs predate the fused CPU kernel's subnormal fix (issue
#31), and trained again they end elsewhere (V1 at 0.024: +0.041 and +0.018 nats on seeds 0 and 1; without the norm
at 0.006: within 2e-5), so the norm part trained its own; ``lm_report.export`` refuses to put two runs of one name
in one report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from difftransformer.apps.repro import lm, lm_long
from difftransformer.apps.repro.lm_long import SIZE, LongScale
from difftransformer.fsutil import open_plan

NORM_PLAN = "norm.json"
MAX_RATES = 6  # a variant's grid grows by RATE_FACTOR (lm_long) to at most this many rates

# name: (attention, ModelConfig options); the matched V2's feed-forward width is added by the plan
NORM_VARIANTS: dict[str, tuple[str, dict]] = {
    "standard": ("standard", {}),
    "diff": ("diff", {}),
    "diff-matched": ("diff", {"head_norm_gain": "matched"}),
    "diff-matched-fixed": ("diff", {"head_norm_gain": "matched", "head_norm_gain_fixed": True}),
    "diff-no-head-norm": ("diff", {"head_norm": False}),
    "standard-head-norm-matched": ("standard", {"head_norm": True, "head_norm_gain": "matched"}),
    "diff_v2-matched": ("diff_v2", {}),
}
LABELS = {
    "standard": "standard",
    "diff": "DIFF V1 (paper)",
    "diff-matched": "V1, matched gain",
    "diff-matched-fixed": "V1, matched gain as a constant",
    "diff-no-head-norm": "V1 without the per-head norm",
    "standard-head-norm-matched": "standard + per-head norm at matched gain",
    "diff_v2-matched": "DIFF V2 (matched parameters)",
}


@dataclass(frozen=True)
class NormScale(LongScale):
    """The norm study's plan: the long part's size and budget (``steps[0]``; tuning runs are whole-budget runs too),
    each variant's first learning-rate grid and the seeds of the final comparison."""

    variants: tuple[str, ...] = tuple(NORM_VARIANTS)
    grids: dict = field(default_factory=dict)  # variant -> its first rates
    final_seeds: int = 5

    def attention(self, variant: str) -> str:
        return {**lm_long.LONG_VARIANTS, **NORM_VARIANTS}[variant][0]

    def model_options(self, variant: str) -> dict:
        return {**{**lm_long.LONG_VARIANTS, **NORM_VARIANTS}[variant][1], **self.options.get(variant, {})}


_STANDARD_GRID = (3e-3, 6e-3, 1.2e-2)
PLANS = {
    # The long part's CPU plan (width 64, 5 layers, heads of 32: 267k non-embedding parameters, 1407 steps of 8 x 512
    # tokens, 20 tokens per parameter), every run at the whole budget. The grids centre on the rates the long part's
    # quarter-budget tuning chose (DIFF V1 2.4e-2, the others 6e-3; the standard model's whole-budget best was 6e-3).
    "cpu": NormScale(
        **{
            f.name: getattr(lm_long.PLANS["cpu"], f.name)
            for f in dataclasses.fields(LongScale)
            if f.name not in ("name", "steps", "rationale")
        },
        name="cpu-norm",
        steps=(1407, 1407),
        grids={v: (1.2e-2, 2.4e-2, 4.8e-2) if v == "diff" else _STANDARD_GRID for v in NORM_VARIANTS},
        rationale="The long part's size and budget (267k non-embedding parameters, 20 tokens per parameter, one "
        "differential head per layer), where DIFF V1 as published was 0.30 nats behind; every variant tuned at "
        "this whole budget.",
    ),
}


def decided_plan(plan: NormScale) -> NormScale:
    """The plan with the matched V2's feed-forward width."""
    return dataclasses.replace(plan, options={"diff_v2-matched": {"ffn_dim": lm_long.matched_ffn_dim(plan)}})


def open_norm(out: Path, plan: NormScale) -> dict:
    """Create out/NORM_PLAN, or check that the norm part already in ``out`` is this one."""
    record = {"plan": dataclasses.asdict(plan)}
    return open_plan(
        out,
        NORM_PLAN,
        record,
        "norm part",
        lambda saved, path: (
            f"{out} holds a norm part with another plan ({path}: {saved.get('plan', {}).get('name')!r}); continue "
            "it with the same `scale` and `steps`, or give a new `out`"
        ),
        companions=(lm.STUDY, lm.LONG_PLAN),
    )


def _tune_runs(plan: NormScale, variant: str, rates: list[float]) -> list[lm.Run]:
    return [lm.Run(SIZE, plan.steps[0], variant, lr, s) for lr in rates for s in range(plan.tune_seeds)]


def tuning(plan: NormScale, measures: dict[str, dict]) -> dict[str, dict]:
    """Each variant's learning-rate grid as far as the measured runs have grown it: {variant: {rates, losses (rate ->
    [loss per seed]), best (None until every run of the grid is measured), at_edge, done}}."""
    return {
        v: lm_long.grown_grid(
            plan.grids[v], lambda rates, v=v: _tune_runs(plan, v, rates), measures, plan.tune_seeds, MAX_RATES
        )
        for v in plan.variants
    }


def tune_runs(plan: NormScale, state: dict[str, dict]) -> list[lm.Run]:
    return [r for v, st in state.items() for r in _tune_runs(plan, v, st["rates"])]


def final_runs(plan: NormScale, state: dict[str, dict]) -> list[lm.Run]:
    """Every variant at its best rate, seeds 0 .. final_seeds - 1 (refused until tuning is done)."""
    pending = [v for v, st in state.items() if not st["done"]]
    if pending:
        raise lm.InputError(f"the learning-rate tuning of {', '.join(pending)} is not complete")
    return [lm.Run(SIZE, plan.steps[0], v, st["best"], s) for v, st in state.items() for s in range(plan.final_seeds)]


def tune_stage(plan: NormScale, out: Path, data: Path, workers: int, log_to: str = "jsonl") -> None:
    lm_long.tune_until_inside(plan, out, data, workers, log_to, tuning, tune_runs)


def final_stage(plan: NormScale, out: Path, data: Path, workers: int, log_to: str = "jsonl") -> None:
    lm.execute(final_runs(plan, tuning(plan, lm.read_measures(out))), plan, out, data, workers, log_to)
