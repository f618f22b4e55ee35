"""`make demo` / `difftx demo`: train the matched tiny models side by side on the built-in corpus (DIFF V1 as the
paper has it, the same with its per-head norm started at the matched gain, and the standard Transformer), print their
validation losses as they train, sample from each, and write a report to runs/demo/."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch

from difftransformer.apps import demo_icl
from difftransformer.core.model import TransformerLM, count_parameters
from difftransformer.errors import InputError, Interrupted
from difftransformer.fsutil import shell, write_json, write_text_atomic
from difftransformer.inference.generate import generate
from difftransformer.progress import Progress
from difftransformer.store import corpus
from difftransformer.store.data import prepare, read_manifest
from difftransformer.store.tokenizer import ByteTokenizer
from difftransformer.threads import WAIT_POLICY, describe
from difftransformer.training.interrupts import StopSignals
from difftransformer.training.loop import TrainConfig, Trainer

PROMPTS = ("Return the ", "The module ", "If the ")
PARTS = ("both", "icl", "lm")  # part 1 (in-context learning, demo_icl), part 2 (the language models), or both
ICL = "icl"  # part 1's folder in the demo's directory
REPORTS = Path(__file__).resolve().parents[2] / "experiments" / "reports"
STUDY = REPORTS / "lm" / "results.json"
NORM_STUDY = REPORTS / "lm-norm" / "results.json"  # the norm part's report, beside the study's (its own runs)
# the demo's models: name -> (attention, ModelConfig overrides); the name is its run's folder in the demo's directory
MODELS = {
    "diff": ("diff", {}),  # V1 as the paper has it: the per-head norm starts at weight 1
    "diff-matched": ("diff", {"head_norm_gain": "matched"}),  # the norm started at the matched gain, layer by layer
    "standard": ("standard", {}),
}
KINDS = tuple(MODELS)
NAMES = {"diff": "DIFF", "diff-matched": "DIFF matched", "standard": "standard"}  # in the text and the figures
# the part on idle 2-core Xeon VMs, one step of each of the three models in turn: 6m24s with the corpus prepared
# (2026-12-05), 5m41s (a fresh clone's make demo, 2026-12-07: benchmarks/results/demo_cpu-xeon-2core_2026-12-07)
EXPECTED = "about 6 minutes on 2 idle CPU cores"
# the pace of that run's training (240 rounds of three steps in 6m11s, validations included), for the live line to
# name a pace far below it (Progress's `expected`); only at the demo's default shape
REFERENCE_PACE = (240 / 371, "2 idle cores' pace")


def demo_data(path: Path) -> Path:
    """The built-in corpus prepared with the byte tokenizer, reused when already there."""
    try:
        read_manifest(path)
        return path
    except FileNotFoundError:
        pass
    print(f"preparing the built-in corpus (CPython's documentation) into {path} ...", flush=True)
    prepare(corpus.pydocs_documents(), ByteTokenizer(), path, sources=["pydocs"])
    return path


def free_run_dir(base: Path) -> Path:
    """runs/demo, or runs/demo-2, -3, ... when an earlier demo's report is there (never overwritten)."""
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def interrupted(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a demo that stopped before its report (a part's folder, no report.md)."""
    parts = (*KINDS, ICL)
    return run_dir.is_dir() and not (run_dir / "report.md").exists() and any((run_dir / k).is_dir() for k in parts)


def resume_command(run_dir: Path) -> str:
    return f"difftx demo --resume --out {shell(str(run_dir))}"


def _resumed_dir(out: Path) -> Path:
    if interrupted(out):
        return out
    if (out / "report.md").exists():
        raise InputError(f"{out} holds a finished demo (its report.md): nothing to resume; run difftx demo without "
                         "--resume for a new one")  # fmt: skip
    raise InputError(f"{out} holds no interrupted demo to resume: give --out the folder an interrupted demo named")


def map_properties(model: TransformerLM, tokens: torch.Tensor) -> dict:
    """Row sums and sign of the last layer's differential map on ``tokens``."""
    last = model.layers[-1]
    with torch.no_grad():
        x = model.embed(tokens)
        for block in model.layers[:-1]:
            x = block(x)
        _, weights = last.attn(last.attn_norm(x), need_weights=True)
    lam = last.attn.lambda_full().item()
    return {
        "lambda": lam,
        "row_sum_error": (weights.sum(-1) - (1 - lam)).abs().max().item(),
        "negative_share": (weights < 0).float().mean().item(),
    }


def demo_config(
    kind: str,
    data: str | Path,
    out: str | Path,
    steps: int = 240,
    eval_every: int = 40,
    seq_len: int = 256,
    batch_size: int = 16,
) -> TrainConfig:
    """The demo's training run of the model ``kind`` (one of MODELS; configs/demo-KIND.toml holds the same)."""
    attention, overrides = MODELS[kind]
    return TrainConfig(
        data=str(data),
        out=str(out),
        preset="tiny",
        attention=attention,
        model=dict(overrides),
        seq_len=seq_len,
        batch_size=batch_size,
        max_steps=steps,
        lr=3e-3,
        warmup_steps=max(1, steps // 10),
        eval_interval=eval_every,
        log_interval=max(1, eval_every // 4),
        ckpt_interval=steps,
        keep_last=1,
        seed=0,
    )


def run_demo(
    steps: int = 240,
    eval_every: int = 40,
    seq_len: int = 256,
    batch_size: int = 16,
    out: str | Path = "runs/demo",
    data: str | Path = "data/pydocs",
    sample_tokens: int = 120,
    resume: bool = False,
    part: str = "both",
    icl_steps: int = demo_icl.STEPS,
) -> dict:
    """The demo: part 1, in-context learning (demo_icl), then part 2, the language models (``part``: "icl", "lm" or
    "both"); ``resume``: continue the interrupted demo in ``out`` (a finished part 1 is kept, each language model
    goes on from its newest checkpoint)."""
    if part not in PARTS:
        raise InputError(f"unknown part {part!r}; choose one of {', '.join(PARTS)}")
    run_dir = _resumed_dir(Path(out)) if resume else free_run_dir(Path(out))
    if run_dir != Path(out):
        earlier = "an earlier demo"
        if interrupted(Path(out)):
            earlier = f"an interrupted demo (resume it: {resume_command(Path(out))})"
        print(f"note: {out} holds {earlier}, kept as it is; this one writes {run_dir}", file=sys.stderr)
    part1 = None
    if part != "lm":
        hint = f"; {resume_command(run_dir)} runs it again and goes on"
        part1 = demo_icl.run(run_dir / ICL, icl_steps, resume_hint=hint)
        if part == "icl":
            write_text_atomic(run_dir / "report.md", "\n".join(icl_report(part1)))
            print(f"\nreport: {run_dir / 'report.md'}")
            return {"icl": part1}
        print(
            f"\nthe first result is above and drawn in {run_dir / ICL / 'attention.png'}: you can stop here (Ctrl-C; "
            f"part 1 is saved, and {resume_command(run_dir)} goes on to part 2)\n"
        )
    data_dir = demo_data(Path(data))
    trainers = {}
    default_shape = (seq_len, batch_size, eval_every) == (256, 16, 40)
    progress = Progress(steps, "demo, the three models in turn", expected=REFERENCE_PACE if default_shape else None)
    losses: dict[str, float] = {}

    def shown(kind: str, row: dict) -> None:  # the round's step and every model's latest loss on one live line
        losses[kind] = row["loss"]
        note = "training loss " + ", ".join(f"{NAMES[k]} {v:.3f}" for k, v in losses.items())
        progress.update(min(t.step_idx for t in trainers.values()), note=note)

    for kind in KINDS:
        cfg = demo_config(kind, data_dir, run_dir / kind, steps, eval_every, seq_len, batch_size)
        again = resume and (run_dir / kind).is_dir()  # a model the interruption reached before it started starts new
        trainers[kind] = Trainer(cfg, resume=again, quiet=True, on_step=lambda row, kind=kind: shown(kind, row))
    _introduce(trainers, steps, seq_len, batch_size)
    rows = {k: trainers[k].metric_rows() for k in KINDS}  # a resumed demo's rows so far; else none
    first = min(t.step_idx for t in trainers.values()) + 1
    for step in range(eval_every, first, eval_every):  # the table's rows before the interruption
        _table_row(progress, step, rows)
    seconds, timed = dict.fromkeys(KINDS, 0.0), 0
    progress.begin(first - 1)
    try:
        for step in range(first, steps + 1):
            validates = step % eval_every == 0 or step == steps
            shift = step % len(KINDS)
            for kind in KINDS[shift:] + KINDS[:shift]:  # who goes first rotates
                start = time.perf_counter()
                rows[kind].extend(trainers[kind].fit(until=step))
                if not validates:  # steps timed without a validation or a checkpoint: the same work for each
                    seconds[kind] += time.perf_counter() - start
            timed += not validates
            if validates:
                _table_row(progress, step, rows)
    except (Interrupted, KeyboardInterrupt) as err:  # every model saved where it is, then the way back
        progress.close()
        raise _stopped(trainers, run_dir, err) from None
    progress.close()
    for trainer in trainers.values():
        trainer.close()  # every run is complete: release their directories
    ratio = seconds["diff"] / seconds["standard"] if timed else math.nan
    if timed:
        print(
            f"\ntraining step time, DIFF / standard: {ratio:.2f} (the models' steps timed in turn over the {timed} "
            "steps without a validation, so a load on the machine slows each alike; a ratio, not a speed: "
            "`difftx bench` measures speeds)"
        )

    tok = trainers["diff"].tokenizer
    samples = {kind: [] for kind in KINDS}
    width = max(len(NAMES[k]) for k in KINDS)
    print()
    for kind in KINDS:
        for i, prompt in enumerate(PROMPTS):
            ids = generate(trainers[kind].model, tok.encode(prompt), sample_tokens, temperature=0.8, top_k=40, seed=i)
            text = (prompt + tok.decode(ids)).split("\n")[0]
            samples[kind].append(text)
            print(f"{NAMES[kind]:>{width}} | {text}")
    diff = trainers["diff"].model
    probe = trainers["diff"].val_windows[:1, :seq_len]
    props = map_properties(diff, probe)
    print(
        f"\ntrained DIFF, last layer: rows of the differential map sum to 1 - lambda = {1 - props['lambda']:.4f} "
        f"(max deviation {props['row_sum_error']:.1e}); {props['negative_share']:.1%} of its attention weights are "
        "negative"
    )
    summary = {
        "steps": steps,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "threads": torch.get_num_threads(),
        "openmp_wait_policy": os.environ.get(WAIT_POLICY),
        "parameters": {k: trainers[k].model.num_parameters() for k in KINDS},
        "head_norm_gains": {k: trainers[k].model.config.head_norm_gains() for k in ("diff", "diff-matched")},
        "step_seconds": {k: seconds[k] / timed if timed else None for k in KINDS},  # each model's, timed in turn
        "timed_steps": timed,
        "step_time_ratio": ratio if timed else None,
        "final": {k: {key: rows[k][-1][key] for key in ("val_loss", "val_bpb", "loss")} for k in KINDS},
        "lambda_final": rows["diff"][-1]["lambda"],
        "map": props,
        "samples": samples,
    }
    try:  # report.md comes last: until it is there, the demo is one a resume finishes (its models are all saved)
        write_report(run_dir, rows, summary, part1)
    except OSError as err:  # a full disk
        raise OSError(err.errno, f"{err.strerror or err}; the models are trained and saved: once that is fixed, "
                                 f"{resume_command(run_dir)} writes the report") from err  # fmt: skip
    except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM, SIGHUP
        signum = getattr(err, "signum", int(signal.SIGINT))
        stopped = f"stopped by {StopSignals.name(signum)} while writing the report of {run_dir}"
        saved = f"the models are trained and saved: {resume_command(run_dir)} writes it"
        raise Interrupted(signum, f"{stopped}; {saved}") from None
    final = {k: summary["final"][k]["val_loss"] for k in KINDS}
    base = final["standard"]
    gaps = ", ".join(f"{NAMES[k]} - standard {final[k] - base:+.4f} ({(final[k] - base) / base:+.1%})"
                     for k in KINDS if k != "standard")  # fmt: skip
    print(
        "\nthis demo, validation loss in nats per token: "
        + ", ".join(f"{NAMES[k]} {final[k]:.4f}" for k in KINDS)
        + f"; {gaps}: one seed, one small size (4 differential heads), {steps} steps each"
    )
    for line in study_context():
        print(line)
    print(f"\nreport: {run_dir / 'report.md'}")
    return summary


def _introduce(trainers: dict[str, Trainer], steps: int, seq_len: int, batch_size: int) -> None:
    """What the models are, what the demo does and how to read its table."""
    diff, std = trainers["diff"].model, trainers["standard"].model
    own = count_parameters(diff.config, exclude_embeddings=True) / 1e6
    print(
        "part 2 of 2, language models: tiny DIFF and standard models trained on text, where the project's studies "
        f"find the paper's V1 behind at a smaller size (267k non-embedding parameters, these {own:.1f}M; the "
        f"study's numbers are printed at the end); {EXPECTED}"
    )
    n_diff, n_std = diff.num_parameters(), std.num_parameters()
    vocab, width = diff.config.vocab_size, diff.config.d_model
    print(
        f"tiny DIFF: {n_diff:,} parameters ({diff.config.attention_heads} differential heads); tiny standard: "
        f"{n_std:,} ({std.config.n_heads} heads); difference {n_diff - n_std:+,} = {diff.config.n_layers} layers x 6 x "
        f"head size {diff.config.attention_head_dim} (the lambda vectors and the per-head norm)"
    )
    print(
        f"(`difftx presets` counts {vocab - 1} tokens; the byte tokenizer has {vocab}, the 256 bytes and an "
        f"end-of-document token, so each model has 2 x {width} = {2 * width} parameters more here: one "
        "embedding row and one output row)"
    )
    print("lambda_init per layer:", " ".join(f"{b.attn.lambda_init:.3f}" for b in diff.layers))
    gains = trainers["diff-matched"].model.config.head_norm_gains()
    print(
        "the DIFF model is the paper's V1 as published: each head's output RMS-normalised with a learned weight that "
        "starts at 1, then scaled by 1 - lambda_init. DIFF matched is the same model (the same parameters) with "
        "that weight started, layer by layer, at the gain that gives its attention block the standard model's "
        'output RMS at initialisation (ModelConfig(head_norm_gain="matched"); docs/guide/modules.md): '
        + " ".join(f"{g:.3f}" for g in gains)
        + ". What the project's studies found at small sizes is printed at the end"
    )
    print(
        f"training each on {trainers['diff'].train_data.n_tokens:,} tokens of CPython documentation: {steps} steps "
        f"each of {batch_size} x {seq_len} tokens, one step of each model in turn, "
        f"{describe(torch.get_num_threads())}; {EXPECTED} (the live line below estimates this machine's)"
    )
    print(
        f"the table: validation loss in nats per token (a token is a byte or the end of a document; lower is "
        f"better; a model that knew nothing would score ln {vocab} = {math.log(vocab):.2f}) and in bits per byte\n"
    )
    print(f"{'step':>6} " + " ".join(label for label, _, _, _ in _table_columns()))


def _table_columns() -> list[tuple[str, str, str, str]]:
    """The table's columns after the step: (heading, model, metric, format), each value as wide as its heading."""
    return [(f"{short} {NAMES[k]}", k, metric, fmt) for short, metric, fmt in
            (("loss", "val_loss", ".4f"), ("bpb", "val_bpb", ".3f")) for k in KINDS]  # fmt: skip


def _table_row(progress: Progress, step: int, rows: dict[str, list[dict]]) -> None:
    last = {k: next(r for r in reversed(rows[k]) if r["step"] == step and "val_loss" in r) for k in KINDS}
    cells = [f"{last[k][metric]:>{len(label)}{fmt}}" for label, k, metric, fmt in _table_columns()]
    progress.write(f"{step:>6} " + " ".join(cells))


def _stopped(trainers: dict[str, Trainer], run_dir: Path, err: BaseException) -> Interrupted:
    """After SIGINT or SIGTERM: a checkpoint of each model at its step (the one that was training wrote its own),
    their directories released, and the command that resumes the demo."""
    for trainer in trainers.values():
        if trainer.step_idx > 0 and trainer.saved_step != trainer.step_idx:
            trainer.save()
        trainer.close()
    at = ", ".join(f"{NAMES[k]} at step {t.step_idx}" for k, t in trainers.items())
    signum = getattr(err, "signum", int(signal.SIGINT))  # Interrupted, Stopped (SIGTERM, SIGHUP) or Ctrl-C
    return Interrupted(signum, f"stopped by {StopSignals.name(signum)}: the demo in {run_dir} is saved ({at}); "
                               f"resume it with: {resume_command(run_dir)}")  # fmt: skip


def study_context(path: Path = STUDY, norm_path: Path | None = NORM_STUDY) -> list[str]:
    """What the committed `difftx repro lm` report found, to read the demo's numbers against; the norm part from
    ``path``'s report when it holds one, else from ``norm_path``'s (None: none)."""
    result = _read_report(path)
    if result is None:
        return [f"(no committed language-model study at {path}: run `difftx repro lm` for seeded comparisons)"]
    where = os.path.relpath(path.with_name("section.md"))
    name = result["scale"]["name"] if "scale" in result else "cpu"
    lines = [f"the committed study (`difftx repro lm --scale {name}`, {where}; BPE text, each architecture at "
             "its own best learning rate, matched data and initialisation):"]  # fmt: skip
    if "norm" in result or norm_path is None:
        from difftransformer.apps.repro.lm_norm_report import summary

        norm = summary(result.get("norm"), where, "  ")
    else:
        norm = norm_context(norm_path, "  ")
    lines += norm or _long_lines(result.get("long"))  # the norm part answers the long part's question, tuned fairly
    if "scale" in result:
        lines += _short_lines(result)
    if len(lines) == 1:
        lines.append("  (its grid is not complete yet)")
    lines.append(
        "  the paper's advantage was measured at 0.8B-13B parameters and billions of tokens; at small sizes the "
        "study above is the number to compare with, not the paper's"
    )
    return lines


def norm_context(path: Path | None = None, indent: str = "") -> list[str]:
    """The norm part's answer in ``path``'s report (default: the committed one, NORM_STUDY), by
    ``lm_norm_report.summary``; none while the report is missing or partial."""
    from difftransformer.apps.repro.lm_norm_report import summary

    path = NORM_STUDY if path is None else path
    report = _read_report(path) or {}
    return summary(report.get("norm"), os.path.relpath(path.with_name("section.md")), indent)


def _read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _long_lines(long: dict | None) -> list[str]:
    """The long part's answer: the variant with the lowest final loss and DIFF V1's gap, both against the standard
    model with their 95% intervals."""
    if long is None:
        return []
    if "variants" not in long:
        return [f"  long budget (`--part long`): not complete yet ({', '.join(long['incomplete'])} to run)"]
    from difftransformer.apps.repro.lm_long_report import LABELS

    rows, regime = long["variants"], long["regime"]
    mean = {v: sum(r["losses"]) / len(r["losses"]) for v, r in rows.items()}
    best = min(rows, key=lambda v: mean[v] if math.isfinite(mean[v]) else math.inf)  # a diverged run is never best
    per = regime["tokens_per_parameter"]["standard"]
    lines = [
        f"  long budget (`--part long`): {regime['parameters']['standard']['non_embedding'] / 1e3:.0f}k non-embedding "
        f"parameters, {per:.1f} tokens per parameter, {len(long['seeds'])} seeds, final validation loss against the "
        "standard model:"
    ]
    shown = [best] + [v for v in ("diff", "diff-norm-gain") if v != best]
    for v in shown:
        if v == "standard":
            lines.append("    lowest mean: the standard model (every variant's loss is higher on average)")
            continue
        d = rows[v]["minus_standard"]
        gap = (
            "not comparable (a run diverged)"
            if d is None
            else f"{d['mean']:+.4f} nats (95% interval {d['low']:+.4f} to {d['high']:+.4f}"
            + ("; within the seed noise)" if d["low"] <= 0 <= d["high"] else ")")
        )
        lines.append(f"    {'lowest mean: ' if v == best else ''}{LABELS[v]}: {gap}")
    return lines


def _short_lines(result: dict) -> list[str]:
    """The short-budget parts: the seeded DIFF - standard difference, the grid's count and the ablations."""
    sc = result["scale"]
    lines = []
    hi = sc["steps"][0]
    if "paired" in result:
        mean, low, high = result["paired"]["interval"]
        n = len(result["paired"]["differences"])
        lines.append(
            f"  size {sc['reference']}, {hi} steps, {n} seeds: DIFF - standard {mean:+.4f} nats (95% interval "
            f"{low:+.4f} to {high:+.4f}): {_loss_word(low, high, 'DIFF', 'the standard model')}"
        )
        grid = result["grid"]
        pairs = {(p["size"], p["steps"]) for p in grid if p["seed"] == 0}
        lower = sum(
            next(p["loss"] for p in grid if (p["size"], p["steps"], p["variant"], p["seed"]) == (*key, "diff", 0))
            < next(p["loss"] for p in grid if (p["size"], p["steps"], p["variant"], p["seed"]) == (*key, "standard", 0))
            for key in pairs
        )
        lines.append(f"  DIFF has the lower loss at {lower} of {len(pairs)} (size, budget) points (seed 0 of each)")
    shown = {"diff-all-heads": "with as many differential heads as standard heads", "diff-no-head-norm": "without "
             "the per-head norm", "diff-lambda-0.8": "with a constant lambda_init of 0.8"}  # fmt: skip
    for row in result.get("ablations", []):
        if row["variant"] in shown:
            mean, low, high = row["interval_minus_diff"]
            lines.append(
                f"  DIFF {shown[row['variant']]}: {mean:+.4f} nats vs DIFF (95% interval {low:+.4f} to {high:+.4f}; "
                f"{sc['steps'][1]} steps): {_loss_word(low, high, 'the variant', 'DIFF')}"
            )
    return lines


def _loss_word(low: float, high: float, first: str, second: str) -> str:
    """What an interval of ``first``'s loss minus ``second``'s says, in words (lower loss is better)."""
    if high < 0:
        return f"{first}'s loss is lower (better)"
    if low > 0:
        return f"{first}'s loss is higher (worse)"
    return "within the seed noise"


def icl_report(part1: dict) -> list[str]:
    """Part 1's section of report.md."""
    return [
        "# Demo, part 1: in-context learning",
        "",
        "The matched DIFF and standard pair of `difftx repro icl` (seed 0), trained side by side for "
        f"{part1['steps']} steps. What the demo printed:",
        "",
        "```",
        *(line.lstrip("\n") for line in demo_icl.summary(part1)),
        "```",
        "",
        f"![accuracy and attention]({ICL}/attention.png)",
        "",
    ]


def write_report(run_dir: Path, rows: dict[str, list[dict]], summary: dict, part1: dict | None = None) -> None:
    """report.md (part 1's section first when it ran), summary.json, loss_curves.png and lambda.png."""
    from matplotlib.ticker import MaxNLocator

    from difftransformer.apps.figures import COLORS, HEADS, finish, pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.4))
    for kind in KINDS:
        color = COLORS[kind]
        ax.plot(
            [r["step"] for r in rows[kind]],
            [r["loss"] for r in rows[kind]],
            color=color,
            alpha=0.4,
            label=f"{NAMES[kind]}, training batches",
        )
        evals = [r for r in rows[kind] if "val_loss" in r]
        ax.plot(
            [r["step"] for r in evals],
            [r["val_loss"] for r in evals],
            "o-",
            color=color,
            label=f"{NAMES[kind]}, validation",
        )
    ax.set(xlabel="step", ylabel="loss (nats per token)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    finish(fig, run_dir / "loss_curves.png", "the tiny models on CPython's documentation", dpi=120)

    fig, ax = plt.subplots(figsize=(7, 4.4))
    lam = [r["lambda"] for r in rows["diff"]]
    for layer in range(len(lam[0])):
        colour = HEADS[layer % len(HEADS)]
        ax.plot([r["step"] for r in rows["diff"]], [v[layer] for v in lam], ".-", color=colour, label=f"layer {layer}")
    ax.set(xlabel="step", ylabel="lambda")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    finish(fig, run_dir / "lambda.png", "DIFF (V1 as published): lambda of each layer during training", dpi=120)

    write_json(run_dir / "summary.json", summary, indent=2)
    f, p = summary["final"], summary["parameters"]
    gains = summary["head_norm_gains"]["diff-matched"]
    lines = [
        *(icl_report(part1) if part1 else []),
        "# Demo" + (", part 2" if part1 else "") + ": tiny DIFF (V1 as published and with the matched gain) and "
        "standard Transformer on text",
        "",
        f"Each trained for {summary['steps']} steps of {summary['batch_size']} x {summary['seq_len']} byte tokens on "
        f"CPython's documentation, one step of each in turn, same data order and seed, {summary['threads']} "
        "thread(s). DIFF is the paper's V1 as published; DIFF matched is the same model with each layer's per-head "
        'norm started at the matched gain (ModelConfig(head_norm_gain="matched"): '
        + ", ".join(f"{g:.3f}" for g in gains)
        + ").",
        "",
        "| | " + " | ".join(NAMES[k] for k in KINDS) + " |",
        "|---" * (len(KINDS) + 1) + "|",
        "| parameters | " + " | ".join(f"{p[k]:,}" for k in KINDS) + " |",
        "| final validation loss (nats per token) | " + " | ".join(f"{f[k]['val_loss']:.4f}" for k in KINDS) + " |",
        "| final validation bits per byte | " + " | ".join(f"{f[k]['val_bpb']:.4f}" for k in KINDS) + " |",
        "",
        *(
            [
                f"Training step time, DIFF / standard: {summary['step_time_ratio']:.2f}, the models' steps timed "
                f"in turn over the {summary['timed_steps']} steps without a validation (a load on the machine slows "
                "each alike).",
                "",
            ]
            if summary["timed_steps"]
            else []
        ),
        "lambda per layer at the end: " + ", ".join(f"{v:.3f}" for v in summary["lambda_final"]),
        "",
        f"Last layer's differential map on a validation window: rows sum to 1 - lambda (max deviation "
        f"{summary['map']['row_sum_error']:.1e}); {summary['map']['negative_share']:.1%} of the weights are negative.",
        "",
        "![loss curves](loss_curves.png)",
        "",
        "![lambda per layer](lambda.png)",
        "",
        "## Samples (temperature 0.8, top-k 40, seeds 0, 1, 2; first line)",
        "",
    ]
    for kind in KINDS:
        lines += [f"**{NAMES[kind]}**", ""] + [f"    {s}" for s in summary["samples"][kind]] + [""]
    write_text_atomic(run_dir / "report.md", "\n".join(lines))  # last: a demo with its report.md is finished
