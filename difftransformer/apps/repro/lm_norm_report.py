"""The norm part's report (``difftx repro lm --part norm``, ``lm_norm``): its numbers, its section of the study's
section.md and two figures, from the plan file and the measured runs only (``lm_report`` writes them into the study's
report, from ``measures/``).

Statistics that say what they can: each contrast is a paired difference over seeds (the same seed: the same data
order and the same initialisation of the shared layers); the contrasts form one family (``CONTRASTS``), whose p-values
get Holm's adjustment; each interval is at the level of its contrast's Holm step, so that it excludes zero exactly
when the contrast is called different (Bonferroni's simultaneous intervals are kept in results.json beside them). A
contrast is called "equivalent" only when the TOST test at ``MARGIN`` rejects (Holm-adjusted), "lower" or "higher" when
the test against zero does, and otherwise "not distinguishable at +-X", X the largest bound of its interval.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from difftransformer.apps import figures
from difftransformer.apps.repro import lm, lm_norm, report, stats
from difftransformer.apps.repro.lm_long_report import curve_mean, gap_curve, token_fraction
from difftransformer.apps.repro.lm_norm import LABELS, NORM_PLAN, NORM_VARIANTS, SIZE, NormScale
from difftransformer.fsutil import read_json_object

MARGIN = 0.025  # nats: the equivalence margin, the paper's DIFF - Transformer gap at 1.4B (3.062 - 3.087)
ALPHA = 0.05
BUDGET_HOURS = 8  # issue #49's budget of machine time for the whole part
# (first, second, the question the difference answers)
CONTRASTS = (
    ("diff", "standard", "DIFF V1 as published against the baseline"),
    ("diff-matched", "standard", "V1 with the rule against the baseline"),
    ("diff-matched", "diff", "what the rule changes in V1"),
    ("diff-matched-fixed", "diff", "the initial scale alone (the gain as a constant)"),
    ("diff-matched", "diff-matched-fixed", "the learned weight's step size at the same initial scale"),
    ("diff-matched", "diff-no-head-norm", "the norm at the matched gain against no norm"),
    ("standard-head-norm-matched", "standard", "the norm at the matched gain in the standard model"),
    ("diff_v2-matched", "standard", "DIFF V2 against the baseline"),
)
COLORS = {
    **figures.COLORS,
    "diff-matched-fixed": "tab:pink",
    "standard-head-norm-matched": "tab:cyan",
}
FIGURES = ("lm_norm_tuning.png", "lm_norm_curves.png")
LARGE_GAP = 0.15  # nats: a mean gap to the standard model larger than this is drawn in a panel of its own


def analyse(out: Path, measures: dict[str, dict]) -> dict | None:
    """The numbers of the norm part in ``out``, or None when ``out`` holds none."""
    if not (out / NORM_PLAN).is_file():
        return None
    plan = lm_norm.decided_plan(NormScale(**read_json_object(out / NORM_PLAN)["plan"]))
    state = lm_norm.tuning(plan, measures)
    result: dict = {"plan": {"name": plan.name, "steps": plan.steps[0], "seq_len": plan.seq_len,
                             "batch_size": plan.batch_size, "warmup_fraction": plan.warmup_fraction,
                             "tune_seeds": plan.tune_seeds, "final_seeds": plan.final_seeds, "size": plan.sizes[SIZE]},
                    "margin": MARGIN, "tuning": _tuning(state)}  # fmt: skip
    finals = {}
    for v, st in state.items():
        if st["best"] is None:
            continue
        runs = {s: measures.get(lm.Run(SIZE, plan.steps[0], v, st["best"], s).name) for s in range(plan.final_seeds)}
        runs = {s: m for s, m in runs.items() if m is not None}
        finals[v] = {"lr": st["best"], "losses": {s: m["val"]["loss"] for s, m in runs.items()},
                     "curves": {s: m["curve"] for s, m in runs.items()}}  # fmt: skip
    result["finals"] = finals
    names = {r.name for r in lm_norm.tune_runs(plan, state)}
    names |= {lm.Run(SIZE, plan.steps[0], v, st["best"], s).name
              for v, st in state.items() if st["best"] is not None for s in range(plan.final_seeds)}  # fmt: skip
    # fsum: exact, so the same whatever the set's order (string hashes differ between processes)
    result["run_hours"] = math.fsum(measures[n].get("train_seconds", 0.0) for n in names if n in measures) / 3600
    timings = read_json_object(out / lm.TIMINGS) if (out / lm.TIMINGS).is_file() else {}
    result["machine_hours"] = {k: v / 3600 for k, v in timings.items() if k.startswith("norm-")}
    complete = [v for v, f in finals.items() if len(f["losses"]) == plan.final_seeds]
    result["complete"] = complete
    family = [c for c in CONTRASTS if c[0] in complete and c[1] in complete]
    result["contrasts"] = stats.contrasts(family, {v: finals[v]["losses"] for v in complete}, MARGIN, ALPHA)
    if "standard" in complete:
        total = plan.steps[0] * plan.seq_len * plan.batch_size
        result["token_fractions"] = {
            v: token_fraction(finals[v]["curves"], finals["standard"]["curves"], total) for v in complete
        }
    return result


def _tuning(state: dict) -> dict:
    return {
        v: {
            "rates": st["rates"],
            "losses": {f"{lr:g}": xs for lr, xs in st["losses"].items()},
            "best": st["best"],
            "inside": st["best"] is not None and not st["at_edge"],
        }  # fmt: skip
        for v, st in state.items()
    }


# the text ----------------------------------------------------------------------------------------------------------
def markdown(result: dict) -> list[str]:
    plan = result["plan"]
    d, layers, heads = plan["size"]
    lines = [
        "## The per-head norm's initial scale (issue #49)",
        "",
        f"Width {d}, {layers} layers, {heads} standard heads ({heads // 2} differential), context {plan['seq_len']}, "
        f"{plan['steps']} steps of {plan['batch_size']} x {plan['seq_len']} tokens, warm-up "
        f"{plan['warmup_fraction']:.0%}. Every variant was tuned at this whole schedule ({plan['tune_seeds']} seeds "
        "per rate, rates a factor of 2 apart, extended until the best is inside); the tuning seeds' runs at the best "
        f"rate are the first {plan['tune_seeds']} of its {plan['final_seeds']} final seeds.",
        "",
        f"Training{'' if len(result['complete']) == len(result['tuning']) else ' so far'}: "
        f"{result['run_hours']:.1f} run-hours (the grid's runs, those reused from another part "
        f"included){_machine_time(result['machine_hours'])}. The issue's second size (3 times the parameters) "
        f"does not fit its {BUDGET_HOURS:g}-hour budget beside this grid on this machine and was cut (`lm_norm`'s "
        "docstring has the arithmetic).",
        "",
        "### Tuning",
        "",
        "| variant | validation loss by peak learning rate (mean of the seeds) | best | inside the grid |",
        "|---|---|---|---|",
    ]
    for v, st in result["tuning"].items():
        cells = ", ".join(f"{lr}: {statistics.fmean(xs):.4f}" + ("" if len(xs) == plan["tune_seeds"] else " (part)")
                          for lr, xs in sorted(st["losses"].items(), key=lambda kv: float(kv[0])))  # fmt: skip
        best = "-" if st["best"] is None else f"{st['best']:g}"
        lines.append(f"| {LABELS[v]} | {cells or '-'} | {best} | {'yes' if st['inside'] else 'no'} |")
    lines += ["", "### Final runs", ""]
    finals = result["finals"]
    if not finals:
        return [*lines, "None yet."]
    lines += ["| variant | rate | seeds | validation loss (mean, 95% interval) |", "|---|---|---|---|"]
    for v, row in finals.items():
        xs = [row["losses"][s] for s in sorted(row["losses"])]
        m, low, high = stats.t_interval(xs)
        iv = f"{m:.4f} ({low:.4f} to {high:.4f})" if len(xs) > 1 else f"{m:.4f}"
        lines.append(f"| {LABELS[v]} | {row['lr']:g} | {len(xs)} | {iv} |")
    if result["contrasts"]:
        n = len(result["contrasts"])
        lines += [
            "",
            f"### Contrasts (one family of {n}, Holm-adjusted)",
            "",
            "Paired over seeds (the same seed: the same data order and initialisation of the shared layers). Each "
            "interval is at the level of its contrast's step in Holm's procedure (95% adjusted: it excludes zero "
            'exactly when the contrast is called lower or higher); "equivalent" needs the two one-sided tests '
            f"(TOST) at the margin of +-{result['margin']:g} nats (the paper's DIFF - Transformer gap at 1.4B) to "
            "reject after Holm's adjustment; otherwise the contrast is not distinguishable within the larger bound "
            "of its interval. Bonferroni's simultaneous intervals are in results.json (`simultaneous`).",
            "",
            "| contrast | question | difference (Holm-adjusted 95% interval) | p (= 0), Holm | p (TOST), Holm | says |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["contrasts"]:
            lines.append(
                f"| {LABELS[r['first']]} - {LABELS[r['second']]} | {r['question']} | {r['mean']:+.4f} "
                f"({r['low']:+.4f} to {r['high']:+.4f}) | {r['p_zero_holm']:.3f} | {r['p_tost_holm']:.3f} | "
                f"{r['verdict']} |"
            )
    if result.get("token_fractions"):
        lines += ["", "Tokens to reach the standard model's final loss (same seed), as a fraction of the budget:", ""]
        for v, fr in result["token_fractions"].items():
            if v == "standard":
                continue
            iv = fr["interval"]
            missed, n = sum(f is None for f in fr["by_seed"]), len(fr["by_seed"])
            text = f"{iv[0]:.0%} ({iv[1]:.0%} to {iv[2]:.0%})" if iv else f"not reached on {missed} of {n} seeds"
            lines.append(f"- {LABELS[v]}: {text}")
    return lines


def _machine_time(hours: dict[str, float]) -> str:
    if not hours:
        return ""
    stages = ", ".join(f"{k.removeprefix('norm-')} {h:.1f} h" for k, h in hours.items())
    return (f"; the machine's wall clock, two runs at a time: {stages}, {sum(hours.values()):.1f} of the issue's "
            f"{BUDGET_HOURS:g} hours")  # fmt: skip


def summary(norm: dict | None, where: str, indent: str = "") -> list[str]:
    """The norm part's answer when it is complete: DIFF V1 as published and with the matched gain (and DIFF V2 with
    matched parameters, when measured), each against the standard model with its Holm-adjusted interval and what the
    contrast may say (equivalent, higher, lower or not distinguishable), for `make demo` and `difftx presets`, and
    the advice to start a small V1's norm at the matched gain when the rule's contrast within V1 says lower; none
    until both V1 contrasts are measured."""
    rows = {(r["first"], r["second"]): r for r in (norm or {}).get("contrasts", [])}
    shown = (("diff", "DIFF V1 as published"), ("diff-matched", "DIFF V1 with the matched gain"))
    if not all((v, "standard") in rows for v, _ in shown):
        return []
    if ("diff_v2-matched", "standard") in rows:
        shown += (("diff_v2-matched", "DIFF V2 with the standard model's parameter count"),)
    plan = norm["plan"]
    d, layers, heads = plan["size"]
    lines = [
        f"{indent}per-head norm part (`--part norm`, {where}): width {d}, {layers} layers, {heads // 2} differential "
        f"head{'s' if heads // 2 > 1 else ''}, "
        f"{plan['steps']} steps, {plan['final_seeds']} seeds, every model tuned at that whole schedule; final "
        f"validation loss against the standard model (95% intervals, Holm-adjusted over the part's "
        f"{len(rows)} contrasts):"
    ]
    for v, label in shown:
        r = rows[v, "standard"]
        lines.append(f"{indent}  {label} (learning rate {norm['finals'][v]['lr']:g}): {r['mean']:+.4f} nats "
                     f"({r['low']:+.4f} to {r['high']:+.4f}): {r['verdict']}")  # fmt: skip
    if rows.get(("diff-matched", "diff"), {}).get("verdict") == "lower":  # the rule helps V1 where it was measured
        lines.append(
            f"{indent}  so start a small DIFF V1 model's per-head norm at the matched gain where the paper's weight 1 "
            'is above it (difftx presets --gains): head_norm_gain = "matched" in a config\'s [model] table, as '
            "configs/tiny.toml and configs/small.toml do; measured at this one size, the default stays the paper's 1"
        )
    return lines


# the figures -------------------------------------------------------------------------------------------------------
def plot(result: dict, out: Path) -> None:
    if any(st["losses"] for st in result["tuning"].values()):
        _plot_tuning(result, out / FIGURES[0])
    if result["complete"]:
        _plot_curves(result, out / FIGURES[1])


def _plot_tuning(result: dict, path: Path) -> None:
    """One panel per variant, each on its own loss scale (a shared one squeezes the differences that decide)."""
    plt = figures.pyplot()
    variants = list(result["tuning"])
    cols = 4
    rows = math.ceil(len(variants) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(13, 3.2 * rows), squeeze=False)
    for ax, v in zip(axes.flat, variants, strict=False):
        st = result["tuning"][v]
        rates = report.plot_rates(ax, st["losses"], COLORS[v], LABELS[v], 5)
        if rates and st["best"] is not None:
            ax.axvline(st["best"], color="k", lw=0.6, ls=":")
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates], rotation=45)
        ax.minorticks_off()
        ax.set_title(LABELS[v], fontsize=9)
    for ax in axes.flat[len(variants) :]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("validation loss (nats)")
    for column in range(cols):  # the lowest panel of each column that is drawn
        shown = [ax for ax in axes[:, column] if ax.get_visible()]
        if shown:
            shown[-1].set_xlabel("peak learning rate")
    figures.finish(fig, path, f"tuning at the whole budget ({result['plan']['steps']} steps): mean (dots: seeds; "
                   "dotted: best)")  # fmt: skip


def _plot_curves(result: dict, path: Path) -> None:
    """Loss against tokens from the first quarter on, and each variant minus standard with its interval, on a scale
    set by the differences after that quarter; a gap larger than ``LARGE_GAP`` gets a panel of its own, so that it
    does not squeeze the small ones (where the contested range lies)."""
    plt = figures.pyplot()
    finals = {v: result["finals"][v] for v in result["complete"]}
    total = result["plan"]["steps"] * result["plan"]["seq_len"] * result["plan"]["batch_size"]
    start = total / 4
    bands = {}
    if "standard" in finals:
        for v, row in finals.items():
            if v != "standard":
                bands[v] = [g for g in gap_curve(row["curves"], finals["standard"]["curves"]) if g[0] >= start]
    large = [v for v, band in bands.items() if max(abs(g[1]) for g in band) > LARGE_GAP]
    panels = [[v for v in bands if v not in large], large]
    panels = [vs for vs in panels if vs]
    fig, axes = plt.subplots(1, 1 + len(panels), figsize=(6.5 * (1 + len(panels)), 4.6), squeeze=False)
    ax0 = axes[0, 0]
    lows, highs = [], []
    for v, row in finals.items():
        mean = [m for m in curve_mean(list(row["curves"].values())) if m[0] >= start]
        ax0.plot([m[0] for m in mean], [m[1] for m in mean], color=COLORS[v], lw=2, label=LABELS[v])
        lows.append(min(m[1] for m in mean))
        highs.append(max(m[1] for m in mean))
    ax0.set(xlabel="training tokens", ylabel="validation loss (nats), mean of the seeds",
            ylim=(min(lows) - 0.02, max(highs) + 0.02))  # fmt: skip
    for ax, variants in zip(axes[0, 1:], panels, strict=True):
        ys = []
        for v in variants:
            band = bands[v]
            points = [g[0] for g in band]
            ax.plot(points, [g[1] for g in band], color=COLORS[v], lw=2)
            ax.fill_between(points, [g[2] for g in band], [g[3] for g in band], color=COLORS[v], alpha=0.12)
            ys += [y for g in band for y in g[1:]]
        ax.axhline(0, color="k", lw=0.8)
        ax.set_ylim(min(*ys, 0) - 0.01, max(*ys, 0) + 0.01)
        which = f"gaps above {LARGE_GAP:g} nats" if variants is large else "the smaller gaps"
        ax.set(xlabel="training tokens", ylabel="minus standard (nats; band: pointwise 95% interval)", title=which)
    figures.finish(fig, path, f"validation loss from a quarter of the budget on, {result['plan']['final_seeds']} seeds")


assert set(COLORS) >= set(NORM_VARIANTS)
