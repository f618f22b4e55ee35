"""Activation outliers and quantization, measured on the language-model study's matched pairs (the paper's Table 5
and Figure 8, and post-training quantization).

For every DIFF / standard pair that ``difftx repro lm`` trained at the long budget (each architecture at its own
best learning rate: every size at seed 0, the reference size at every seed), on the same validation windows:

- the outlier statistics (``difftransformer.apps.outliers``) of the attention logits and hidden states;
- the validation loss with the attention logits quantized to 16, 8, 6 and 4 bits (dynamic absmax per head and row);
- the validation loss of the run quantized by ``difftx quantize`` with w8a16, w4a16 and w8a8 (absmax calibration
  on ``CALIB_SAMPLES`` training windows), and, for the reference pair at seed 0, w8a8 with fewer calibration
  windows and with the percentile calibrator, to show what the default number buys.

Each model's measures are written to ``out/measures/NAME.json`` as it finishes; the same command continues an
interrupted study (``out/quant.json`` holds its plan) and skips what is there.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from multiprocessing import get_context
from pathlib import Path

import torch

from difftransformer.apps.outliers import measure as measure_outliers
from difftransformer.apps.repro import lm
from difftransformer.core.attention.logits import LogitQuantizer, logit_probe
from difftransformer.errors import InputError
from difftransformer.fsutil import open_plan, read_json_object, write_text_atomic
from difftransformer.inference.quantize import CALIB_SAMPLES
from difftransformer.store.data import TokenData, eval_windows
from difftransformer.store.runs import load_run
from difftransformer.training.evaluate import token_losses

PLAN = "quant.json"
BITS = (16, 8, 6, 4)
SCHEMES = ("w8a16", "w4a16", "w8a8")
CALIB_CHECK = (30, 100)  # fewer calibration windows, for the reference pair at seed 0
SCALES = {"cpu": dict(loss_windows=16, outlier_windows=8), "gpu": dict(loss_windows=64, outlier_windows=400)}
PAPER_FIGURE8 = (
    "zero-shot HellaSwag with attention logits quantized (dynamic absmax): DIFF holds from 16 to 6 bits; 4-bit DIFF "
    "matches 6-bit Transformer and beats 4-bit Transformer by about 25 points"
)


def pairs(study: Path) -> list[dict]:
    """[{size, seed, runs: {arch: run directory}, calib_check}] of the study's long-budget pairs at each
    architecture's best learning rate; ``calib_check`` marks the reference size's seed-0 pair."""
    plan = read_json_object(study / lm.STUDY) if (study / lm.STUDY).is_file() else None
    if plan is None:
        raise FileNotFoundError(f"{study} holds no language-model study ({lm.STUDY}): run `difftx repro lm` first")
    scale = lm.Scale(**{k: tuple(v) if isinstance(v, list) else v for k, v in plan["scale"].items()})
    measures = lm.read_measures(study)
    best = lm.best_lrs(scale, measures)
    found = []
    for run in lm.grid_runs(scale, best, plan["seeds"]):
        if run.variant != "diff" or run.steps != scale.steps[0]:
            continue
        partner = lm.Run(run.size, run.steps, "standard", best["standard"], run.seed)
        dirs = {"diff": study / "runs" / run.name, "standard": study / "runs" / partner.name}
        if all(name in measures for name in (run.name, partner.name)) and all(d.is_dir() for d in dirs.values()):
            reference = run.size == scale.reference and run.seed == 0
            found.append({"size": run.size, "seed": run.seed, "runs": dirs, "calib_check": reference})
    if not found:
        raise InputError(f"{study} has no finished DIFF / standard pair at the long budget yet: finish its grid first")
    return found


def run(out: Path, scale: str, seeds: list[int], workers: int, steps: int | None = None, models=None) -> dict:
    """Measure the pairs of the study in ``models`` (a `difftx repro lm` directory) into ``out``."""
    if models is None:
        raise InputError("repro quant measures a language-model study: give its directory (`models`: e.g. reports/lm)")
    study = Path(models)
    found = pairs(study)
    data = study / "data"
    config = {**SCALES[scale], "calib_samples": CALIB_SAMPLES, "calib_check": list(CALIB_CHECK)}
    _open(out, {"study": str(study.resolve()), "scale": scale, **config})
    (out / "measures").mkdir(parents=True, exist_ok=True)
    jobs = []
    for pair in found:
        for run_dir in pair["runs"].values():
            if not (out / "measures" / f"{run_dir.name}.json").is_file():
                jobs.append((str(run_dir), str(data), str(out), config, pair["calib_check"]))
    if jobs:
        print(f"{len(jobs)} models to measure, {workers} at a time", flush=True)
        with get_context("spawn").Pool(min(workers, len(jobs))) as pool:
            for name in pool.imap_unordered(_measure_job, jobs):
                print(f"  {name} measured", flush=True)
    measured = {p.stem: read_json_object(p) for p in sorted((out / "measures").glob("*.json"))}
    result = analyse(found, measured)
    result.update(study=str(study), scale=scale, **config)
    write_text_atomic(out / "results.json", json.dumps(result, indent=1) + "\n")
    draw(result, out)
    write_text_atomic(out / "section.md", markdown(result))
    return result


def _open(out: Path, plan: dict) -> None:
    """Create out/quant.json, or check that the measurements already in ``out`` were made with this plan (an
    interrupted study continues in its own directory; nothing of another is mixed in)."""
    open_plan(
        out,
        PLAN,
        plan,
        "quantization study",
        lambda saved, path: (
            f"{out} holds measurements of another plan ({path}: study {saved.get('study')}, scale "
            f"{saved.get('scale')!r}); continue it with the same `models` and `scale`, or give a new `out`"
        ),
    )


def _measure_job(job: tuple) -> str:
    run_dir, data, out, config, check = job
    torch.set_num_threads(1)
    result = measure_model(Path(run_dir), Path(data), config, check)
    write_text_atomic(Path(out) / "measures" / f"{Path(run_dir).name}.json", json.dumps(result, indent=1) + "\n")
    return Path(run_dir).name


def measure_model(run_dir: Path, data: Path, config: dict, calib_check: bool = False) -> dict:
    """Every measure of one trained model (see the module docstring)."""
    from difftransformer.inference.quantize import quantize_run

    model, _ = load_run(run_dir)
    seq_len = model.config.max_seq_len
    windows = eval_windows(TokenData(data, "val"), seq_len, config["loss_windows"] * seq_len)
    base = float(token_losses(model, windows).mean())
    recorder = measure_outliers(model, windows[: config["outlier_windows"], :-1])
    logit_loss = {}
    for bits in BITS:
        with logit_probe(LogitQuantizer(bits)):
            logit_loss[str(bits)] = float(token_losses(model, windows).mean())
    ptq = {}
    default = config["calib_samples"]
    variants = [(s, default, "absmax") for s in SCHEMES]
    if calib_check:
        variants += [("w8a8", n, "absmax") for n in config["calib_check"]] + [("w8a8", default, "percentile")]
    with tempfile.TemporaryDirectory() as tmp:
        for scheme, samples, calibrator in variants:
            key = scheme if (samples, calibrator) == (default, "absmax") else f"{scheme}-{calibrator}-{samples}"
            target = Path(tmp) / key
            quantize_run(run_dir, scheme, target, samples, calibrator, data)
            quantized, _ = load_run(target)
            ptq[key] = float(token_losses(quantized, windows).mean())
            shutil.rmtree(target)
    return {
        "name": run_dir.name,
        "attention": model.config.attention,
        "non_embedding": model.num_parameters(exclude_embeddings=True),
        "val_tokens": int(windows[:, 1:].numel()),
        "loss": base,
        "outliers": {k: v["pooled"] for k, v in recorder.summary().items() if k != "tokens"},
        "outlier_tokens": recorder.tokens,
        "logit_bits_loss": logit_loss,
        "ptq_loss": ptq,
    }


def analyse(found: list[dict], measured: dict[str, dict]) -> dict:
    rows = []
    for pair in found:
        row = {"size": pair["size"], "seed": pair["seed"]}
        for arch, run_dir in pair["runs"].items():
            row[arch] = measured[run_dir.name]
        rows.append(row)
    models = [m for row in rows for m in (row["diff"], row["standard"])]
    correlations = {
        "logit_top1_vs_4bit_logit_increase": _pearson(
            [math.log(m["outliers"]["attention_logits"]["top1"]) for m in models],
            [m["logit_bits_loss"]["4"] - m["loss"] for m in models],
        ),
        "hidden_top1_vs_w8a8_increase": _pearson(
            [math.log(m["outliers"]["hidden_states"]["top1"]) for m in models],
            [m["ptq_loss"]["w8a8"] - m["loss"] for m in models],
        ),
    }
    return {"pairs": rows, "bits": list(BITS), "schemes": list(SCHEMES), "correlations": correlations}


def _pearson(x: list[float], y: list[float]) -> dict:
    n = len(x)
    if n < 3:
        return {"r": float("nan"), "n": n}
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    return {"r": sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan"), "n": n}


def markdown(result: dict) -> str:
    from difftransformer.apps.analyze_outliers import PAPER

    rows = result["pairs"]
    lines = [
        "## Activation outliers and quantization (the paper's Table 5 and Figure 8)",
        "",
        f"The language-model study's DIFF / standard pairs (its models, in {result['study']} on the machine that ran "
        "it: a committed report holds no models), each at its own best learning rate, "
        f"on the same {rows[0]['diff']['val_tokens']:,} validation tokens (outliers on "
        f"{rows[0]['diff']['outlier_tokens']:,} of them). Largest absolute values and median, pooled over layers.",
        "",
        "| pair | model | logits top-1 | top-10 | top-100 | median | hidden top-1 | top-10 | top-100 | median |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arch, label in (("standard", "Transformer"), ("diff", "DIFF")):
        lg, hd = PAPER["attention_logits"][arch], PAPER["hidden_states"][arch]
        lines.append(
            f"| paper 3B | {label} | {lg[0]:g} | {lg[3]:g} | {lg[4]:g} | {lg[5]:g} | {hd[0]:g} | {hd[3]:g} | "
            f"{hd[4]:g} | {hd[5]:g} |"
        )
    for row in rows:
        for arch in ("standard", "diff"):
            o = row[arch]["outliers"]
            cells = [o[kind][k] for kind in ("attention_logits", "hidden_states") for k in ("top1", "top10", "top100")]
            lg, hd = (o[kind]["median"] for kind in ("attention_logits", "hidden_states"))
            tops = [f"{v:.1f}" for v in cells]
            logits, hidden = " | ".join(tops[:3]), " | ".join(tops[3:])
            lines.append(f"| {row['size']} s{row['seed']} | {arch} | {logits} | {lg:.2f} | {hidden} | {hd:.2f} |")
    lines += [
        "",
        "Validation loss increase (nats per token) over the float model, with the attention logits quantized to b bits "
        "(dynamic absmax per head and query row) and with the weights (and for w8a8 the linear inputs) quantized:",
        "",
        "| pair | model | float loss | "
        + " | ".join(f"{b}-bit logits" for b in result["bits"])
        + " | "
        + " | ".join(result["schemes"])
        + " |",
        "|---" * (3 + len(result["bits"]) + len(result["schemes"])) + "|",
    ]
    for row in rows:
        for arch in ("standard", "diff"):
            m = row[arch]
            bits = " | ".join(f"{m['logit_bits_loss'][str(b)] - m['loss']:+.4f}" for b in result["bits"])
            ptq = " | ".join(f"{m['ptq_loss'][s] - m['loss']:+.4f}" for s in result["schemes"])
            lines.append(f"| {row['size']} s{row['seed']} | {arch} | {m['loss']:.4f} | {bits} | {ptq} |")
    checks = [(row, arch) for row in rows for arch in ("standard", "diff") if len(row[arch]["ptq_loss"]) > 3]
    if checks:
        lines += ["", "w8a8 calibration at the reference size, seed 0 (loss increase):", ""]
        for row, arch in checks:
            m = row[arch]
            cells = ", ".join(f"{k}: {v - m['loss']:+.4f}" for k, v in m["ptq_loss"].items() if k.startswith("w8a8"))
            lines.append(f"- {arch}: {cells}")
    c = result["correlations"]
    lines += [
        "",
        f"Across the {c['logit_top1_vs_4bit_logit_increase']['n']} models: Pearson r between log top-1 attention logit "
        f"and the 4-bit-logit loss increase {c['logit_top1_vs_4bit_logit_increase']['r']:+.2f}; between log top-1 "
        f"hidden state and the w8a8 loss increase {c['hidden_top1_vs_w8a8_increase']['r']:+.2f}.",
        "",
        f"The paper (Figure 8): {PAPER_FIGURE8}.",
        "",
        "![loss against logit bits](quant_bits.png)",
    ]
    return "\n".join(lines) + "\n"


def draw(result: dict, out: Path) -> None:
    """The report's figure from its result: the loss that quantized logits cost, and its relation to outliers."""
    from difftransformer.apps import figures
    from difftransformer.apps.repro.report import NAMES

    plt = figures.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for row in result["pairs"]:
        for arch in ("diff", "standard"):
            m = row[arch]
            increases = [m["logit_bits_loss"][str(b)] - m["loss"] for b in result["bits"]]
            label = NAMES[arch] if row is result["pairs"][0] else None
            colour = figures.COLORS[arch]
            axes[0].plot(result["bits"], increases, marker="o", color=colour, alpha=0.7, label=label)
            axes[1].scatter(m["outliers"]["attention_logits"]["top1"], increases[-1], color=colour, label=label)
    axes[0].set_xlabel("attention-logit bits")
    axes[0].set_ylabel("loss increase over float (nats per token)")
    axes[0].invert_xaxis()
    axes[0].set_title("loss against logit bits, every pair", fontsize=10)
    axes[1].set_xscale("log")
    figures.readable_log_axis(axes[1])
    axes[1].set_xlabel("largest |attention logit| (top-1)")
    axes[1].set_ylabel("loss increase at 4-bit logits")
    axes[1].set_title("outliers against the 4-bit loss", fontsize=10)
    figures.finish(fig, out / "quant_bits.png", "quantized attention logits: the loss they cost, DIFF vs standard")
