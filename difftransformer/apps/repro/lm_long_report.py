"""The long part's report (``difftx repro lm --part long``): its section of section.md, its part of results.json and
its figures, written from the plan files and the measured runs only."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path

from difftransformer.apps import figures
from difftransformer.apps.repro import lm, lm_long, report, stats
from difftransformer.apps.repro.lm_blocks import STATS
from difftransformer.apps.repro.lm_long import (
    DIAGNOSED,
    LONG,
    LONG_INIT,
    LONG_TIMING,
    LONG_VARIANTS,
    SIZE,
    UNTUNED,
    LongScale,
)
from difftransformer.apps.repro.report import interval
from difftransformer.core.model import count_parameters
from difftransformer.fsutil import read_json_object

PLAN_FILES = (LONG, LONG_INIT, LONG_TIMING)  # what an exported report keeps of the long part besides measures/
NEAR = 0.15  # nats: the curves figure zooms on the variants whose mean gap stays within this after a quarter
SUBNORMAL_BENCH = "benchmarks/results/subnormal_cpu-xeon-2core_2026-12-04/"  # the kernel's fix, measured

LABELS = {
    "standard": "standard",
    "diff": "DIFF V1",
    "diff-no-head-norm": "DIFF V1 without the per-head norm",
    "diff_v2-matched": "DIFF V2, matched (narrower FFN)",
    "diff_v2": "DIFF V2, unmatched (+8% parameters)",
    "standard-head-norm": "standard with the per-head norm",
    "diff-norm-gain": "DIFF V1, per-head norm at the matched initial gain (this library's option)",
}
SHORT = {
    "standard": "standard",
    "diff": "DIFF V1",
    "diff-no-head-norm": "V1 no norm",
    "diff_v2-matched": "V2 matched",
    "diff_v2": "V2 unmatched",
    "standard-head-norm": "standard + norm",
    "diff-norm-gain": "V1 norm gain",
}
COLORS = figures.COLORS  # the variants' colours: the same in every figure


# the numbers -------------------------------------------------------------------------------------------------------
def analyse(out: Path, measures: dict[str, dict]) -> dict | None:
    """The long part's results from ``out``'s plan files and ``measures``; None when ``out`` holds no long part."""
    if not (out / LONG).is_file():
        return None
    record = read_json_object(out / LONG)
    plan = LongScale.from_record(record["plan"])
    seeds = record["seeds"]
    result: dict = {"plan": record["plan"], "seeds": seeds, "incomplete": []}
    if not (out / LONG_INIT).is_file():
        result["incomplete"] = ["init", "tune", "long", "timing"]
        return result
    init = read_json_object(out / LONG_INIT)
    plan = dataclasses.replace(plan, options=lm_long.options_of(plan, init))
    result["init"] = init
    result["options"] = plan.options
    result["regime"] = _regime(plan, init["train_tokens"])
    state = lm_long.tuning(plan, measures)
    result["tuning"] = {
        v: {"rates": st["rates"], "losses": {f"{lr:g}": xs for lr, xs in st["losses"].items()}, "best": st["best"],
            "at_edge": st["at_edge"]}
        for v, st in state.items()
    }  # fmt: skip
    if not all(st["done"] for st in state.values()):
        result["incomplete"] += ["tune", "long", "timing"]
        return result
    rates = lm_long.best_rates(state)
    result["rates"] = rates
    timing = read_json_object(out / LONG_TIMING) if (out / LONG_TIMING).is_file() else None
    result["timing"] = timing
    runs = {v: [lm.Run(SIZE, plan.steps[0], v, rates[v], s) for s in seeds] for v in LONG_VARIANTS}
    if not all(r.name in measures for rs in runs.values() for r in rs):
        result["incomplete"] += ["long"] + ([] if timing else ["timing"])
        result["measured"] = sorted(r.name for rs in runs.values() for r in rs if r.name in measures)
        return result
    if timing is None:
        result["incomplete"].append("timing")
    long = {v: {s: measures[r.name] for s, r in zip(seeds, rs, strict=True)} for v, rs in runs.items()}
    result["variants"] = {v: _variant(v, long, plan, timing) for v in LONG_VARIANTS}
    result["blocks"] = _blocks(long, plan)
    result["explanation"] = _explanation(result)
    return result


def _regime(plan: LongScale, train_tokens: int) -> dict:
    d_model, n_layers, n_heads = plan.sizes[SIZE]
    tokens = plan.steps[0] * plan.tokens_per_step
    params = {}
    for v in LONG_VARIANTS:
        cfg = lm_long._config(plan, v)
        params[v] = {"non_embedding": count_parameters(cfg, exclude_embeddings=True),
                     "total": count_parameters(cfg), "ffn_dim": cfg.ffn_dim}  # fmt: skip
    return {
        "d_model": d_model,
        "n_layers": n_layers,
        "standard_heads": n_heads,
        "diff_heads": n_heads // 2,
        "head_size": d_model // n_heads,
        "tokens": tokens,
        "train_tokens": train_tokens,
        "passes": tokens / train_tokens,
        "parameters": params,
        "tokens_per_parameter": {v: tokens / p["non_embedding"] for v, p in params.items()},
    }


def curve_mean(curves: list[list[list[float]]]) -> list[list[float]]:
    """[tokens, mean loss] at the evaluation points every seed has."""
    points = set.intersection(*({c[1] for c in curve} for curve in curves))
    by = [{c[1]: c[2] for c in curve} for curve in curves]
    return [[t, statistics.fmean(b[t] for b in by)] for t in sorted(points)]


def tokens_to_reach(curve: list[list[float]], target: float) -> float | None:
    """The tokens at which a validation curve ([step, tokens, loss] points) first reaches ``target``, interpolated
    linearly between the evaluation points around it; None when it never does."""
    previous = None
    for _, tokens, loss in curve:
        if loss <= target:
            if previous is None:
                return float(tokens)
            t0, l0 = previous
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
        previous = (tokens, loss)
    return None


def _variant(v: str, long: dict, plan: LongScale, timing: dict | None) -> dict:
    runs, base = long[v], long["standard"]
    seeds = sorted(runs)
    losses = {s: runs[s]["val"]["loss"] for s in seeds}
    row: dict = {
        "lr": runs[seeds[0]]["run"]["lr"],
        "losses": [losses[s] for s in seeds],
        "recall": [runs[s]["val"]["recall_loss"] for s in seeds],
        "other": [runs[s]["val"]["other_loss"] for s in seeds],
        "curves": [runs[s]["curve"] for s in seeds],
        "study_seconds_per_step": [runs[s]["seconds_per_step"] for s in seeds],
        "lambda": [runs[s]["lambda"] for s in seeds],
    }
    if v != "standard":
        for key, name in (("loss", "minus_standard"), ("recall_loss", "recall_minus_standard"),
                          ("other_loss", "other_minus_standard")):  # fmt: skip
            row[name] = stats.paired_finite(
                {s: runs[s]["val"][key] for s in seeds}, {s: base[s]["val"][key] for s in seeds}
            )
        row["gap_curve"] = gap_curve({s: runs[s]["curve"] for s in seeds}, {s: base[s]["curve"] for s in seeds})
        positions = [
            [a - b for a, b in zip(runs[s]["per_position"], base[s]["per_position"], strict=True)] for s in seeds
        ]
        row["position_difference"] = [statistics.fmean(p[i] for p in positions) for i in range(len(positions[0]))]
    total = plan.steps[0] * plan.tokens_per_step
    row["token_fraction"] = token_fraction(
        {s: runs[s]["curve"] for s in seeds}, {s: base[s]["curve"] for s in seeds}, total
    )
    if timing is not None:
        ratio = step_seconds(timing, v) / step_seconds(timing, "standard")
        row["seconds_per_step"] = step_seconds(timing, v)
        row["time_ratio"] = ratio
        row["time_fraction"] = {
            "by_seed": [None if f is None else f * ratio for f in row["token_fraction"]["by_seed"]],
            "interval": None if row["token_fraction"]["interval"] is None else
            tuple(x * ratio for x in row["token_fraction"]["interval"]),
        }  # fmt: skip
    return row


def token_fraction(curves: dict[int, list], base: dict[int, list], total: int) -> dict:
    """Per seed both have, the training tokens at which a variant's validation curve ([step, tokens, loss] points)
    reaches the standard model's final loss (same seed), as a fraction of ``total`` (None: never), with the t
    interval when every seed of two or more reaches it."""
    fractions = []
    for s in sorted(set(curves) & set(base)):
        t = tokens_to_reach(curves[s], base[s][-1][2])
        fractions.append(None if t is None else t / total)
    reached = len(fractions) > 1 and all(f is not None for f in fractions)
    return {"by_seed": fractions, "interval": stats.t_interval(fractions) if reached else None}


def step_seconds(timing: dict, v: str) -> float:
    """The seconds per step that a variant's time fraction uses: its trained model's (seed 0's final weights and
    optimizer state: most of a run is trained at that cost, which can exceed a fresh model's), or, in a timing
    without it, the fresh model's."""
    return timing.get("trained_seconds_per_step", {}).get(v) or timing["seconds_per_step"][v]


def gap_curve(curves: dict[int, list], base: dict[int, list]) -> list[list[float]]:
    """[tokens, mean, low, high] of the paired difference (variant - standard) at each evaluation point that every
    seed of both has, from the validation curves ([step, tokens, loss] points) by seed."""
    seeds = sorted(set(curves) & set(base))
    by = {s: {c[1]: c[2] for c in curves[s]} for s in seeds}
    ref = {s: {c[1]: c[2] for c in base[s]} for s in seeds}
    points = sorted(set.intersection(*(set(by[s]) & set(ref[s]) for s in seeds)))
    return [[t, *stats.t_interval([by[s][t] - ref[s][t] for s in seeds])] for t in points]


def _blocks(long: dict, plan: LongScale) -> dict:
    """For each diagnosed variant and diagnostic step: per layer, each statistic's mean over the seeds that have it;
    the attention parameters' gradient norm in all (all attention parameters of the layer); lambda."""
    out = {}
    for v in DIAGNOSED:
        by_step: dict[int, list[list[dict]]] = {}
        missing = []
        for s, m in long[v].items():
            for row in m.get("blocks", []):
                by_step.setdefault(row["step"], []).append(row["layers"])
            missing += [(s, step) for step in m.get("blocks_missing", [])]
        steps = {}
        for step, seeds_layers in sorted(by_step.items()):
            layers = []
            for i in range(len(seeds_layers[0])):
                rows = [sl[i] for sl in seeds_layers]
                entry = {k: statistics.fmean(r[k] for r in rows) for k in STATS}
                entry["attn_grad"] = statistics.fmean(
                    math.sqrt(sum(g * g for name, g in r["grad"].items() if name != "ffn")) for r in rows
                )
                entry["ffn_grad"] = statistics.fmean(r["grad"]["ffn"] for r in rows)
                lams = [r["lambda"] for r in rows if r["lambda"] is not None]
                entry["lambda"] = statistics.fmean(lams) if lams else None
                layers.append(entry)
            steps[str(step)] = {"seeds": len(seeds_layers), "layers": layers}
        out[v] = {"steps": steps, "missing": missing}
    return out


def _geo(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def block_ratio(blocks: dict, v: str, step: str, num: str, den: str, ref: str | None = None) -> float | None:
    """The geometric mean over layers of ``num / den`` (of variant ``ref``'s ``den`` when given) at ``step``."""
    a = blocks.get(v, {}).get("steps", {}).get(step)
    b = blocks.get(ref or v, {}).get("steps", {}).get(step)
    if a is None or b is None:
        return None
    return _geo([x[num] / y[den] for x, y in zip(a["layers"], b["layers"], strict=True)])


def _explanation(result: dict) -> dict:
    """The numbers the explanation of the per-head norm rests on, and which reading they support."""
    blocks, rows = result["blocks"], result["variants"]
    first, last = min(blocks["diff"]["steps"], key=int), max(blocks["diff"]["steps"], key=int)
    numbers = {
        step: {v: {"attn_vs_standard": block_ratio(blocks, v, step, "attn", "attn", "standard"),
                   "attn_vs_ffn": block_ratio(blocks, v, step, "attn", "ffn"),
                   "grad_vs_standard": block_ratio(blocks, v, step, "attn_grad", "attn_grad", "standard")}
               for v in DIAGNOSED}
        for step in (first, last)
    }  # fmt: skip
    gain_vs_diff = stats.paired_finite(_by_seed(rows["diff-norm-gain"]), _by_seed(rows["diff"]))
    no_norm_vs_diff = stats.paired_finite(_by_seed(rows["diff-no-head-norm"]), _by_seed(rows["diff"]))
    diff_gap = rows["diff"]["minus_standard"]
    gain_gap = rows["diff-norm-gain"]["minus_standard"]
    if diff_gap is None or gain_gap is None or gain_vs_diff is None:
        reading = "diverged"
    elif diff_gap["high"] < 0:
        reading = "no-deficit"  # DIFF V1 is ahead of the standard model: there is no deficit to explain
    elif diff_gap["low"] <= 0:
        reading = "no-clear-deficit"
    elif gain_vs_diff["high"] < 0 and gain_gap["low"] <= 0:
        reading = "initial-scale"  # the matched initial scale removes the deficit
    elif gain_vs_diff["high"] < 0:
        reading = "initial-scale-part"
    else:
        reading = "not-initial-scale"
    return {"numbers": numbers, "first": first, "last": last, "gain_vs_diff": gain_vs_diff,
            "no_norm_vs_diff": no_norm_vs_diff, "reading": reading}  # fmt: skip


def _by_seed(row: dict) -> dict[int, float]:
    return dict(enumerate(row["losses"]))


# the section -------------------------------------------------------------------------------------------------------
def _pct_iv(fr: dict) -> str:
    if fr["interval"] is not None:
        m, lo, hi = fr["interval"]
        return f"{m:.0%} ({lo:.0%} to {hi:.0%})"
    missed = sum(f is None for f in fr["by_seed"])
    return f"not reached on {missed} of {len(fr['by_seed'])} seeds (> 100%)"


def markdown(result: dict) -> list[str]:
    p = result["plan"]
    hi, quarter = p["steps"]
    lines = ["## Language modeling, long budget: which variant to train at small scale", ""]
    if "regime" not in result:
        return lines + ["Not yet run.", ""]
    rg = result["regime"]
    np_ = rg["parameters"]
    lines += [
        f"Scale `{p['name']}`: one size, d_model {rg['d_model']}, {rg['n_layers']} layers, heads of "
        f"{rg['head_size']} (the standard model {rg['standard_heads']} heads, DIFF {rg['diff_heads']} differential "
        f"head{'s' if rg['diff_heads'] > 1 else ''} whose half-heads are {rg['head_size']} wide), SwiGLU, RoPE, "
        f"context {p['seq_len']}, {p['batch_size']} sequences per step, {hi} steps ({rg['tokens'] / 1e6:.2f}M tokens: "
        f"{min(rg['tokens_per_parameter'].values()):.1f} to {max(rg['tokens_per_parameter'].values()):.1f} tokens "
        f"per non-embedding parameter; {rg['passes']:.2f} expected passes over the {rg['train_tokens'] / 1e6:.2f}M "
        f"training tokens; the windows are drawn with replacement, so about {math.exp(-rg['passes']):.0%} of the "
        f"training tokens are never seen and {1 - math.exp(-rg['passes']) * (1 + rg['passes']):.0%} are seen twice "
        f"or more). AdamW betas {tuple(p['betas'])}, weight decay {p['weight_decay']}, warmup "
        f"{p['warmup_fraction']:.0%} then cosine to 10%; validation during training every "
        f"{max(1, hi // p['evals'])} steps on the same {p['curve_tokens']:,} held-out tokens (the plan's "
        f"`val_every` {p['val_every']} is the corpus split: every {p['val_every']}th document held out); final "
        f"measures on {p['eval_tokens']:,}. Seeds {result['seeds']}; each seed's models share the data order and the "
        "initialisation of the layers they have in common.",
        "",
        f"Why this size: {p['rationale']}",
        "",
        "| variant | non-embedding parameters | FFN width | tokens per parameter |",
        "|---|---|---|---|",
    ]
    for v in LONG_VARIANTS:
        lines.append(f"| {LABELS[v]} | {np_[v]['non_embedding']:,} | {np_[v]['ffn_dim']} | "
                     f"{rg['tokens_per_parameter'][v]:.1f} |")  # fmt: skip
    gain = result["init"]["gain"]
    lines += ["", f"The matched gain (stage 1, point 4 below): DIFF's per-head norm starts with weight **{gain:g}** "
              "instead of 1, so that its attention blocks' output RMS at initialisation is the standard model's "
              "(geometric mean over layers and seeds); this is this library's `ModelConfig(head_norm_gain=...)`, not "
              "the paper's.", ""]  # fmt: skip
    lines += _tuning_markdown(result, quarter)
    if "variants" not in result:
        measured = len(result.get("measured", []))
        lines += [f"Not yet run (or not complete): {', '.join(result['incomplete'])} ({measured} long runs measured).",
                  ""]  # fmt: skip
        return lines
    lines += _final_markdown(result)
    lines += _blocks_markdown(result)
    if result["incomplete"]:
        lines += [f"Not yet run: {', '.join(result['incomplete'])}.", ""]
    lines += ["Figures: `lm_long_curves.png`, `lm_long_tuning.png`, `lm_long_blocks.png` beside this report.", ""]
    return lines


def _tuning_markdown(result: dict, quarter: int) -> list[str]:
    lines = [f"### Learning rates ({quarter} steps, a quarter of the budget; mean of {result['plan']['tune_seeds']} "
             "seeds)", ""]  # fmt: skip
    rates = sorted({float(lr) for st in result["tuning"].values() for lr in st["losses"]})
    lines += ["| variant | " + " | ".join(f"{r:g}" for r in rates) + " | chosen |", "|---|" + "---|" * (len(rates) + 1)]
    for v, st in result["tuning"].items():
        cells = []
        for r in rates:
            xs = st["losses"].get(f"{r:g}")
            if not xs:
                cells.append("")
            elif any(math.isinf(x) for x in xs):
                cells.append("diverged")
            else:
                mark = "**" if st["best"] is not None and math.isclose(r, st["best"]) else ""
                cells.append(f"{mark}{statistics.fmean(xs):.4f}{mark}")
        chosen = "-" if st["best"] is None else f"{st['best']:g}" + (" (at the edge)" if st["at_edge"] else "")
        lines.append(f"| {LABELS[v]} | " + " | ".join(cells) + f" | {chosen} |")
    lines.append("")
    edges = [LABELS[v] for v, st in result["tuning"].items() if st["at_edge"]]
    lines.append(
        "Each grid started at " + ", ".join(f"{x:g}" for x in result["plan"]["lrs"]) + " and was extended by a factor "
        "of 2 while its best rate was at an edge"
        + (f"; still at an edge after {lm_long.MAX_RATES} rates: {', '.join(edges)}" if edges else
           "; every chosen rate is inside its grid")
        + f". {', '.join(LABELS[v] for v in UNTUNED)} trains at the rate of "
        f"{', '.join(LABELS[u] for u in UNTUNED.values())}."
    )  # fmt: skip
    lines.append("")
    return lines


def _final_markdown(result: dict) -> list[str]:
    rows, seeds = result["variants"], result["seeds"]
    timing = result.get("timing")
    lines = [
        f"### Final validation loss ({len(seeds)} seeds) and the share of the standard model's tokens and time",
        "",
        "Paired differences are against the standard model of the same seed, with 95% t-intervals over seeds. The "
        "token fraction is read from the validation curves: the tokens a variant needs to reach the standard "
        "model's final loss (same seed), as a share of the standard model's budget; below 100% means fewer. A "
        "curve read mid-training has not had its learning rate decayed, so the fraction of a variant that reaches "
        "the target early is an upper bound. The time fraction multiplies it by the variant's seconds per step over "
        "the standard model's (timed alone on this machine, below).",
        "",
        "| variant | lr | validation loss | minus standard | recall hits minus standard | others minus standard | "
        "token fraction | time fraction |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in LONG_VARIANTS:
        row = rows[v]
        tf = row.get("time_fraction")
        lines.append(
            f"| {LABELS[v]} | {row['lr']:g} | {report.mean_std(row['losses'], 4)} | "
            f"{interval(row.get('minus_standard'))} | {interval(row.get('recall_minus_standard'))} | "
            f"{interval(row.get('other_minus_standard'))} | "
            f"{'100%' if v == 'standard' else _pct_iv(row['token_fraction'])} | "
            f"{'100%' if v == 'standard' else '-' if tf is None else _pct_iv(tf)} |"
        )
    lines.append("")
    if timing:
        lines += _timing_markdown(result, timing)
    lines += ["**Where gaps open, close or cross** (paired difference to the standard model on the curve's held-out "
              "tokens, mean over seeds, at a quarter, half and all of the budget):", ""]  # fmt: skip
    tokens_per_step = result["plan"]["seq_len"] * result["plan"]["batch_size"]
    first = rows[next(v for v in LONG_VARIANTS if v != "standard")]["gap_curve"]
    heads = [f"step {round(g[0] / tokens_per_step)} ({g[0] / first[-1][0]:.0%})" for g in _picks(first)]
    lines += ["| variant | " + " | ".join(heads) + " | sign changes of the mean |", "|---|---|---|---|---|"]
    for v in LONG_VARIANTS:
        if v == "standard":
            continue
        gap = rows[v]["gap_curve"]
        picks = _picks(gap)
        crossings = [gap[i][0] for i in range(1, len(gap)) if (gap[i][1] < 0) != (gap[i - 1][1] < 0)]
        cross = ", ".join(f"at {t / 1e6:.2f}M tokens" for t in crossings) or "none"
        lines.append(f"| {LABELS[v]} | " + " | ".join(interval(tuple(g[1:])) for g in picks) + f" | {cross} |")
    lines.append("")
    lines += _positions_markdown(result)
    return lines


def _picks(gap: list[list[float]]) -> list[list[float]]:
    """The evaluation points nearest a quarter, a half and all of the budget (the columns' steps)."""
    return [gap[min(len(gap) - 1, max(0, round(f * len(gap)) - 1))] for f in (0.25, 0.5, 1.0)]


def _timing_markdown(result: dict, timing: dict) -> list[str]:
    rows, m = result["variants"], timing["machine"]
    trained = timing.get("trained_seconds_per_step", {})
    flushed = timing.get("flushed_seconds_per_step", {})
    rounds = timing["rounds"]
    rounds = rounds if "init" in rounds else {"init": rounds}  # a timing of fresh models only

    def cell(by: dict, v: str, state: str) -> str:
        if v not in by:
            return "-"
        return f"{by[v]:.3f} ({' / '.join(f'{x:.3f}' for x in rounds[state][v])})"

    lines = [
        f"Seconds per step, each variant timed alone ({m['processor']}, {m['cores']} cores, {m['threads']} thread, "
        f"{m['device']}, float32, torch {m['torch']}, {result['plan']['batch_size']} x {result['plan']['seq_len']} "
        f"tokens; median of {timing['repeats']} interleaved rounds, each the median of {timing['steps']} steps "
        f"after {timing['warmup']}; load average {m['load_average_before'][0]:.2f} before, "
        f"{m['load_average_after'][0]:.2f} after). Each variant is timed from its initialisation and from seed "
        f"{result['seeds'][0]}'s final weights and optimizer state (at its last learning rate), and so again with "
        "subnormal floats flushed to zero (`torch.set_flush_denormal`); the time fraction above uses the trained "
        "model's seconds. The study's own seconds per step (two runs at a time) are shown beside them, not as a "
        "speed measurement.",
        "",
        "| variant | fresh model | trained | trained, subnormals flushed | trained / standard | the study's runs |",
        "|---|---|---|---|---|---|",
    ]
    for v in LONG_VARIANTS:
        ratio = f"{rows[v]['time_ratio']:.2f}x" if v in trained else "-"
        lines.append(
            f"| {LABELS[v]} | {cell(timing['seconds_per_step'], v, 'init')} | {cell(trained, v, 'trained')} | "
            f"{cell(flushed, v, 'flushed')} | {ratio} | {report.mean_std(rows[v]['study_seconds_per_step'], 3)} |"
        )
    slow = [v for v in LONG_VARIANTS if v in trained and v in flushed and trained[v] > 1.15 * flushed[v]]
    lines.append("")
    if not timing.get("subnormal_fix"):
        lines += [
            "This timing predates the fused CPU kernel's subnormal fix (issue #31, 2026-12-04), after which the "
            "kernel's forward and backward on sharp rows take 0.94-1.09 times their flushed time "
            f"(`{SUBNORMAL_BENCH}`): the trained steps and time fractions here, and the time axis of "
            "`lm_long_curves.png`, are as measured with the old kernel, upper bounds for DIFF V1.",
            "",
        ]
    if slow:
        lines += [
            "Subnormal floats: "
            + "; ".join(
                f"{LABELS[v]}'s trained step takes {trained[v] / flushed[v]:.2f} times as long as with them "
                f"flushed (fresh: {timing['seconds_per_step'][v]:.3f} s)"
                for v in slow
            )
            + ". On this processor arithmetic on subnormal numbers is slow, so "
            + ("this variant's" if len(slow) == 1 else "these variants'")
            + " trained weights or optimizer state make each step dearer than the fresh model's; flushing them to "
            "zero restores the speed "
            "(it changes the arithmetic slightly, and is off in these runs). Not measured on a GPU, whose arithmetic "
            "handles subnormals at full speed: likely a cost of this CPU, not of the architecture.",
            "",
        ]
    return lines


def _positions_markdown(result: dict) -> list[str]:
    rows = result["variants"]
    lines = ["**Per-position loss** (validation documents of at least context + 1 tokens, buckets of 32 positions; "
             "variant - standard, mean over seeds):", ""]  # fmt: skip
    for v in LONG_VARIANTS:
        if v == "standard":
            continue
        d = rows[v]["position_difference"]
        q = max(1, len(d) // 4)
        lines.append(
            f"- {LABELS[v]}: below zero in {sum(x < 0 for x in d)} of {len(d)} buckets; first quarter "
            f"{report.mean(d[:q]):+.4f}, last quarter {report.mean(d[-q:]):+.4f}."
        )
    lines.append("")
    return lines


def _blocks_markdown(result: dict) -> list[str]:
    blocks, ex = result["blocks"], result["explanation"]
    lines = [
        "### Why the per-head norm matters here (point 4)",
        "",
        "Block statistics on 4 fixed held-out windows (`lm_blocks`), mean over seeds, geometric mean over layers: "
        "the attention block's output RMS against the standard model's at the same step, against its own "
        "feed-forward block's, and the attention parameters' gradient norm against the standard model's.",
        "",
        "| variant | step | core RMS (before the norm) | heads RMS (after) | attention output RMS | FFN output RMS | "
        "stream RMS | attention / standard's | attention / FFN | attention gradient / standard's | lambda by layer |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in DIAGNOSED:
        for step, entry in blocks[v]["steps"].items():
            layers = entry["layers"]
            g = {k: _geo([x[k] for x in layers]) for k in ("core", "heads", "attn", "ffn", "stream")}
            vs = block_ratio(blocks, v, step, "attn", "attn", "standard")
            grad = block_ratio(blocks, v, step, "attn_grad", "attn_grad", "standard")
            lam = " ".join(f"{x['lambda']:.2f}" for x in layers) if layers[0]["lambda"] is not None else "-"
            lines.append(
                f"| {SHORT[v]} | {step} | {g['core']:.4f} | {g['heads']:.4f} | {g['attn']:.4f} | {g['ffn']:.4f} | "
                f"{g['stream']:.3f} | {_num(vs)} | {g['attn'] / g['ffn']:.2f} | {_num(grad)} | {lam} |"
            )
    missing = {v: b["missing"] for v, b in blocks.items() if b["missing"]}
    if missing:
        lines += ["", "Not measured (a step passed while an interrupted run trained): " + "; ".join(
            f"{SHORT[v]} " + ", ".join(f"seed {s} step {t}" for s, t in m) for v, m in missing.items())]  # fmt: skip
    lines += ["", *_explanation_markdown(result, ex), ""]
    return lines


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _explanation_markdown(result: dict, ex: dict) -> list[str]:
    rows = result["variants"]
    n0, n1 = ex["numbers"][ex["first"]], ex["numbers"][ex["last"]]
    lines = [
        f"At initialisation (step {ex['first']}) DIFF V1's attention blocks write "
        f"{_num(n0['diff']['attn_vs_standard'])} times the standard model's output RMS into the residual stream "
        f"({_num(n0['diff']['attn_vs_ffn'])} times their own feed-forward block's, against "
        f"{_num(n0['standard']['attn_vs_ffn'])} for the standard model), and "
        f"without the norm {_num(n0['diff-no-head-norm']['attn_vs_standard'])} times; with the matched gain "
        f"{_num(n0['diff-norm-gain']['attn_vs_standard'])} times, by construction. At the end (step {ex['last']}) "
        f"the ratios to the standard model are {_num(n1['diff']['attn_vs_standard'])} (DIFF V1), "
        f"{_num(n1['diff-no-head-norm']['attn_vs_standard'])} (no norm) and "
        f"{_num(n1['diff-norm-gain']['attn_vs_standard'])} (matched gain); the attention gradient norms at "
        f"initialisation are {_num(n0['diff']['grad_vs_standard'])}, "
        f"{_num(n0['diff-no-head-norm']['grad_vs_standard'])} and {_num(n0['diff-norm-gain']['grad_vs_standard'])} "
        "times the standard model's.",
        "",
        f"Final loss, paired: DIFF V1 - standard {interval(rows['diff']['minus_standard'])}; matched gain - DIFF V1 "
        f"{interval(ex['gain_vs_diff'])}; no norm - DIFF V1 {interval(ex['no_norm_vs_diff'])}.",
        "",
    ]
    text = {
        "no-deficit": "At this budget DIFF V1 is ahead of the standard model (interval below zero): the short-budget "
        "deficit did not survive training to 20 tokens per parameter, so there is no deficit for the initial scale "
        "to explain here; the block statistics describe how the variants differ, not why one loses.",
        "no-clear-deficit": "At this budget the interval of DIFF V1 - standard includes zero: no deficit is resolved "
        "at 3 seeds, so these numbers cannot single out a cause; the block statistics show what differs at the start.",
        "initial-scale": "The numbers support the initial-scale explanation: starting DIFF V1's per-head norm at the "
        "gain that gives its attention blocks the standard model's output RMS removes its deficit (the matched-gain "
        "model is better than DIFF V1 beyond the seed noise, and its difference to the standard model is within "
        "the seed noise).",
        "initial-scale-part": "The numbers support the initial-scale explanation in part: the matched gain makes DIFF "
        "V1 better (interval below zero) but leaves it behind the standard model.",
        "diverged": "A run of DIFF V1 or of the matched-gain variant diverged: no reading.",
        "not-initial-scale": "The numbers do not support the initial-scale explanation: starting the norm at the "
        "matched gain does not make DIFF V1 better beyond the seed noise, so the deficit comes from the norm's effect "
        "during training, not from its scale at initialisation.",
    }
    reading = "**Reading.** " + text[ex["reading"]]
    norm_gap = rows.get("standard-head-norm", {}).get("minus_standard")
    if norm_gap is not None:
        sign = "costs it" if norm_gap["low"] > 0 else "gains it" if norm_gap["high"] < 0 else "changes it by"
        reading += f" The same per-head norm at gain 1 added to the standard model {sign} {interval(norm_gap)} nats" + (
            ": at gain 1 the norm hurts the standard model too, so the cost is the norm's, "
            "not differential attention's."
            if norm_gap["low"] > 0
            else "."
        )
    return lines + [reading]


# figures -----------------------------------------------------------------------------------------------------------
def plot(result: dict, out: Path) -> None:
    if "tuning" in result:
        _plot_tuning(result, out / "lm_long_tuning.png")
    if "variants" in result:
        _plot_curves(result, out / "lm_long_curves.png")
        _plot_blocks(result, out / "lm_long_blocks.png")


def _plot_tuning(result: dict, path: Path) -> None:
    plt = figures.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for v, st in result["tuning"].items():
        report.plot_rates(ax, st["losses"], COLORS[v], SHORT[v], 4)
    ax.set(xscale="log", xlabel="peak learning rate", ylabel="validation loss (nats per token)")
    rates = sorted({float(lr) for st in result["tuning"].values() for lr in st["losses"]})
    ax.set_xticks(rates, [f"{r:g}" for r in rates], rotation=45)  # the rates themselves, not overlapping labels
    ax.minorticks_off()
    ax.set_title("mean of the seeds (dots: each seed)", fontsize=10)
    figures.finish(fig, path, f"learning rates at {result['plan']['steps'][1]} steps, every variant")


def _plot_curves(result: dict, path: Path) -> None:
    plt = figures.pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.6))
    axes = [axes[0], axes[1], axes[3], axes[2]]  # loss, gap, time; the zoomed gap (axes[3]) beside the gap
    rows, timing = result["variants"], result.get("timing")
    tokens_per_step = result["plan"]["seq_len"] * result["plan"]["batch_size"]
    lows = []
    for v in LONG_VARIANTS:
        row = rows[v]
        for curve in row["curves"]:
            axes[0].plot([c[1] for c in curve], [c[2] for c in curve], color=COLORS[v], lw=0.6, alpha=0.45)
            lows.append(min(c[2] for c in curve))
        mean = curve_mean(row["curves"])
        axes[0].plot([m[0] for m in mean], [m[1] for m in mean], color=COLORS[v], lw=2, label=SHORT[v])
        if timing:
            sec = step_seconds(timing, v) / tokens_per_step
            axes[2].plot([m[0] * sec for m in mean], [m[1] for m in mean], color=COLORS[v], lw=2)
        if v != "standard":
            gap = [g for g in row["gap_curve"] if g[0] >= _gap_start(rows)]
            xs = [g[0] for g in gap]
            near = max(abs(g[1]) for g in gap) < NEAR
            for ax in (axes[1], axes[3]) if near else (axes[1],):
                ax.plot(xs, [g[1] for g in gap], color=COLORS[v], lw=2)
                ax.fill_between(xs, [g[2] for g in gap], [g[3] for g in gap], color=COLORS[v], alpha=0.12)
    means = [curve_mean(rows[v]["curves"]) for v in LONG_VARIANTS]
    top = max(m[len(m) // 8][1] for m in means)  # the first eighth of training is off the top: the rest is readable
    for ax in (axes[0], axes[2]):
        ax.set_ylim(min(lows) - 0.05, top + 0.05)
    axes[0].set(xlabel="training tokens", ylabel="validation loss (nats per token)",
                title="thin: each seed; bold: mean")  # fmt: skip
    for ax in (axes[1], axes[3]):
        ax.axhline(0, color="k", lw=0.8)
        ax.set(xlabel="training tokens", ylabel="minus standard (nats per token)")
    axes[1].set_title("minus standard, from a quarter of the budget (band: 95%)")
    axes[3].set_title(f"the same, the variants within {NEAR:g} nats of it")
    kernel = "" if (timing or {}).get("subnormal_fix") else ", pre-fix kernel"
    axes[2].set(xlabel=f"seconds (trained step, timed alone{kernel})", ylabel="validation loss",
                title="mean against time" if timing else "(not timed yet)")  # fmt: skip
    for ax in axes:
        ax.title.set_fontsize(10)
    figures.finish(fig, path, f"validation loss during training, {len(result['seeds'])} seeds per variant")


def _gap_start(rows: dict) -> float:
    """The tokens at a quarter of the budget: the gap panel starts there (the first quarter's gaps are 10 times
    larger and would squeeze the rest)."""
    last = rows["standard"]["curves"][0][-1][1]
    return last / 4


def _plot_blocks(result: dict, path: Path) -> None:
    plt = figures.pyplot()
    blocks = result["blocks"]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    first = min(blocks["diff"]["steps"], key=int)
    width = 0.8 / len(DIAGNOSED)
    for j, v in enumerate(DIAGNOSED):
        layers = blocks[v]["steps"][first]["layers"]
        xs = [i + (j - len(DIAGNOSED) / 2 + 0.5) * width for i in range(len(layers))]
        axes[0].bar(xs, [x["attn"] for x in layers], width=width, color=COLORS[v], label=SHORT[v])
    ffn = blocks["standard"]["steps"][first]["layers"]
    axes[0].plot(range(len(ffn)), [x["ffn"] for x in ffn], "k_", ms=18, mew=2, label="FFN output (standard)")
    axes[0].set(yscale="log", xlabel="layer", ylabel="attention block output RMS", title=f"at step {first}")
    axes[0].set_xticks(range(len(ffn)))
    for v in DIAGNOSED:
        steps = sorted(blocks[v]["steps"], key=int)
        xs = [int(s) for s in steps]
        axes[1].plot(xs, [block_ratio(blocks, v, s, "attn", "ffn") for s in steps], "o-", color=COLORS[v])
        axes[3].plot(xs, [block_ratio(blocks, v, s, "attn_grad", "attn_grad", "standard") for s in steps], "o-",
                     color=COLORS[v])  # fmt: skip
        if blocks[v]["steps"][steps[0]]["layers"][0]["lambda"] is not None:
            for i in range(len(blocks[v]["steps"][steps[0]]["layers"])):
                axes[2].plot(xs, [blocks[v]["steps"][s]["layers"][i]["lambda"] for s in steps], "o-",
                             color=COLORS[v], alpha=0.4 + 0.6 * i / max(1, len(ffn) - 1), lw=1)  # fmt: skip
    for ax in (axes[1], axes[2], axes[3]):
        ax.set_xscale("symlog", linthresh=max(1, result["plan"]["steps"][0] // 50))
        ax.set_xlabel("training step")
    axes[1].set(yscale="log", ylabel="attention / FFN output RMS", title="geometric mean over layers")
    axes[2].set(ylabel="lambda", title="lambda by layer (darker: deeper)")
    axes[3].set(yscale="log", ylabel="attention gradient norm / standard's", title="geometric mean over layers")
    for ax in axes:
        ax.title.set_fontsize(10)
    figures.finish(fig, path, "what the attention blocks write into the residual stream, and their gradients")
