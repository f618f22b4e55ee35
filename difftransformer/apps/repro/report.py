"""Shared pieces of the reproduction reports: statistics over seeds, Markdown tables, learning-curve plots."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from difftransformer.apps.figures import COLORS, finish, pyplot
from difftransformer.apps.repro import stats

PAIR = ("diff", "standard")
NAMES = {"diff": "DIFF", "standard": "standard"}


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def mean_std(xs: list[float], digits: int = 2) -> str:
    """'mean +- std (min-max)' over seeds; one seed's value alone (one seed has no spread)."""
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{mean(xs):.{digits}f} +- {std(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def mean_sd(xs: list[float], digits: int = 3) -> str:
    """'mean +- sd' over seeds; one seed's value alone."""
    return f"{mean(xs):.{digits}f}" + (f" +- {std(xs):.{digits}f}" if len(xs) > 1 else "")


def interval(iv: dict | tuple | None, fmt: str = "{:+.4f}", words: str = "") -> str:
    """'mean (low to high)' of an interval, (mean, low, high) or a dict of them (stats.paired's), each as ``fmt``
    writes it, ``words`` before the bounds (e.g. '95% t-interval '); '-' for None."""
    if iv is None:
        return "-"
    m, lo, hi = (iv["mean"], iv["low"], iv["high"]) if isinstance(iv, dict) else iv
    return f"{fmt.format(m)} ({words}{fmt.format(lo)} to {fmt.format(hi)})"


def percent(x: float | None) -> str:
    """'12.3%'; '-' for None or a value that is not finite."""
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def over_seeds(seeds: list[int]) -> str:
    """How a report's cells summarise its seeds, as a sentence: 'Mean +- standard deviation over the 5 seeds.', or
    for one seed 'One seed: its values, no spread.'"""
    if len(seeds) > 1:
        return f"Mean +- standard deviation over the {len(seeds)} seeds."
    return f"One seed ({seeds[0]}): its values, no spread." if seeds else "No seeds."


def seeds_label(seeds: list[int]) -> str:
    """A figure's words for the same: 'mean and sd over 5 seeds' or 'seed 0 alone'."""
    return f"mean and sd over {len(seeds)} seeds" if len(seeds) > 1 else f"seed {seeds[0]} alone"


def count(n: int, word: str) -> str:
    """'1 token', '4 tokens'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def mean_grid(grids: list[list[list[float]]]) -> list[list[float]]:
    """Elementwise mean of equally shaped nested lists (one per seed)."""
    return [[mean([g[i][j] for g in grids]) for j in range(len(grids[0][i]))] for i in range(len(grids[0]))]


def curve_table(runs: list[dict], measure: str) -> str:
    """Final and best measure, the first step and second at which it reached 0.9 (a retrieval circuit forms at a
    random step), training seconds, per model and seed."""
    lines = [
        f"Learning curves ({measure} on a fixed set; full curves in results.json):",
        "",
        "| model | seed | final | best | first >= 0.9: step (seconds) | training seconds | seconds per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in sorted(runs, key=lambda r: (PAIR.index(r["attention"]), r["seed"])):
        curve = run["curve"]
        steps = curve[-1]["step"]
        first = next((c for c in curve if c["accuracy"] >= 0.9), None)
        reached = "never" if first is None else f"{first['step']} ({first['seconds']:.0f})"
        lines.append(
            f"| {NAMES[run['attention']]} | {run['seed']} | {curve[-1]['accuracy']:.2f} | "
            f"{max(c['accuracy'] for c in curve):.2f} | {reached} | {run['seconds']:.0f} | "
            f"{run['seconds'] / max(1, steps):.3f} |"
        )
    return "\n".join(lines)


def images(task: str) -> str:
    return f"Figures: `{task}_*.png` beside this report."


def plot_rates(ax, losses: dict[str, list[float]], color: str, label: str, dot: float) -> list[float]:
    """On ``ax``: the mean loss over the seeds at each learning rate (a line) and each seed's (dots of size ``dot``),
    a rate with a loss that is not finite left out; returns the rates drawn."""
    pts = sorted((float(lr), xs) for lr, xs in losses.items() if all(math.isfinite(x) for x in xs))
    if pts:
        ax.plot([p[0] for p in pts], [statistics.fmean(p[1]) for p in pts], "o-", color=color, label=label)
        for lr, xs in pts:
            ax.plot([lr] * len(xs), xs, ".", color=color, alpha=0.5, ms=dot)
    return [p[0] for p in pts]


def plot_curves(runs: list[dict], path: Path, ylabel: str, task: str) -> None:
    """The measure against steps and against training seconds: thin line per seed, both models."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for run in runs:
        steps = [c["step"] for c in run["curve"]]
        secs = [c["seconds"] for c in run["curve"]]
        acc = [c["accuracy"] for c in run["curve"]]
        n = sum(r["attention"] == run["attention"] for r in runs)
        label = f"{NAMES[run['attention']]} ({n} seed{'s' if n > 1 else ''}, one line each)"
        axes[0].plot(steps, acc, color=COLORS[run["attention"]], alpha=0.8, lw=1, label=label)
        axes[1].plot(secs, acc, color=COLORS[run["attention"]], alpha=0.8, lw=1)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training seconds (one thread)")
    axes[0].set_ylabel(ylabel)
    finish(fig, path, f"{task}: {ylabel} during training, DIFF vs standard")


def logit_bits_note(spec: dict) -> list[str]:
    """The report lines that say a final evaluation ran with quantized attention logits (none when it did not)."""
    if spec.get("logit_bits") is None:
        return []
    return [
        f"Final evaluation with the attention logits quantized to {spec['logit_bits']} bits (dynamic absmax per head "
        "and query row); training and the learning curves ran in float.",
        "",
    ]


def source_note(result: dict) -> list[str]:
    """The report lines that say the models were trained by an earlier run and only evaluated here (none when not)."""
    if not result.get("models"):
        return []
    return [
        "The models of an earlier run of this experiment, evaluated again (nothing trained here): the learning "
        f"curves and seconds are that run's. It wrote them to {result['models']} on the machine it ran on (a "
        "committed report holds no models).",
        "",
    ]


def models_text(spec: dict) -> str:
    """The matched pair and its training budget, in words, from a saved spec (asdict(FitSpec))."""
    lr = spec["lr"]
    lrs = (
        f"peak lr {lr:g}"
        if not isinstance(lr, dict)
        else "peak lr " + ", ".join(f"{NAMES[a]} {lr[a]:g}" for a in PAIR if a in lr)
    )
    return (
        f"Matched DIFF / standard models (d_model {spec['d_model']}, {spec['n_layers']} layers, DIFF "
        f"{spec['n_heads'] // 2} heads vs standard {spec['n_heads']}, initial std {spec.get('init_std', 0.02):g}), "
        f"{spec['steps']} steps of batch {spec['batch_size']} at context {spec['seq_len']}, {lrs}"
    )


def paired_difference(result: dict, get) -> dict:
    """stats.paired of DIFF minus standard for the measure ``get(eval)`` of a result's evals, matched by seed."""
    by_seed = {a: {e["seed"]: get(e) for e in result["evals"] if e["attention"] == a} for a in PAIR}
    return stats.paired(by_seed["diff"], by_seed["standard"])
