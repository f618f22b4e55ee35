"""The language-model study's report: results.json, section.md and figures from the measured runs.

Every section is written from the runs measured so far, so a study with only some parts done still reports them.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import statistics
from pathlib import Path

from difftransformer.apps import figures
from difftransformer.apps.repro import lm_long_report, lm_norm, lm_norm_report, report
from difftransformer.apps.repro.lm import (
    ABLATIONS,
    STUDY,
    TIMINGS,
    Run,
    Scale,
    ablation_runs,
    best_lrs,
    grid_runs,
    read_measures,
    sweep_runs,
)
from difftransformer.apps.repro.report import percent
from difftransformer.apps.repro.scaling import fit_power_law, fraction_needed
from difftransformer.apps.repro.stats import t_interval
from difftransformer.errors import InputError
from difftransformer.fsutil import read_json_object, write_json

PAPER = {
    "parameter_fraction": 0.622,  # 6.8B DIFF matches an 11B Transformer (Figure 3a)
    "token_fraction": 0.637,  # 3B DIFF at 160B tokens matches the Transformer at 251B (Figure 3b)
    "ablations_1.4b": {  # Table 6, validation loss
        "standard": 3.087,
        "diff": 3.062,
        "diff-no-head-norm": 3.122,
        "diff-lambda-0.8": 3.065,
        "diff-lambda-0.5": 3.066,
    },
}
LABELS = {
    "diff": "DIFF",
    "standard": "standard",
    "diff_v2": "DIFF V2",
    "diff-no-head-norm": "DIFF without the per-head norm",
    "diff-lambda-0.8": "DIFF, constant lambda_init 0.8",
    "diff-lambda-0.5": "DIFF, constant lambda_init 0.5",
    "standard-head-norm": "standard with the per-head norm",
    "diff-all-heads": "DIFF with as many heads as standard (half the head size)",
}
PAIR = ("diff", "standard")


def _loss(measures: dict, run: Run, key: str = "loss") -> float | None:
    m = measures.get(run.name)
    return None if m is None else m["val"][key]


def analyse(scale: Scale, seeds: list[int], measures: dict[str, dict]) -> dict:
    """The numbers of every complete part (a part with a missing run is reported as incomplete)."""
    result: dict = {"experiment": "lm", "scale": dataclasses.asdict(scale), "seeds": seeds, "paper": PAPER}
    sweep = sweep_runs(scale)
    like_sweep = [Run(**m["run"]) for m in measures.values()]  # the sweep's runs, and any at other rates
    result["sweep"] = [
        {"variant": r.variant, "lr": r.lr, "loss": _loss(measures, r), "in_plan": r.lr in scale.lrs}
        for r in sorted(like_sweep)
        if (r.size, r.steps, r.seed) == (scale.reference, scale.steps[0], 0) and r.variant in PAIR
    ]
    if any(r.name not in measures for r in sweep):
        result["incomplete"] = ["sweep", "grid", "ablations"]
        return result
    best = best_lrs(scale, measures)
    result["best_lr"] = best
    result["best_at_edge"] = {a: lr in (min(scale.lrs), max(scale.lrs)) for a, lr in best.items()}
    result["incomplete"] = []
    grid = grid_runs(scale, best, seeds)
    if all(r.name in measures for r in grid):
        result.update(_grid(scale, seeds, best, measures))
    else:
        result["incomplete"].append("grid")
    ablations = ablation_runs(scale, best, seeds)
    if all(r.name in measures for r in ablations):
        result["ablations"] = _ablations(scale, seeds, best, measures)
        if "grid" not in result["incomplete"]:
            result["token_fraction_reference"] = _token_fraction_seeds(scale, seeds, best, measures)
    else:
        result["incomplete"].append("ablations")
    return result


def _point(measures: dict, run: Run) -> dict:
    m = measures[run.name]
    return {
        "size": run.size,
        "steps": run.steps,
        "tokens": m["tokens"],
        "variant": run.variant,
        "seed": run.seed,
        "lr": run.lr,
        "non_embedding": m["non_embedding"],
        "parameters": m["parameters"],
        **{k: m["val"][k] for k in ("loss", "recall_loss", "other_loss", "recall_tokens", "other_tokens")},
        "seconds_per_step": m.get("seconds_per_step"),
    }


def _grid(scale: Scale, seeds: list[int], best: dict, measures: dict) -> dict:
    hi, lo = scale.steps
    ref = scale.reference
    points = [_point(measures, r) for r in grid_runs(scale, best, seeds)]

    def pick(size, steps, variant, seed=0):
        return measures[Run(size, steps, variant, best[variant], seed).name]

    fits = {}
    for steps in (hi, lo):
        per_seed = []
        for seed in seeds if steps == hi else seeds[:1]:
            curves = {}
            for a in PAIR:
                xs = [pick(s, steps, a)["non_embedding"] for s in scale.sizes]
                ys = [pick(s, steps, a, seed if s == ref else 0)["val"]["loss"] for s in scale.sizes]
                curves[a] = fit_power_law(xs, ys)
            sizes_n = {s: pick(s, steps, "standard")["non_embedding"] for s in scale.sizes}
            at_size = {s: fraction_needed(curves["diff"], curves["standard"], n) for s, n in sizes_n.items()}
            per_seed.append((curves, at_size, at_size[list(scale.sizes)[-1]]))
        curves, at_size, _ = per_seed[0]
        tops = [p[2] for p in per_seed]
        fits[str(steps)] = {
            "fit": {a: dataclasses.asdict(curves[a]) for a in PAIR},
            "fraction_at_size": at_size,
            "fraction_at_top_by_seed": tops,
            "fraction_at_top": t_interval(tops) if all(math.isfinite(t) for t in tops) else None,
        }
    token_fits = {}
    for size in scale.sizes:
        curves = {a: fit_power_law([pick(size, st, a)["tokens"] for st in (hi, lo)],
                                   [pick(size, st, a)["val"]["loss"] for st in (hi, lo)]) for a in PAIR}  # fmt: skip
        token_fits[size] = {
            "fit": {a: dataclasses.asdict(curves[a]) for a in PAIR},
            "fraction": fraction_needed(curves["diff"], curves["standard"], hi * scale.tokens_per_step),
        }
    diffs = [pick(ref, hi, "diff", s)["val"]["loss"] - pick(ref, hi, "standard", s)["val"]["loss"] for s in seeds]
    positions = {a: [pick(ref, hi, a, s)["per_position"] for s in seeds] for a in PAIR}
    v2 = measures[Run(ref, hi, "diff_v2", best["diff"], 0).name]
    return {
        "grid": points,
        "param_fits": fits,
        "token_fits": token_fits,
        "paired": {"differences": diffs, "interval": t_interval(diffs)},
        "per_position": {
            "bucket": 32,
            "documents": pick(ref, hi, "diff")["documents"],
            "curves": positions,
            "difference": [
                [d - s for d, s in zip(dc, sc, strict=True)]
                for dc, sc in zip(positions["diff"], positions["standard"], strict=True)
            ],
        },
        "diff_v2": {"loss": v2["val"]["loss"], "lr": best["diff"], "seed": 0},
    }


def _ablations(scale: Scale, seeds: list[int], best: dict, measures: dict) -> list[dict]:
    lo = scale.steps[1]
    rows = []
    for variant in ("standard", "diff", *ABLATIONS):
        runs = [Run(scale.reference, lo, variant, best[_family(variant)], s) for s in seeds]
        base = [Run(scale.reference, lo, "diff", best["diff"], s) for s in seeds]
        losses = [measures[r.name]["val"]["loss"] for r in runs]
        vs_diff = [a - measures[b.name]["val"]["loss"] for a, b in zip(losses, [r for r in base], strict=True)]
        rows.append(
            {
                "variant": variant,
                "lr": runs[0].lr,
                "losses": losses,
                "recall": [measures[r.name]["val"]["recall_loss"] for r in runs],
                "other": [measures[r.name]["val"]["other_loss"] for r in runs],
                "minus_diff": vs_diff,
                "interval_minus_diff": t_interval(vs_diff),
                "non_embedding": measures[runs[0].name]["non_embedding"],
                "paper": PAPER["ablations_1.4b"].get(variant),
            }
        )
    return rows


def _family(variant: str) -> str:
    from difftransformer.apps.repro.lm import VARIANTS

    return VARIANTS[variant][2]


def _token_fraction_seeds(scale: Scale, seeds: list[int], best: dict, measures: dict) -> dict:
    """At the reference size, per seed: the fraction of the long budget's tokens DIFF needs to reach the standard
    model's loss there (two budgets per seed: the grid's long runs and the ablation baselines' short ones)."""
    hi, lo = scale.steps
    fractions = []
    for seed in seeds:
        curves = {}
        for a in PAIR:
            runs = [Run(scale.reference, st, a, best[a], seed) for st in (hi, lo)]
            curves[a] = fit_power_law([measures[r.name]["tokens"] for r in runs],
                                      [measures[r.name]["val"]["loss"] for r in runs])  # fmt: skip
        fractions.append(fraction_needed(curves["diff"], curves["standard"], hi * scale.tokens_per_step))
    finite = all(math.isfinite(f) for f in fractions)
    return {"by_seed": fractions, "interval": t_interval(fractions) if finite else None}


# writing -----------------------------------------------------------------------------------------------------------
def write(out: Path, scale: Scale, seeds: list[int], measures: dict[str, dict]) -> dict:
    """results.json, section.md and the figures of the study in ``out``: the short-budget parts and, when ``out``
    holds them, the long part (``lm_long_report``) and the norm part (``lm_norm_report``)."""
    result = analyse(scale, seeds, measures)
    timings = out / TIMINGS
    result["minutes"] = {k: v / 60 for k, v in read_json_object(timings).items()} if timings.is_file() else {}
    return _write_parts(out, result, markdown(result), measures)


def _write_parts(out: Path, result: dict, text: str, measures: dict[str, dict]) -> dict:
    """The long and norm parts that ``out`` holds added to ``result`` and ``text``; then the figures, results.json
    and section.md."""
    for key, part in (("long", lm_long_report), ("norm", lm_norm_report)):
        numbers = part.analyse(out, measures)
        if numbers is not None:
            result[key] = numbers
            text += ("\n" if text else "") + "\n".join(part.markdown(numbers))
    draw(result, out)
    write_json(out / "results.json", result)
    (out / "section.md").write_text(text)
    return result


def write_study(out: Path) -> dict:
    """The report of whatever study ``out`` holds: with the short-budget parts' plan (STUDY) as ``write``, else the
    long and norm parts it holds alone."""
    measures = read_measures(out)
    if (out / STUDY).is_file():
        record = read_json_object(out / STUDY)
        return write(out, Scale.from_record(record["scale"]), record["seeds"], measures)
    return _write_parts(out, {"experiment": "lm"}, "", measures)


def _interval(iv, fmt: str) -> str:
    return report.interval(iv, fmt, "95% t-interval ")


def markdown(result: dict) -> str:
    sc = result["scale"]
    hi, lo = sc["steps"]
    tps = sc["seq_len"] * sc["batch_size"]
    lines = [
        "## Language modeling: scaling, long context, recall slices, ablations",
        "",
        f"Scale `{sc['name']}`: sizes (d_model, layers, standard heads) "
        + ", ".join(f"{k} {tuple(v)}" for k, v in sc["sizes"].items())
        + f"; context {sc['seq_len']}, {sc['batch_size']} sequences per step ({tps:,} tokens); budgets {hi} and {lo} "
        f"steps ({hi * tps / 1e6:.2f}M and {lo * tps / 1e6:.2f}M tokens); BPE vocabulary {sc['vocab_size']}; AdamW "
        f"betas {tuple(sc['betas'])}, weight decay {sc['weight_decay']}, warmup {sc['warmup_fraction']:.0%} then "
        f"cosine to 10%. Seeds {result['seeds']} at size {sc['reference']}. Validation: {sc['eval_tokens']:,} tokens "
        "of held-out documents (no document is on both sides). Wall-clock: "
        + (", ".join(f"{k} {v:.0f} min" for k, v in result.get("minutes", {}).items()) or "-")
        + ".",
        "",
    ]
    if result["sweep"]:
        lines += ["### Learning-rate sweep", "", f"Size {sc['reference']}, {hi} steps, seed 0. Validation loss:", ""]
        lrs = sorted({r["lr"] for r in result["sweep"]})
        lines += ["| model | " + " | ".join(f"lr {x:g}" for x in lrs) + " |", "|---|" + "---|" * len(lrs)]
        for a in PAIR:
            by = {r["lr"]: r["loss"] for r in result["sweep"] if r["variant"] == a}
            cells = ["-" if x not in by else "diverged" if math.isinf(by[x]) else f"{by[x]:.4f}" for x in lrs]
            lines.append(f"| {LABELS[a]} | " + " | ".join(cells) + " |")
        extra = sorted({r["lr"] for r in result["sweep"] if not r["in_plan"]})
        if extra:
            lines += ["", f"Not in this scale's sweep (runs of an earlier plan, kept in the study), shown but not used "
                          f"to choose: lr {', '.join(f'{x:g}' for x in extra)}."]  # fmt: skip
        if "best_lr" in result:
            lines += ["", "Best: " + ", ".join(f"{LABELS[a]} {lr:g}" for a, lr in result["best_lr"].items()) + "."]
            edge = [LABELS[a] for a, e in result["best_at_edge"].items() if e]
            if edge:
                lines.append(f"The best rate of {', '.join(edge)} is at the edge of the sweep: a wider one could do "
                             "better.")  # fmt: skip
        lines.append("")
    if "grid" in result:
        lines += _grid_markdown(result, sc)
    if "ablations" in result:
        lines += _ablation_markdown(result, sc)
    if result.get("incomplete"):
        lines += [f"Not yet run (or not complete): {', '.join(result['incomplete'])}.", ""]
    lines += ["Figures: `lm_*.png` beside this report.", ""]
    return "\n".join(lines)


def _grid_markdown(result: dict, sc: dict) -> list[str]:
    hi, lo = sc["steps"]
    lines = [
        "### Loss against size and tokens (seed 0; the reference size's long budget: mean of the seeds)",
        "",
        "| size | non-embedding params (DIFF / standard) | steps | DIFF | standard | DIFF - standard |",
        "|---|---|---|---|---|---|",
    ]
    grid = result["grid"]
    for size in sc["sizes"]:
        for steps in (hi, lo):
            row = {a: [p for p in grid if p["size"] == size and p["steps"] == steps and p["variant"] == a]
                   for a in PAIR}  # fmt: skip
            loss = {a: report.mean([p["loss"] for p in row[a]]) for a in PAIR}
            lines.append(
                f"| {size} | {row['diff'][0]['non_embedding']:,} / {row['standard'][0]['non_embedding']:,} | {steps} | "
                f"{loss['diff']:.4f} | {loss['standard']:.4f} | {loss['diff'] - loss['standard']:+.4f} |"
            )
    v2 = result["diff_v2"]
    lines += ["", f"DIFF V2 at {sc['reference']}, {hi} steps, seed 0, lr {v2['lr']:g} (DIFF's): {v2['loss']:.4f}.", ""]
    speed = []
    for size in sc["sizes"]:
        per = {a: [p["seconds_per_step"] for p in grid if p["size"] == size and p["variant"] == a
                   and p["seconds_per_step"]] for a in PAIR}  # fmt: skip
        if all(per.values()):
            d, s = (statistics.median(per[a]) for a in PAIR)
            speed.append(f"{size} {d:.2f} vs {s:.2f} s ({d / s:.2f}x)")
    lines += [
        "Seconds per step, DIFF vs standard (medians over the size's runs; one thread each, two runs at a time on "
        "a shared 2-core machine, so only roughly comparable): "
        + ("; ".join(speed) or "-")
        + ". The losses above are at "
        "equal steps and tokens; at equal time DIFF would have fewer steps.",
        "",
    ]
    top = list(sc["sizes"])[-1]
    fit = result["param_fits"][str(hi)]
    f = fit["fit"]
    lines += [
        f"Fits L = a N^-b over non-embedding parameters N ({hi} steps): DIFF a={f['diff']['a']:.3f} "
        f"b={f['diff']['b']:.4f}; standard a={f['standard']['a']:.3f} b={f['standard']['b']:.4f}.",
        "",
    ]
    if falls_with_size(fit):
        lines += [
            f"**Parameter fraction**: the share of the standard model's parameters DIFF needs for the standard "
            f"model's loss, at size {top}: {_interval(fit['fraction_at_top'], '{:.1%}')} over the seeds of size "
            f"{sc['reference']} (by seed: {', '.join(percent(x) for x in fit['fraction_at_top_by_seed'])}); at each "
            f"size (seed 0): "
            + ", ".join(f"{k} {percent(v)}" for k, v in fit["fraction_at_size"].items())
            + f". Paper: {percent(PAPER['parameter_fraction'])} (6.8B vs 11B). Above 100% means DIFF needs more.",
            "",
        ]
    else:
        lines += [
            f"**Parameter fraction**: not read. At {hi} steps the fits above do not both fall with size, so the "
            f"share of parameters they would give means nothing (below). Paper: "
            f"{percent(PAPER['parameter_fraction'])} (6.8B vs 11B).",
            "",
        ]
    lines += [
        "**Token fraction**: the share of the long budget's tokens DIFF needs for the standard model's loss after "
        "the long budget (two budgets per curve, so the power law interpolates between them and extrapolates beyond): "
        + ", ".join(f"{k} {percent(v['fraction'])}" for k, v in result["token_fits"].items())
        + " (seed 0)"
        + _token_seeds(result, sc)
        + f". Paper: {percent(PAPER['token_fraction'])} (3B, 160B vs 251B tokens).",
        "",
    ]
    for steps, fit_ in result["param_fits"].items():
        flat = [LABELS[a] for a in PAIR if fit_["fit"][a]["b"] <= 0]
        if flat:
            lines += [f"At {steps} steps the loss of {' and '.join(flat)} does not fall with size (fitted exponent "
                      "b <= 0): this budget is too small for the larger models, and no parameter fraction can be read "
                      "from it.", ""]  # fmt: skip
    p = result["paired"]
    lines += [
        f"**Paired difference** at {sc['reference']}, {hi} steps (DIFF - standard validation loss, same seed): "
        + ", ".join(f"{d:+.4f}" for d in p["differences"])
        + f"; mean {_interval(p['interval'], '{:+.4f}')}.",
        "",
    ]
    ref_rows = [x for x in grid if x["size"] == sc["reference"] and x["steps"] == hi and x["variant"] in PAIR]
    lines += [
        f"**Recall slices** at {sc['reference']}, {hi} steps (mean over seeds): a recall hit is a token whose "
        "preceding 2 tokens, followed by it, already occurred earlier in the window.",
        "",
        "| model | all | recall hits | others | share of hits |",
        "|---|---|---|---|---|",
    ]
    for a in PAIR:
        rows = [x for x in ref_rows if x["variant"] == a]
        share = report.mean([x["recall_tokens"] / (x["recall_tokens"] + x["other_tokens"]) for x in rows])
        cells = [report.mean([x[k] for x in rows]) for k in ("loss", "recall_loss", "other_loss")]
        lines.append(f"| {LABELS[a]} | " + " | ".join(f"{c:.4f}" for c in cells) + f" | {share:.1%} |")
    pp = result["per_position"]
    lines += ["", _positions_summary(pp, sc), ""]
    return lines


def falls_with_size(fit: dict) -> bool:
    """Whether both architectures' loss falls with size in a budget's fits (exponent b > 0): only then can a
    parameter fraction be read from them, or their curves be drawn."""
    return all(fit["fit"][a]["b"] > 0 for a in PAIR)


def _token_seeds(result: dict, sc: dict) -> str:
    seeded = result.get("token_fraction_reference")
    if not seeded:
        return ""
    return f"; at {sc['reference']} over the seeds {_interval(seeded['interval'], '{:.1%}')}"


def _positions_summary(pp: dict, sc: dict) -> str:
    diffs = pp["difference"]
    if not diffs or not diffs[0]:
        return "**Per-position loss**: no validation document is long enough."
    n = len(diffs[0])
    mean = [report.mean([d[i] for d in diffs]) for i in range(n)]
    below = sum(m < 0 for m in mean)
    q = max(1, n // 4)
    return (
        f"**Per-position loss** over {pp['documents']} validation documents of at least {sc['seq_len'] + 1} tokens, "
        f"positions 0-{sc['seq_len'] - 1} of each document, buckets of {pp['bucket']}: DIFF - standard (mean of the "
        f"seeds) is below zero in {below} of {n} buckets; first quarter {report.mean(mean[:q]):+.4f}, last quarter "
        f"{report.mean(mean[-q:]):+.4f} nats. Paper (Figure 4, 64K-token books): DIFF lower at every position."
    )


def _ablation_markdown(result: dict, sc: dict) -> list[str]:
    lines = [
        f"### Ablations (the paper's Table 6) at {sc['reference']}, {sc['steps'][1]} steps, seeds {result['seeds']}",
        "",
        "| model | lr | validation loss | minus DIFF (paired) | recall hits | others | non-embedding params | "
        "paper (1.4B) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["ablations"]:
        lines.append(
            f"| {LABELS[row['variant']]} | {row['lr']:g} | {report.mean_std(row['losses'], 4)} | "
            f"{_interval(row['interval_minus_diff'], '{:+.4f}') if row['variant'] != 'diff' else '-'} | "
            f"{report.mean(row['recall']):.4f} | {report.mean(row['other']):.4f} | {row['non_embedding']:,} | "
            f"{row['paper'] if row['paper'] is not None else '-'} |"
        )
    lines.append("")
    return lines


def draw(result: dict, out: Path) -> None:
    """The study's figures from its result: the grid's scaling and positions, the sweep, and the long part's."""
    if "grid" in result:
        _plot_scaling(result, out)
        _plot_positions(result, out)
    if result.get("sweep"):
        _plot_sweep(result, out)
    if result.get("long") is not None:
        lm_long_report.plot(result["long"], out)
    if result.get("norm") is not None:
        lm_norm_report.plot(result["norm"], out)


def _plot_scaling(result: dict, out: Path) -> None:
    """Loss against size (power-law fits) and against tokens: colour is the architecture, line style the budget and
    marker the size, each said once in the legend."""
    from matplotlib.lines import Line2D

    plt = figures.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    hi, lo = result["scale"]["steps"]  # the study's Scale, as saved
    styles, markers = {hi: "-", lo: "--"}, dict(zip(result["scale"]["sizes"], "osd", strict=False))
    for steps, style in styles.items():
        fit = result["param_fits"][str(steps)]["fit"]
        for a in PAIR:
            pts = [p for p in result["grid"] if p["steps"] == steps and p["variant"] == a and p["seed"] == 0]
            xs = [p["non_embedding"] for p in pts]
            for p in pts:
                axes[0].plot(p["non_embedding"], p["loss"], markers.get(p["size"], "o"), color=figures.COLORS[a])
            grid = [min(xs) * (max(xs) / min(xs)) ** (i / 40) for i in range(41)]
            if falls_with_size(result["param_fits"][str(steps)]):  # else the report reads no fit: none is drawn
                axes[0].plot(grid, [fit[a]["a"] * x ** -fit[a]["b"] for x in grid], style, color=figures.COLORS[a])
            else:  # the points joined, thin, to show which belong together
                axes[0].plot(xs, [p["loss"] for p in pts], style, color=figures.COLORS[a], lw=0.6, alpha=0.6)
    drawn = [s for s in styles if falls_with_size(result["param_fits"][str(s)])]
    axes[0].set(xscale="log", xlabel="non-embedding parameters", ylabel="validation loss (nats per token)")
    fits = f"lines: power-law fits at {', '.join(map(str, drawn))} steps" if drawn else "no fit: loss does not fall"
    axes[0].set_title(f"loss against size ({fits})", fontsize=10)
    figures.readable_log_axis(axes[0])
    for size, marker in markers.items():
        for a in PAIR:
            pts = sorted((p["tokens"], p["loss"]) for p in result["grid"]
                         if p["size"] == size and p["variant"] == a and p["seed"] == 0)  # fmt: skip
            axes[1].plot(*zip(*pts, strict=True), marker + "-", color=figures.COLORS[a])
    axes[1].set(xscale="log", xlabel="training tokens", ylabel="validation loss (nats per token)")
    axes[1].set_title("loss against tokens, by size", fontsize=10)
    figures.readable_log_axis(axes[1])
    key = [Line2D([], [], color=figures.COLORS[a], label=LABELS[a]) for a in PAIR]
    key += [Line2D([], [], color="0.4", ls=style, label=f"{steps} steps") for steps, style in styles.items()]
    key += [Line2D([], [], color="0.4", ls="", marker=m, label=f"size {size}") for size, m in markers.items()]
    for handle in key:  # the legend's entries, drawn nowhere: finish() collects them from the axes
        axes[1].add_line(handle)
    figures.finish(fig, out / "lm_scaling.png", "language modeling: DIFF vs standard (seed 0)")


def _plot_positions(result: dict, out: Path) -> None:
    pp = result["per_position"]
    if not pp["difference"] or not pp["difference"][0]:
        return
    plt = figures.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    b = pp["bucket"]
    for a in PAIR:
        for i, curve in enumerate(pp["curves"][a]):
            xs = [b * j + b / 2 for j in range(len(curve))]
            axes[0].plot(xs, curve, color=figures.COLORS[a], alpha=0.7, lw=1, label=LABELS[a] if i == 0 else None)
    axes[0].set(xlabel="position in the document", ylabel="loss (nats per token)", title="per-position loss, each seed")
    n = len(pp["difference"][0])
    xs = [b * j + b / 2 for j in range(n)]
    for curve in pp["difference"]:
        axes[1].plot(xs, curve, color="0.6", lw=0.8)
    axes[1].plot(xs, [report.mean([d[j] for d in pp["difference"]]) for j in range(n)], color="k", lw=1.5)
    axes[1].axhline(0, color="tab:red", lw=0.8)
    axes[1].set(xlabel="position in the document", ylabel="DIFF - standard", title="difference (grey: seeds)")
    figures.finish(fig, out / "lm_positions.png", "loss at each position of long documents")


def _plot_sweep(result: dict, out: Path) -> None:
    plt = figures.pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for a in PAIR:
        pts = sorted((r["lr"], r["loss"]) for r in result["sweep"] if r["variant"] == a)
        if pts:
            ax.plot(*zip(*pts, strict=True), "o-", color=figures.COLORS[a], label=LABELS[a])
    ax.set(xscale="log", xlabel="peak learning rate", ylabel="validation loss")
    lrs = sorted({r["lr"] for r in result["sweep"]})
    ax.set_xticks(lrs, [f"{x:g}" for x in lrs])
    ax.minorticks_off()
    figures.finish(fig, out / "lm_sweep.png", "validation loss against the peak learning rate")


def export(study: Path, dest: Path) -> dict:
    """The study's report without its models and data, into ``dest`` (for committing): the plan, the timings, every
    run's measurements and learning curve (curves/NAME.jsonl), then the report written from them. A study directory
    seeded with ``dest``'s measures/ skips those runs, so a study can continue on another machine.

    ``dest`` may hold another export: its timings are kept beside the study's (the study's win for the same part), and
    a plan, measure or curve it holds under a name the study also writes must be the study's to the byte, or nothing
    is written (a run of the same name trained by other code, a plan of another scale: export to another folder)."""
    plans = (STUDY, *lm_long_report.PLAN_FILES, lm_norm.NORM_PLAN)
    copies = {study / name: dest / name for name in plans if (study / name).is_file()}
    for name in read_measures(study):
        copies[study / "measures" / f"{name}.json"] = dest / "measures" / f"{name}.json"
        metrics = study / "runs" / name / "metrics.jsonl"
        if metrics.is_file():
            copies[metrics] = dest / "curves" / f"{name}.jsonl"
    clashes = [to for source, to in copies.items() if to.is_file() and to.read_bytes() != source.read_bytes()]
    if clashes:
        shown = ", ".join(str(p.relative_to(dest)) for p in clashes[:4]) + (" ..." if len(clashes) > 4 else "")
        raise InputError(
            f"{dest} already holds {len(clashes)} file(s) that differ from the study's under the same name ({shown}): "
            "they come from another study or other code; nothing was written. Export into another folder (or "
            "remove those files if the study's are meant to replace them)"
        )
    timings = {}
    for path in (dest / TIMINGS, study / TIMINGS):
        if path.is_file():
            timings.update(read_json_object(path))
    for folder in ("measures", "curves"):
        (dest / folder).mkdir(parents=True, exist_ok=True)
    for source, to in copies.items():
        shutil.copy2(source, to)
    if timings:
        write_json(dest / TIMINGS, timings)
    return write_study(dest)
