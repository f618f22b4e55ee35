"""Multi-needle retrieval: matched DIFF / standard pairs trained on the needle task, scored by (N, R) and by
depth x length (docs/paper.md section 3)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from difftransformer.apps import figures
from difftransformer.apps.repro import report, stats, tasks
from difftransformer.apps.repro.fit import (
    FitSpec,
    fit,
    save_and_evaluate,
)
from difftransformer.apps.repro.tasks import NeedleBatch, needle_batch
from difftransformer.errors import InputError

TASK = "needle"
SCALES = {
    "cpu": FitSpec(  # calibrated (experiments/LOG.md, needle calibration rounds 4 to 13)
        d_model=64, n_layers=2, n_heads=4, seq_len=64, steps=6000, batch_size=32, lr={"diff": 1e-3, "standard": 5e-4},
        init_std=0.07, eval_every=500,
        task=dict(needles=[2, 4, 6], queries="all", vocab="disjoint", lengths=[32, 48, 64], eval_size=512,
                  eval_key_noise=[0.0, 0.1, 0.25, 0.5, 0.75, 0.9], eval_needles=[8, 10, 12]),
    ),
    "gpu": FitSpec(  # not calibrated: no GPU session has run it
        d_model=256, n_layers=8, n_heads=16, seq_len=512, steps=20000, batch_size=64, lr=1e-3, eval_every=1000,
        task=dict(needles=[2, 4, 6, 8], queries=2, lengths=[128, 256, 512], eval_size=2048),
    ),
}  # fmt: skip
NR_GRID = [(1, 1), (2, 2), (4, 2), (6, 2)]
PAPER_NR = {"diff": [1.00, 0.92, 0.84, 0.85], "standard": [1.00, 0.85, 0.62, 0.55]}  # 4K, docs/paper.md 3
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
GRID_NEEDLES = (4, 2)  # (N, R) of the depth x length grid, the curves and the allocation measurement
EVAL_SEED = 1_000_003  # every model is scored on the same examples
ANSWER_KINDS = ("correct", "other_needle", "in_context", "not_in_context")
EVAL_OPTIONS = ("lengths", "eval_size", "eval_key_noise", "eval_needles")  # task options only the evaluation reads


class Sampler:
    """The training batches of a needle run, one call per step: N is drawn per batch from the needles of the
    curriculum's current stage ([[until_step, needles], ...]; the last stage's needles after its step), with R = N
    queries when ``queries`` is "all", else R = min(queries, N). Every query's answer is trained."""

    def __init__(self, length: int, curriculum: list, queries: int | str, vocab: str, key_noise: float):
        ends = [stage[0] if isinstance(stage, (list, tuple)) and len(stage) == 2 else None for stage in curriculum]
        if not curriculum or None in ends or any(not (isinstance(s[1], list) and s[1]) for s in curriculum):
            raise InputError(f"`curriculum` must be a non-empty list of [until_step, [N, ...]], got {curriculum}")
        if ends != sorted(set(ends)):
            raise InputError(f"the `curriculum` stages' until_steps must increase, got {ends}")
        if queries != "all" and not (isinstance(queries, int) and queries >= 1):
            raise InputError(f'`queries` must be a positive number or "all", got {queries!r}')
        self.length, self.curriculum, self.queries, self.step = length, curriculum, queries, 0
        self.task = dict(vocab=vocab, key_noise=key_noise)

    def __call__(self, gen: torch.Generator, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        needles = next((n for until, n in self.curriculum if self.step < until), self.curriculum[-1][1])
        self.step += 1
        n = needles[int(torch.randint(0, len(needles), (), generator=gen))]
        r = n if self.queries == "all" else min(self.queries, n)
        nb = needle_batch(gen, batch, self.length, n, r, **self.task)
        return nb.tokens, nb.targets


def sampler(spec: FitSpec) -> Sampler:
    """The Sampler of ``spec``: its task's curriculum, or its ``needles`` at every step. Checks the evaluation's
    options too, so that a spec that cannot be evaluated fails before training rather than after it."""
    opts = spec.task
    if opts.get("eval_key_noise") and vocabulary(opts)["vocab"] != "disjoint":
        raise InputError('`eval_key_noise` (distractor keys in the filler) needs `vocab` "disjoint"')
    for m in opts.get("eval_needles", []):  # a trial example of each: its own errors name the problem
        needle_batch(torch.Generator(), 1, spec.seq_len, m, GRID_NEEDLES[1], vocab=vocabulary(opts)["vocab"])
    curriculum = opts.get("curriculum") or [[spec.steps, opts["needles"]]]
    return Sampler(spec.seq_len, curriculum, opts["queries"], **vocabulary(opts))


def vocabulary(task: dict) -> dict:
    """The needle_batch options of a task's vocabulary: vocab and key_noise (default: shared, no noise)."""
    return {"vocab": task.get("vocab", "shared"), "key_noise": task.get("key_noise", 0.0)}


def eval_set(
    n: int, r: int, length: int, size: int, depth: float | None = None, vocab: str = "shared", key_noise: float = 0.0
) -> NeedleBatch:
    """A fixed evaluation set: the same examples for every model (and every call) with these arguments."""
    seed = EVAL_SEED + 1000 * n + 100 * r + length + (0 if depth is None else int(depth * 100) + 7)
    gen = torch.Generator().manual_seed(seed)
    return needle_batch(gen, size, length, n, r, depth, vocab=vocab, key_noise=key_noise)


def answer_kinds(pred: torch.Tensor, nb: NeedleBatch) -> dict[str, torch.Tensor]:
    """tasks.answer_kinds of each first-query prediction, the wrong real answers being the other needles' values
    (``other_needle``); the prompt is every token up to the answer's position."""
    return tasks.answer_kinds(pred, nb.answer, nb.other_values, nb.tokens, nb.answer_pos, "other_needle")


@torch.no_grad()
def outcomes(model, nb: NeedleBatch) -> dict[str, float]:
    """Shares of the first query's predictions of each kind (answer_kinds)."""
    logits = model(nb.tokens)[torch.arange(len(nb.answer)), nb.answer_pos]
    return {kind: mask.float().mean().item() for kind, mask in answer_kinds(logits.argmax(-1), nb).items()}


def curve_score(model, spec: FitSpec, size: int) -> float:
    """The learning curve's measure: first-query accuracy at GRID_NEEDLES on a fixed set."""
    n, r = GRID_NEEDLES
    return round(outcomes(model, eval_set(n, r, spec.seq_len, size, **vocabulary(spec.task)))["correct"], 4)


def train_job(attention: str, seed: int, spec: FitSpec, out: Path) -> dict:
    """Train one model and evaluate it (in the worker, so that evaluations run in parallel too)."""
    score = partial(curve_score, spec=spec, size=min(256, spec.task["eval_size"]))
    record, model = fit(attention, seed, spec, sampler(spec), score)
    return save_and_evaluate(record, model, out, TASK, spec, evaluate)


def evaluate(model, spec: FitSpec) -> dict:
    """Outcome shares by (N, R) at the training length, accuracy by length x depth at GRID_NEEDLES, outcome
    shares at GRID_NEEDLES with each ``eval_key_noise`` share of the filler replaced by distractor keys, and outcome
    shares with each of ``eval_needles`` needles (R = 2; more than trained), at the training length."""
    size, words = spec.task["eval_size"], vocabulary(spec.task)
    by_nr = {f"{n},{r}": outcomes(model, eval_set(n, r, spec.seq_len, size, **words)) for n, r in NR_GRID}
    n, r = GRID_NEEDLES
    grid = [
        [outcomes(model, eval_set(n, r, length, size // 2, depth, **words))["correct"] for depth in DEPTHS]
        for length in spec.task["lengths"]
    ]
    noise = {  # distractor keys (without a MARK) in the filler, at levels the models were not trained on
        str(level): outcomes(model, eval_set(n, r, spec.seq_len, size, vocab=words["vocab"], key_noise=level))
        for level in spec.task.get("eval_key_noise", [])
    }
    more = {
        str(m): outcomes(model, eval_set(m, r, spec.seq_len, size, **words)) for m in spec.task.get("eval_needles", [])
    }
    return {"by_nr": by_nr, "depth_length": grid, "by_key_noise": noise, "by_needles": more}


RECORDED = {"nr_grid": NR_GRID, "depths": DEPTHS, "grid_needles": GRID_NEEDLES, "paper": {"nr": PAPER_NR}}


def markdown(result: dict) -> str:
    spec, seeds = result["spec"], result["seeds"]
    lines = [
        "## Multi-needle retrieval",
        "",
        *report.logit_bits_note(spec),
        *report.source_note(result),
        f"{report.models_text(spec)}; {training_data(spec['task'])}; seeds {seeds}. "
        "Needle = [MARK, key, value] in random filler; R queries [QRY, key] ask distinct needles; only the first "
        f"query is scored. {report.over_seeds(seeds)} The paper's 4K-context numbers beside.",
        "",
        "| (N, R) | DIFF correct | standard correct | paper DIFF | paper standard | random needle 1/N |",
        "|---|---|---|---|---|---|",
    ]
    for i, (n, r) in enumerate(result["nr_grid"]):
        key = f"{n},{r}"
        cells = [report.mean_std(_values(result, a, _outcome("by_nr", key, "correct"))) for a in report.PAIR]
        paper = [f"{result['paper']['nr'][a][i]:.2f}" for a in report.PAIR]
        lines.append(f"| ({n}, {r}) | {cells[0]} | {cells[1]} | {paper[0]} | {paper[1]} | {1 / n:.2f} |")
    size = spec["task"]["eval_size"]
    lines += [
        "",
        "DIFF minus standard, paired by seed (a pair shares the initialisation of its shared layers and its data): "
        f"the mean difference in accuracy and its 95% t interval over the seeds. One model's accuracy on {size} "
        f"examples has a sampling error (one standard error) of at most {stats.binomial_se(0.5, size):.3f}.",
        "",
        "| (N, R) | DIFF - standard | 95% interval | per seed |",
        "|---|---|---|---|",
    ]
    for n, r in result["nr_grid"]:
        d = report.paired_difference(result, _outcome("by_nr", f"{n},{r}", "correct"))
        per_seed = " ".join(f"{x:+.2f}" for x in d["differences"])
        lines.append(f"| ({n}, {r}) | {d['mean']:+.3f} | [{d['low']:+.3f}, {d['high']:+.3f}] | {per_seed} |")
    lines += [
        "",
        "What the first query's answer was (mean over seeds): correct / another needle's value / another token of "
        "the prompt / a token not in the prompt at all (a contextual hallucination). Accuracy above the "
        "random-needle baseline 1/N is what shows matching the key.",
        "",
        "| (N, R) | DIFF | standard |",
        "|---|---|---|",
    ]
    for n, r in result["nr_grid"]:
        key = f"{n},{r}"
        cells = []
        for a in report.PAIR:
            shares = [report.mean(_values(result, a, _outcome("by_nr", key, kind))) for kind in ANSWER_KINDS]
            cells.append(" / ".join(f"{x:.2f}" for x in shares))
        lines.append(f"| ({n}, {r}) | {cells[0]} | {cells[1]} |")
    n, r = result["grid_needles"]
    task = spec["task"]
    stresses = (  # (the paragraph, the field, the rows' name, each row's label): those the evaluation ran
        (f"Distractor keys: N={n}, R={r}, with this share of the filler tokens replaced by random keys (without a "
         f"MARK); trained with key noise {task.get('key_noise', 0.0)}.", "by_key_noise", "key noise",
         {str(x): f"{x:.0%}" for x in task.get("eval_key_noise", [])}),
        (f"More needles than trained (N up to {max(_trained_needles(task))} in training): R={r}, the training "
         f"length {spec['seq_len']}, the random-needle baseline 1/N in brackets.", "by_needles", "N",
         {str(m): f"{m} ({1 / m:.2f})" for m in task.get("eval_needles", [])}),
    )  # fmt: skip
    for text, field, name, rows in stresses:
        if rows:
            lines += ["", f"{text} {_stress_columns(seeds)}", "", *_stress_table(result, field, name, rows)]
    lines += ["", f"Accuracy by context length (rows) and answer depth (columns), N={n}, R={r}, mean over seeds:", ""]
    for a in report.PAIR:
        grid = report.mean_grid([e["depth_length"] for e in result["evals"] if e["attention"] == a])
        lines += [f"{report.NAMES[a]}:", "", "| length | " + " | ".join(f"{d:.0%}" for d in result["depths"]) + " |"]
        lines.append("|---|" + "---|" * len(result["depths"]))
        for length, row in zip(result["spec"]["task"]["lengths"], grid, strict=True):
            lines.append(f"| {length} | " + " | ".join(f"{x:.2f}" for x in row) + " |")
        lines.append("")
    lines += [report.curve_table(result["runs"], "accuracy (N=4, R=2)"), "", report.images(TASK), ""]
    return "\n".join(lines)


def _stress_columns(seeds: list[int]) -> str:
    accuracy = "mean +- standard deviation over seeds" if len(seeds) > 1 else report.seeds_label(seeds)
    return (
        f"Accuracy ({accuracy}), DIFF minus standard paired by seed [95% t interval] and per seed, the share of "
        "answers that are another needle's value, and the share not in the prompt at all (contextual hallucinations):"
    )


def _stress_table(result: dict, field: str, name: str, rows: dict[str, str]) -> list[str]:
    """A table of first-query outcomes at each evaluation level of ``field`` (rows: {level key: its label})."""
    lines = [
        f"| {name} | DIFF | standard | DIFF - standard | per seed | other needle, DIFF / standard | not in prompt, "
        "DIFF / standard |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, label in rows.items():
        acc = [report.mean_std(_values(result, a, _outcome(field, key, "correct"))) for a in report.PAIR]
        d = report.paired_difference(result, _outcome(field, key, "correct"))
        other, made_up = (
            [report.mean(_values(result, a, _outcome(field, key, kind))) for a in report.PAIR]
            for kind in ("other_needle", "not_in_context")
        )
        lines.append(
            f"| {label} | {acc[0]} | {acc[1]} | {d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}] | "
            f"{' '.join(f'{x:+.2f}' for x in d['differences'])} | {other[0]:.3f} / {other[1]:.3f} | "
            f"{made_up[0]:.3f} / {made_up[1]:.3f} |"
        )
    return lines


def _outcome(field: str, key: str, kind: str):
    """The getter of one outcome share of an evaluation: eval[field][key][kind]."""
    return lambda e: e[field][key][kind]


def _stages(task: dict) -> list:
    """A needle task's training stages, [[until_step, needles], ...] (one stage, until None, without a curriculum)."""
    return task.get("curriculum") or [[None, task["needles"]]]


def _trained_needles(task: dict) -> set[int]:
    """Every N a needle task trains on, over all its stages."""
    return {n for _, needles in _stages(task) for n in needles}


def training_data(task: dict) -> str:
    """The training batches of a needle task's options, in words."""
    stages = _stages(task)
    drawn = "; then ".join(
        f"N from {n}" + ("" if i == len(stages) - 1 else f" until step {until}") for i, (until, n) in enumerate(stages)
    )
    queries = "R = N queries" if task["queries"] == "all" else f"R = min({task['queries']}, N) queries"
    words = vocabulary(task)
    kind = (
        "keys, values and filler from one token set"
        if words["vocab"] == "shared"
        else (
            "keys, values and filler from separate token sets"
            + (f", {words['key_noise']:.0%} of the filler replaced by keys" if words["key_noise"] else "")
        )
    )
    return f"{drawn}, {queries} (each answer trained), {kind}"


def _values(result: dict, attention: str, get) -> list[float]:
    return [get(e) for e in result["evals"] if e["attention"] == attention]


def draw(result: dict, out: Path) -> None:
    """The report's figures from its result: accuracy by length and depth, and the learning curves."""
    plt = figures.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), layout="constrained")
    lengths = result["spec"]["task"]["lengths"]
    for ax, a in zip(axes, report.PAIR, strict=True):
        seeds = [e["depth_length"] for e in result["evals"] if e["attention"] == a]
        grid = report.mean_grid(seeds)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(result["depths"])), [f"{d:.0%}" for d in result["depths"]])
        ax.set_yticks(range(len(lengths)), lengths)
        ax.set_xlabel("answer depth")
        ax.set_ylabel("context length")
        ax.set_title(f"{report.NAMES[a]}: accuracy over {len(seeds)} seeds")
        for i, row in enumerate(grid):
            for j, x in enumerate(row):
                each = [seed[i][j] for seed in seeds]  # the spread over seeds, under the mean
                spread = f"\n{min(each):.2f}-{max(each):.2f}" if len(each) > 1 else ""
                ax.text(j, i, f"{x:.2f}{spread}", ha="center", va="center",
                        color="w" if x < 0.6 else "k", fontsize=8, linespacing=1.3)  # fmt: skip
    fig.colorbar(im, ax=axes, label="accuracy (mean over seeds)")
    run_seeds = result["seeds"]
    cells = "each cell: the mean; below it, the seeds' range" if len(run_seeds) > 1 else report.seeds_label(run_seeds)
    title = f"needle retrieval accuracy by context length and depth ({cells})"
    figures.finish(fig, out / f"{TASK}_depth_length.png", title)
    report.plot_curves(result["runs"], out / f"{TASK}_curves.png", "accuracy, N=4 R=2", "needle retrieval")
