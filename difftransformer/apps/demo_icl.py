"""The demo's first part, 75 to 95 s on two idle cores: the effect the paper is about, at CPU scale.

A DIFF and a standard model, the matched pair of `difftx repro icl` (d_model 64, 2 layers, DIFF 2 heads against the
standard model's 4), train side by side, one process each, on its in-context learning task: each episode shows
demonstrations "feature label" of C classes (labels drawn afresh per episode), then a query feature whose label the
model must name. They train for the first STEPS steps of the committed study's seed-0 runs (its task, each
architecture's own learning rate, its 6000-step schedule), so what the demo prints can be read against that report.

Then, on 512 episodes of 4 classes with 24 demonstrations: each model's accuracy, and where its last layer's attention
at the query goes: to the demonstrations of the query's class (the positions that hold the answer) or to the other
demonstrations (the noise); the map is the differential map P1 - lambda P2 for DIFF (signed; its rows sum to
1 - lambda) and the softmax map for the standard model, averaged over the layer's heads and the episodes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch

from difftransformer.apps.analysis import allocation, attention_maps
from difftransformer.apps.repro import icl
from difftransformer.apps.repro.fit import ATTENTIONS, FitSpec, fit, run_pairs
from difftransformer.apps.repro.tasks import EXAMPLE_FEATURES, ICL_EXAMPLE, VOCAB, icl_batch
from difftransformer.errors import Interrupted
from difftransformer.fsutil import write_failure, write_json
from difftransformer.store.runs import save_run
from difftransformer.store.tokenizer import IdTokenizer

STEPS = 1500  # DIFF's seed-0 run of the committed study is at 0.97 at step 1000 and 1.00 from 1250 on
SEED = 0
CLASSES, SHOTS, SIZE = 4, 24, 512  # the evaluation: the study's curve's classes and demonstrations, its eval size
NAMES = {"diff": "DIFF", "standard": "standard"}
STUDY = Path(__file__).resolve().parents[2] / "experiments" / "reports" / "icl" / "results.json"
# part 1 on 2 idle Xeon cores, the two models in parallel (2026-12-07): 75 s in a fresh clone's make demo
# (benchmarks/results/demo_cpu-xeon-2core_2026-12-07), 93 s in `difftx demo --part icl` with its start-up
EXPECTED = "75 to 95 s on 2 idle CPU cores"


def spec() -> FitSpec:
    """The committed study's cpu scale, with the learning curve read every 250 steps."""
    return replace(icl.SCALES["cpu"], eval_every=250)


def train_job(attention: str, seed: int, steps: int, out: Path) -> dict:
    """One model (in a worker process): trained, saved under out/models, measured."""
    s = spec()
    record, model = fit(
        attention,
        seed,
        s,
        partial(icl.sample, classes=s.task["classes"], shots=s.task["shots"]),
        partial(icl.curve_score, shots=SHOTS, size=256),
        stop=steps,
    )
    meta = {"experiment": "demo-icl", "seed": seed, "spec": asdict(s), "stop": steps}
    save_run(model, IdTokenizer(VOCAB), out / "models" / f"icl-{attention}", meta, steps)
    return {**record, **measure(model)}


@torch.no_grad()
def measure(model) -> dict:
    """Accuracy at CLASSES and at 8 classes, the last layer's attention at the query (answer and noise shares, signed
    and absolute, averaged over heads and episodes; ``even``: the answer's share of the context's positions, what
    attention spread evenly would give it), and one episode's row with its answer positions, for the figure."""
    eps = icl.episodes(CLASSES, SHOTS, SIZE)
    batch = icl_batch(eps)
    b, t = batch.tokens.shape
    same = (eps.demo_classes == eps.query_class[:, None]).repeat_interleave(ICL_EXAMPLE, dim=1)  # (B, 2k)
    answer = torch.zeros(b, t, dtype=torch.bool)
    answer[:, : same.shape[1]] = same
    context = torch.zeros_like(answer)
    context[:, : t - EXAMPLE_FEATURES] = True  # the demonstrations; the query's feature counts in neither
    last = attention_maps(model, batch.tokens)[-1].mixed
    shares = allocation(last, batch.query_pos, answer, context)
    row = last[0, :, batch.query_pos[0], : t - EXAMPLE_FEATURES].mean(0)
    return {
        "accuracy": icl.accuracy(model, eps),
        "accuracy_8": icl.accuracy(model, icl.episodes(8, SHOTS, SIZE)),
        "shares": {k: v.mean().item() for k, v in shares.items()},
        "even": (answer & context).sum(-1).float().div(context.sum(-1)).mean().item(),
        "example": {"row": row.tolist(), "answer": answer[0, : t - EXAMPLE_FEATURES].tolist()},
    }


def done(out: Path) -> dict | None:
    """The part's results when ``out`` holds them (a finished part 1), else None."""
    try:
        return json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return None


def run(out: Path, steps: int = STEPS, workers: int | None = None, resume_hint: str = "") -> dict:
    """Train the pair into ``out`` (or read the finished part there), print what it found, draw attention.png."""
    result = done(out)
    if result is None:
        shutil.rmtree(out / "models", ignore_errors=True)  # an unfinished part 1 starts again from the beginning
        out.mkdir(parents=True, exist_ok=True)  # from here on the demo's folder is one a resume goes on with
        workers = workers or min(2, os.cpu_count() or 1)
        print(
            f"part 1 of 2, in-context learning: DIFF and standard trained side by side ({workers} process"
            f"{'es' if workers > 1 else ''}, one thread each) for {steps} steps; "
            + (f"{EXPECTED}" if steps == STEPS else f"{steps} of the {STEPS} steps the default takes")
            + ". Each episode shows 'feature label' demonstrations of 2, 4 or 8 classes, whose labels change from "
            "episode to episode, then a feature: the model must name its class's label from the demonstrations alone",
            flush=True,
        )
        title = f"demo part 1: DIFF and standard, {min(workers, 2)} at a time"
        try:
            runs = run_pairs(partial(train_job, steps=steps, out=out), [SEED], workers, steps, "icl", title)
        except KeyboardInterrupt as err:
            signum = getattr(err, "signum", int(signal.SIGINT))
            raise Interrupted(signum, f"stopped by {signal.Signals(signum).name} in the demo's first part (it "
                                      f"starts again from the beginning){resume_hint}") from None  # fmt: skip
        except OSError as err:  # a full disk: nothing of part 1 is kept
            shutil.rmtree(out, ignore_errors=True)
            failure = write_failure(err, f"the demo's part 1 {out}")
            if failure is None or str(err.strerror).startswith("could not write"):  # not a write, or named already
                raise
            raise failure from err
        result = {
            "steps": steps,
            "seed": SEED,
            "spec": asdict(spec()),
            "evaluation": {"classes": CLASSES, "shots": SHOTS, "episodes": SIZE},
            "runs": {r["attention"]: r for r in runs},
        }
        draw(result, out / "attention.png")
        write_json(out / "results.json", result, indent=2)  # last: the part is finished when it is there
    for line in summary(result):
        print(line)
    print(f"figure: {out / 'attention.png'}", flush=True)
    return result


def summary(result: dict) -> list[str]:
    """What part 1 found, in words, with the committed study's numbers beside it."""
    runs, steps = result["runs"], result["steps"]
    d, s = runs["diff"], runs["standard"]
    lines = [
        f"\nafter {steps} steps, on {SIZE} new episodes of {CLASSES} classes with {SHOTS} demonstrations (guessing "
        f"one of the labels shown scores 1/{CLASSES} = {1 / CLASSES:.2f}):",
        f"  accuracy: DIFF {d['accuracy']:.2f}, standard {s['accuracy']:.2f} (higher is better); with 8 classes: "
        f"DIFF {d['accuracy_8']:.2f}, standard {s['accuracy_8']:.2f}",
        "  the last layer's attention at the query, on the demonstrations of the query's class (the answer) and on "
        f"the others (noise); spread evenly, the answer would get {d['even']:.2f}:",
    ]
    for kind in ATTENTIONS:
        sh = runs[kind]["shares"]
        lines.append(f"    {NAMES[kind]:>8}: answer {sh['answer']:+.2f}, noise {sh['noise']:+.2f}")
    lines.append(
        "  DIFF's map is P1 - lambda P2: its weights can be negative, and a weight below zero on the noise is the "
        "cancellation the paper describes"
    )
    lines += study_lines(steps)
    return lines


def study_lines(steps: int, path: Path = STUDY) -> list[str]:
    """The committed study's accuracy at CLASSES classes and SHOTS demonstrations (mean over its seeds), beside a
    part 1 of ``steps`` steps."""
    try:
        study = json.loads(path.read_text())
        at = study["spec"]["task"]["eval_shots"].index(SHOTS)
        acc = {a: [e["shots"][str(CLASSES)][at] for e in study["evals"] if e["attention"] == a] for a in ATTENTIONS}
    except (OSError, ValueError, KeyError, IndexError):
        return [f"  (no committed in-context learning study at {path}: `difftx repro icl` makes one)"]
    where = path.with_name("report.md").relative_to(STUDY.parents[3])  # in the checkout
    n, full = len(acc["diff"]), study["spec"]["steps"]
    mean = {a: sum(v) / len(v) for a, v in acc.items()}
    return [
        f"  the committed study ({where}: {n} seeds, {full} steps) at {CLASSES} classes and {SHOTS} demonstrations: "
        f"DIFF {mean['diff']:.2f}, standard {mean['standard']:.2f}; this part is its seed-{SEED} pair's first "
        f"{steps} steps"
    ]


def draw(result: dict, path: Path) -> None:
    """attention.png: the accuracy curves, the answer and noise shares, and one episode's attention row."""
    from difftransformer.apps.figures import COLORS, finish, pyplot

    plt = pyplot()
    runs = result["runs"]
    fig, (curves, bars, example) = plt.subplots(1, 3, figsize=(13, 4.2), width_ratios=(1, 0.8, 1.6))
    for kind in ATTENTIONS:
        points = runs[kind]["curve"]
        curves.plot([p["step"] for p in points], [p["accuracy"] for p in points], "o-", color=COLORS[kind],
                    label=NAMES[kind])  # fmt: skip
    curves.axhline(1 / CLASSES, color="gray", linestyle=":", label=f"one of the {CLASSES} labels shown, at random")
    curves.set(xlabel="training step", ylabel="accuracy", ylim=(0, 1.02), title=f"accuracy, {CLASSES} classes")
    width = 0.38
    for i, kind in enumerate(ATTENTIONS):
        sh = runs[kind]["shares"]
        values = [sh["answer"], sh["noise"]]
        rects = bars.bar([x + (i - 0.5) * width for x in (0, 1)], values, width, color=COLORS[kind])
        bars.bar_label(rects, fmt="%+.2f", fontsize=8)
    bars.axhline(0, color="black", linewidth=0.8)
    bars.set_xticks([0, 1], ["answer", "noise"])
    bars.set(ylabel="sum of the attention weights", title="last layer, at the query")
    kind_rows = {k: runs[k]["example"]["row"] for k in ATTENTIONS}
    answer = runs["diff"]["example"]["answer"]
    positions = range(len(answer))
    label = "the answer: the query's class's demonstrations"
    for p in positions:
        if answer[p]:
            example.axvspan(p - 0.5, p + 0.5, color="gold", alpha=0.35, linewidth=0, label=label)
            label = "_"  # one legend entry
    for kind in ATTENTIONS:
        example.plot(positions, kind_rows[kind], ".-", color=COLORS[kind])
    example.axhline(0, color="black", linewidth=0.8)
    example.set(xlabel="position in the prompt", ylabel="attention weight", title="one episode, at the query")
    finish(fig, path, f"In-context learning after {result['steps']} steps: where the attention goes", dpi=110)
