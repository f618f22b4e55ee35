"""In-context learning: synthetic many-shot classification (tasks.icl_episodes), accuracy against the number of
demonstrations, and robustness to the order of the demonstrations (docs/paper.md section 3).

Order protocol: for each class count, one fixed set of balanced episodes (the same demonstrations and queries for
every order); each arrangement (random, grouped by class, alternating by class) is drawn with ORDER_SEEDS seeds; the
accuracy of every (arrangement, seed) is measured, and the spread is the best minus the worst accuracy over the seeds
of an arrangement, in points (the paper's "best minus worst over example orders").
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from difftransformer.apps import figures
from difftransformer.apps.repro import report, stats
from difftransformer.apps.repro.fit import (
    FitSpec,
    fit,
    save_and_evaluate,
)
from difftransformer.apps.repro.tasks import (
    EXAMPLE_FEATURES,
    FEATURES_PER_CLASS,
    ICL_EXAMPLE,
    ICLEpisodes,
    answer_kinds,
    demo_order,
    icl_batch,
    icl_episodes,
)
from difftransformer.errors import InputError

TASK = "icl"
SCALES = {
    "cpu": FitSpec(  # calibrated (experiments/LOG.md, in-context-learning calibration)
        d_model=64, n_layers=2, n_heads=4, seq_len=64, steps=6000, batch_size=32, lr={"diff": 5e-4, "standard": 2e-3},
        init_std=0.07, eval_every=500,
        task=dict(classes=[2, 4, 8], shots=[30, 30], eval_shots=[1, 2, 4, 8, 16, 24], order_shots=24, eval_size=512),
    ),
    "gpu": FitSpec(  # not calibrated: no GPU session has run it
        d_model=256, n_layers=8, n_heads=16, seq_len=256, steps=20000, batch_size=64, lr=1e-3, eval_every=1000,
        task=dict(classes=[2, 4, 8], shots=[4, 120], eval_shots=[1, 4, 16, 64, 120], order_shots=96, eval_size=2048),
    ),
}  # fmt: skip
EVAL_OPTIONS = ("eval_shots", "order_shots", "eval_size")  # task options only the evaluation reads
ARRANGEMENTS = ("random", "grouped", "alternating")
ANSWER_KINDS = ("correct", "other_label", "in_context", "not_in_context")
ORDER_SEEDS = 5
CURVE_CLASSES = 4
PAPER = {  # TREC, best minus worst accuracy over example orders, points (docs/paper.md section 3)
    "order_spread": {"random": {"standard": 19.0, "diff": 4.0}, "alternating": {"standard": 56.7, "diff": 13.4}},
    "many_shot_gain": {"TREC": 18.0, "TREC-fine": 21.6, "Banking-77": 10.4, "Clinic-150": 5.2},
}
EVAL_SEED = 2_000_003


def sample(gen: torch.Generator, batch: int, classes: list[int], shots: list[int]):
    """A training batch: C drawn from ``classes`` and k uniformly from ``shots`` = [fewest, most] per batch, k
    demonstrations in the order drawn (random)."""
    c = classes[int(torch.randint(0, len(classes), (), generator=gen))]
    k = int(torch.randint(shots[0], shots[1] + 1, (), generator=gen))
    b = icl_batch(icl_episodes(gen, batch, c, k))
    return b.tokens, b.targets


def episodes(n_classes: int, shots: int, size: int, balanced: bool = False) -> ICLEpisodes:
    seed = EVAL_SEED + 100 * n_classes + shots + (50 if balanced else 0)
    return icl_episodes(torch.Generator().manual_seed(seed), size, n_classes, shots, balanced)


@torch.no_grad()
def answers(model, eps: ICLEpisodes, order: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """What each episode's predicted label is (tasks.answer_kinds; the wrong real answers are the other labels the
    demonstrations show: ``other_label``), as boolean masks over the episodes."""
    batch = icl_batch(eps, order)
    pred = model(batch.tokens)[torch.arange(len(batch.answer)), batch.query_pos].argmax(-1)
    shown = batch.tokens[:, EXAMPLE_FEATURES::ICL_EXAMPLE]  # every demonstration's label
    return answer_kinds(pred, batch.answer, shown, batch.tokens, batch.query_pos, "other_label")


def outcomes(model, eps: ICLEpisodes, order: torch.Tensor | None = None) -> dict[str, float]:
    """Shares of the episodes' predictions of each kind (answers)."""
    return {kind: mask.float().mean().item() for kind, mask in answers(model, eps, order).items()}


def accuracy(model, eps: ICLEpisodes, order: torch.Tensor | None = None) -> float:
    return outcomes(model, eps, order)["correct"]


def curve_score(model, shots: int, size: int) -> float:
    return round(accuracy(model, episodes(CURVE_CLASSES, shots, size)), 4)


def train_job(attention: str, seed: int, spec: FitSpec, out: Path) -> dict:
    opts = spec.task
    check_shots(opts, spec.seq_len)
    record, model = fit(
        attention,
        seed,
        spec,
        partial(sample, classes=opts["classes"], shots=opts["shots"]),
        partial(curve_score, shots=opts["order_shots"], size=min(256, opts["eval_size"])),
    )
    return save_and_evaluate(record, model, out, TASK, spec, evaluate)


def check_shots(task: dict, seq_len: int) -> None:
    """Refuse, before any training, demonstration counts that are not [fewest, most] or do not fit the context."""
    shots = task["shots"]
    if not (isinstance(shots, list) and len(shots) == 2 and all(isinstance(k, int) for k in shots)):
        raise InputError(f"`shots` must be [fewest, most] demonstrations per training episode, got {shots!r}")
    if not 1 <= shots[0] <= shots[1]:
        raise InputError(f"`shots` must satisfy 1 <= fewest <= most, got {shots}")
    for k in (shots[1], *task["eval_shots"], task["order_shots"]):
        if ICL_EXAMPLE * k + EXAMPLE_FEATURES > seq_len:
            most = (seq_len - EXAMPLE_FEATURES) // ICL_EXAMPLE
            raise InputError(f"{k} demonstrations do not fit a context of {seq_len} (at most {most})")


def order_accuracies(model, eps: ICLEpisodes) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Accuracy for each arrangement and order seed on the same episodes, and each arrangement's spread's standard
    error in points: stats.paired_se of its best and its worst order (the same episodes in both)."""
    accuracies, spread_se = {}, {}
    for arrangement in ARRANGEMENTS:
        correct = []
        for s in range(ORDER_SEEDS):
            gen = torch.Generator().manual_seed(EVAL_SEED + 7 * s + ARRANGEMENTS.index(arrangement))
            correct.append(answers(model, eps, demo_order(gen, eps.demo_classes, arrangement))["correct"])
        acc = [c.float().mean().item() for c in correct]
        best, worst = acc.index(max(acc)), acc.index(min(acc))
        accuracies[arrangement], spread_se[arrangement] = acc, 100.0 * stats.paired_se(correct[best], correct[worst])
    return accuracies, spread_se


def spread(accuracies: list[float]) -> float:
    """Best minus worst accuracy, in points."""
    return 100.0 * (max(accuracies) - min(accuracies))


def evaluate(model, spec: FitSpec) -> dict:
    """Accuracy for each C and number of demonstrations, accuracy for each arrangement and order seed, and the
    shares of each answer kind (outcomes) for each C at the most demonstrations evaluated."""
    opts = spec.task
    size = opts["eval_size"]
    by_shots = {str(c): [outcomes(model, episodes(c, k, size)) for k in opts["eval_shots"]] for c in opts["classes"]}
    shots = {c: [kinds["correct"] for kinds in row] for c, row in by_shots.items()}
    orders, spread_se = {}, {}
    for c in opts["classes"]:
        orders[str(c)], spread_se[str(c)] = order_accuracies(model, episodes(c, opts["order_shots"], size, True))
    kinds = {c: row[-1] for c, row in by_shots.items()}
    return {"shots": shots, "orders": orders, "order_spread_se": spread_se, "answers": kinds}


RECORDED = {"arrangements": ARRANGEMENTS, "order_seeds": ORDER_SEEDS, "paper": PAPER}  # beside the measurements


def _shots_trained(shots: list[int]) -> str:
    """'30 demonstrations', or '4 to 30 demonstrations (drawn per batch)'."""
    low, high = shots
    return f"{high} demonstrations" if low == high else f"{low} to {high} demonstrations (drawn per batch)"


def markdown(result: dict) -> str:
    spec = result["spec"]
    opts = spec["task"]
    lines = [
        "## In-context learning",
        "",
        *report.logit_bits_note(spec),
        *report.source_note(result),
        "Synthetic many-shot classification: per episode, C classes each own "
        f"{report.count(FEATURES_PER_CLASS, 'random feature token')} and a random label token; an example is "
        f"{EXAMPLE_FEATURES} of its class's features and its label. Trained with {_shots_trained(opts['shots'])} in "
        f"random order, C drawn from {opts['classes']}. {report.models_text(spec)}; seeds {result['seeds']}; "
        f"{opts['eval_size']} query episodes per point. {report.over_seeds(result['seeds'])}",
        "",
        "Accuracy against the number of demonstrations:",
        "",
        "| C | model | " + " | ".join(report.count(k, "shot") for k in opts["eval_shots"]) + " |",
        "|---|---|" + "---|" * len(opts["eval_shots"]),
    ]
    for c in opts["classes"]:
        for a in report.PAIR:
            rows = [e["shots"][str(c)] for e in result["evals"] if e["attention"] == a]
            cells = [report.mean_sd([r[i] for r in rows]) for i in range(len(opts["eval_shots"]))]
            lines.append(f"| {c} | {report.NAMES[a]} | " + " | ".join(cells) + " |")
    size = opts["eval_size"]
    lines += [
        "",
        "DIFF minus standard, paired by seed (a pair shares the initialisation of its shared layers and its data): "
        "the mean difference in accuracy [95% t interval over the seeds]. One model's accuracy on "
        f"{size} episodes has a sampling error (one standard error) of at most {stats.binomial_se(0.5, size):.3f}.",
        "",
        "| C | " + " | ".join(report.count(k, "shot") for k in opts["eval_shots"]) + " |",
        "|---|" + "---|" * len(opts["eval_shots"]),
    ]
    for c in opts["classes"]:
        cells = []
        for i in range(len(opts["eval_shots"])):
            d = report.paired_difference(result, lambda e, c=c, i=i: e["shots"][str(c)][i])
            cells.append(f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    most = opts["eval_shots"][-1]
    lines += [
        "",
        f"What the query's answer was at {most} demonstrations (mean over seeds): correct / another label the "
        "demonstrations show / another token of the prompt / a token not in the prompt at all (a contextual "
        "hallucination). When the query's class has no demonstration, no answer can be right.",
        "",
        "| C | DIFF | standard |",
        "|---|---|---|",
    ]
    for c in opts["classes"]:
        cells = []
        for a in report.PAIR:
            rows = [e["answers"][str(c)] for e in result["evals"] if e["attention"] == a]
            cells.append(" / ".join(f"{report.mean([r[kind] for r in rows]):.3f}" for kind in ANSWER_KINDS))
        lines.append(f"| {c} | {cells[0]} | {cells[1]} |")
    seeds = result["seeds"]
    over = "mean +- std over seeds, with their range" if len(seeds) > 1 else report.seeds_label(seeds)
    lines += [
        "",
        f"Order robustness, {opts['order_shots']} balanced demonstrations, the same episodes in "
        f"{result['order_seeds']} orders per arrangement: mean accuracy, and best minus worst accuracy over the "
        f"orders in points ({over}). Paper (TREC): random order standard 19.0 vs DIFF "
        "4.0; alternating by class 56.7 vs 13.4. Sampling error: the standard error of a seed's best minus worst "
        "accuracy as a paired difference on the same episodes (mean over seeds, points), and on how many seeds the "
        "spread is more than twice its standard error (larger than its sampling error).",
        "",
        "| C | arrangement | DIFF accuracy | standard accuracy | DIFF best-worst | standard best-worst | "
        "SE, DIFF / standard | seeds > 2 SE, DIFF / standard |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in opts["classes"]:
        for arrangement in result["arrangements"]:
            acc, spr, se, beyond = [], [], [], []
            for a in report.PAIR:
                evals = [e for e in result["evals"] if e["attention"] == a]
                spreads = [spread(e["orders"][str(c)][arrangement]) for e in evals]
                errors = [e["order_spread_se"][str(c)][arrangement] for e in evals]
                acc.append(report.mean_std([report.mean(e["orders"][str(c)][arrangement]) for e in evals], 3))
                spr.append(report.mean_std(spreads, 1))
                se.append(f"{report.mean(errors):.1f}")
                beyond.append(f"{sum(x > 2 * e for x, e in zip(spreads, errors, strict=True))}/{len(evals)}")
            lines.append(
                f"| {c} | {arrangement} | {acc[0]} | {acc[1]} | {spr[0]} | {spr[1]} | {' / '.join(se)} | "
                f"{' / '.join(beyond)} |"
            )
    lines += ["", report.curve_table(result["runs"], f"accuracy, C={CURVE_CLASSES}"), "", report.images(TASK), ""]
    return "\n".join(lines)


def draw(result: dict, out: Path) -> None:
    """The report's figures from its result: accuracy against demonstrations, and the learning curves."""
    _plot_shots(result, out)
    report.plot_curves(
        result["runs"], out / f"{TASK}_curves.png", f"accuracy, C={CURVE_CLASSES}", "in-context learning"
    )


def _plot_shots(result: dict, out: Path) -> None:
    plt = figures.pyplot()
    opts = result["spec"]["task"]
    classes = opts["classes"]
    fig, axes = plt.subplots(1, len(classes), figsize=(4 * len(classes), 3.2), sharey=True)
    for ax, c in zip(axes, classes, strict=True):
        for a in report.PAIR:
            rows = [e["shots"][str(c)] for e in result["evals"] if e["attention"] == a]
            means = [report.mean([r[i] for r in rows]) for i in range(len(opts["eval_shots"]))]
            errs = [report.std([r[i] for r in rows]) for i in range(len(opts["eval_shots"]))] if len(rows) > 1 else None
            ax.errorbar(opts["eval_shots"], means, yerr=errs, color=figures.COLORS[a], label=report.NAMES[a], capsize=3)
        ax.axhline(1 / c, color="gray", ls=":", lw=1, label="chance")
        ax.set_xscale("log", base=2)
        ax.set_xticks(opts["eval_shots"], [str(n) for n in opts["eval_shots"]])
        ax.minorticks_off()
        ax.set_xlabel("demonstrations")
        ax.set_title(f"{c} classes")
    axes[0].set_ylabel("query accuracy")
    title = f"in-context learning: accuracy against demonstrations ({report.seeds_label(result['seeds'])})"
    figures.finish(fig, out / f"{TASK}_shots.png", title)
