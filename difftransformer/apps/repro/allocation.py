"""Attention allocation: how much of the answering position's attention goes to the answer span and how much to the
rest of the context ("attention to answer" and "attention noise", docs/paper.md section 3), by answer depth.

Measured on the needle task's models (N=4, R=2, the training context length), for each depth of the queried needle:

- the row read is the answering position: the first query's key token, whose next-token prediction is the answer;
- the answer span is the queried needle's three tokens [MARK, key, value]; the noise is every other haystack
  position; the query tokens themselves count in neither;
- the map is the differential map ``P1 - lambda P2`` for DIFF and the softmax map for standard; both the absolute
  shares (sum of |map| over the positions) and the signed ones (sum of the map) are reported, since a DIFF layer can
  retrieve through its second map with a negative sign;
- summaries: the mean over all layers and heads, the mean over the last layer's heads, and the best head (the
  (layer, head) with the largest absolute answer share averaged over depths), each averaged over SIZE sequences per
  depth and then over seeds.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from difftransformer.apps import figures
from difftransformer.apps.analysis import allocation, attention_maps, span_masks
from difftransformer.apps.repro import needle, report
from difftransformer.apps.repro.fit import FitSpec, find_models, run_pairs, saved_models, scaled_spec
from difftransformer.apps.repro.tasks import MARK
from difftransformer.errors import InputError
from difftransformer.fsutil import write_json
from difftransformer.store.runs import load_run

TASK = "allocation"
PAPER = {  # docs/paper.md section 3: answer share by depth 0/25/50/75/100%; noise only as a range over depths
    "diff": {"answer": [0.27, 0.30, 0.31, 0.32, 0.40], "noise_range": [0.01, 0.02]},
    "standard": {"answer": [0.03, 0.03, 0.03, 0.07, 0.09], "noise_range": [0.49, 0.54]},
}
SIZE = 256
SUMMARIES = ("all layers", "last layer", "best head")


@torch.no_grad()
def measure(model, spec: FitSpec, depths: list[float], size: int) -> list[dict]:
    """Per depth: {'answer', 'noise', 'answer_abs', 'noise_abs'} as (layers, heads) lists, means over sequences
    (needle eval sets at ``spec``'s length and vocabulary)."""
    n, r = needle.GRID_NEEDLES
    seq_len, per_depth = spec.seq_len, []
    for depth in depths:
        nb = needle.eval_set(n, r, seq_len, size, depth, **needle.vocabulary(spec.task))
        span = torch.stack((nb.needle_start, nb.needle_start + 3), dim=1)
        context_end = torch.full_like(nb.answer_pos, seq_len - 3 * r)
        answer, context = span_masks(span, context_end, nb.tokens.shape[1])
        layers = [allocation(m.mixed, nb.answer_pos, answer, context) for m in attention_maps(model, nb.tokens)]
        per_depth.append({key: [layer[key].mean(0).tolist() for layer in layers] for key in layers[0]})
    return per_depth


def summarize(per_depth: list[dict], best: tuple[int, int]) -> dict[str, dict[str, list[float]]]:
    """{summary: {measure: [value per depth]}} for the three summaries (best = (layer, head))."""
    out: dict[str, dict[str, list[float]]] = {s: {} for s in SUMMARIES}
    for key in per_depth[0]:
        grids = [torch.tensor(d[key]) for d in per_depth]  # (layers, heads) per depth
        out["all layers"][key] = [g.mean().item() for g in grids]
        out["last layer"][key] = [g[-1].mean().item() for g in grids]
        out["best head"][key] = [g[best].item() for g in grids]
    return out


def best_head(per_depth: list[dict]) -> tuple[int, int]:
    mean_abs = torch.stack([torch.tensor(d["answer_abs"]) for d in per_depth]).mean(0)
    layer, head = divmod(int(mean_abs.argmax()), mean_abs.shape[1])
    return layer, head


def run(
    out: Path, scale: str, seeds: list[int], workers: int, steps: int | None = None, models: Path | None = None
) -> dict:
    spec = scaled_spec(needle.SCALES, scale, steps)
    hint = "run `difftx repro needle` with as many seeds, or drop `models` to train them here"
    found = saved_models(models, needle.TASK, seeds, hint) if models else {}
    if not found:
        run_pairs(partial(needle.train_job, spec=spec, out=out), seeds, workers, spec.steps, "allocation")
        found = find_models(out, needle.TASK)
    evals = []
    for seed in seeds:
        for attention in report.PAIR:
            model = load_run(found[(attention, seed)])[0]
            if model.config.max_seq_len != spec.seq_len:
                raise InputError(
                    f"{found[(attention, seed)]} was trained at context {model.config.max_seq_len}, not the "
                    f"{scale} scale's {spec.seq_len}: pass the same `scale` as the needle run"
                )
            per_depth = measure(model, spec, needle.DEPTHS, SIZE)
            best = best_head(per_depth)
            evals.append(
                {
                    "attention": attention,
                    "seed": seed,
                    "model": str(found[(attention, seed)]),
                    "per_depth": per_depth,
                    "best_head": best,
                    "summary": summarize(per_depth, best),
                }
            )
    result = {
        "experiment": TASK,
        "scale": scale,
        "seeds": seeds,
        "depths": needle.DEPTHS,
        "needles": needle.GRID_NEEDLES,
        "sequences_per_depth": SIZE,
        "paper": PAPER,
        "evals": evals,
    }
    write_json(out / "results.json", result)
    draw(result, out)
    _plot_rows(result, found, spec, out)
    (out / "section.md").write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    depths = result["depths"]
    n, r = result["needles"]
    lines = [
        "## Attention allocation",
        "",
        f"Needle models of the retrieval experiment, N={n}, R={r}, {result['sequences_per_depth']} sequences per "
        f"depth, seeds {result['seeds']}. "
        "Row: the answering position (the first query's key token). Answer: the queried needle's [MARK, key, value]; "
        "noise: every other haystack position. DIFF: the differential map P1 - lambda P2; standard: the softmax map. "
        "|map| = sum of absolute values, signed = plain sum. " + report.over_seeds(result["seeds"]),
        "",
        "| summary | measure | model | " + " | ".join(f"{d:.0%}" for d in depths) + " |",
        "|---|---|---|" + "---|" * len(depths),
    ]
    for summary in SUMMARIES:
        for key in ("answer_abs", "noise_abs", "answer", "noise"):
            for a in report.PAIR:
                rows = [e["summary"][summary][key] for e in result["evals"] if e["attention"] == a]
                cells = [report.mean_sd([row[i] for row in rows]) for i in range(len(depths))]
                label = key.replace("_abs", " |map|") if key.endswith("_abs") else key + " signed"
                lines.append(f"| {summary} | {label} | {report.NAMES[a]} | " + " | ".join(cells) + " |")
    for a in report.PAIR:
        lines.append(
            f"| paper | answer | {report.NAMES[a]} | "
            + " | ".join(f"{x:.2f}" for x in result["paper"][a]["answer"])
            + " |"
        )
    lines += [
        "",
        "Paper, attention noise over depths: "
        + ", ".join(f"{report.NAMES[a]} {lo:.2f}-{hi:.2f}" for a, (lo, hi) in _noise_ranges(result))
        + " (4K context; the paper does not say which layers and heads it averages).",
        "",
        "Best heads (layer, head) per seed: "
        + "; ".join(
            f"{report.NAMES[e['attention']]} seed {e['seed']}: {tuple(e['best_head'])}" for e in result["evals"]
        ),
        "",
        report.images(TASK),
        "",
    ]
    return "\n".join(lines)


def _noise_ranges(result: dict):
    return [(a, result["paper"][a]["noise_range"]) for a in report.PAIR]


def draw(result: dict, out: Path) -> None:
    """The figure drawn from the result alone: attention to the answer and to the noise by depth (the rows figure
    needs the models: ``_plot_rows``)."""
    plt = figures.pyplot()
    depths = result["depths"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4), sharey=True)
    width = 0.2
    for ax, summary in zip(axes, SUMMARIES, strict=True):
        for i, a in enumerate(report.PAIR):
            for j, key in enumerate(("answer_abs", "noise_abs")):
                rows = [e["summary"][summary][key] for e in result["evals"] if e["attention"] == a]
                means = [report.mean([row[d] for row in rows]) for d in range(len(depths))]
                errs = [report.std([row[d] for row in rows]) for d in range(len(depths))] if len(rows) > 1 else None
                xs = [d + (2 * i + j - 1.5) * width for d in range(len(depths))]
                ax.bar(
                    xs, means, width, yerr=errs, color=figures.COLORS[a], alpha=1.0 if j == 0 else 0.4,
                    label=f"{report.NAMES[a]} {'answer' if j == 0 else 'noise'}",
                )  # fmt: skip
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("answer depth")
        ax.set_title(f"{summary}, |map|")
    axes[0].set_ylabel("attention share")
    title = f"attention to the answer and to the rest (noise), by answer depth ({report.seeds_label(result['seeds'])})"
    figures.finish(fig, out / f"{TASK}_bars.png", title)


def _plot_rows(result: dict, found: dict, spec: FitSpec, out: Path) -> None:
    """For one sequence (depth 50%) of the first seed: the answering row of every head in the layer of each model's
    best head, with the queried needle and the other needles marked."""
    plt = figures.pyplot()
    n, r = needle.GRID_NEEDLES
    seq_len = spec.seq_len
    nb = needle.eval_set(n, r, seq_len, 1, 0.5, **needle.vocabulary(spec.task))
    tokens = nb.tokens[0]
    marks = (tokens[: seq_len - 3 * r] == MARK).nonzero().flatten().tolist()
    start = int(nb.needle_start[0])
    seed = result["seeds"][0]
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True)
    for ax, a in zip(axes, report.PAIR, strict=True):
        layer = next(e["best_head"][0] for e in result["evals"] if e["attention"] == a and e["seed"] == seed)
        maps = attention_maps(load_run(found[(a, seed)])[0], nb.tokens)[layer].mixed[0]  # (H, T, T)
        for h, row in enumerate(maps[:, int(nb.answer_pos[0])]):
            ax.plot(row.tolist(), lw=1, color=figures.HEADS[h % len(figures.HEADS)], label=f"head {h}")
        for m in marks:
            queried = m == start
            ax.axvspan(m - 0.5, m + 2.5, color="gold" if queried else "0.85", alpha=0.5, lw=0,
                       label="queried needle" if queried else None)  # fmt: skip
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(f"{report.NAMES[a]} seed {seed}, layer {layer}: {len(maps)} heads", fontsize=10)
        ax.set_ylabel("attention weight")
    axes[1].set_xlabel("position (grey: the other needles)")
    figures.finish(fig, out / f"{TASK}_rows.png", "the answering position's attention over the context, every head")
