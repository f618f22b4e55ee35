"""`difftx repro`: run one experiment or all of them into a new report directory (the language-model study, ``lm``,
and the quantization study on it, ``quant``, also continue an interrupted run in their own directory)."""

from __future__ import annotations

import importlib
import time
from pathlib import Path

from difftransformer.errors import InputError
from difftransformer.fsutil import check_new_dir
from difftransformer.training.tracking import check_available, parse_sinks

EXPERIMENTS = ("needle", "allocation", "icl", "lm", "quant")
CURVES = ("needle", "icl")  # the synthetic studies that train models: one TensorBoard run of each model's curve
CONTINUED = ("lm", "quant")  # experiments that continue an interrupted run in their own directory
LOGIT_BITS = ("needle", "icl")  # the experiments whose final evaluation can run with quantized attention logits


def run(
    what: str,
    out: str | Path,
    scale: str = "cpu",
    seeds: int = 3,
    workers: int | None = None,
    steps: int | None = None,
    models: str | Path | None = None,
    parts: tuple[str, ...] | None = None,
    corpora: list[str] | None = None,
    logit_bits: int | None = None,
    log_to: str = "jsonl",
) -> Path:
    """Run ``what`` (an experiment or 'all') into ``out``, which must be new or empty; returns the report path.

    allocation measures the needle task's models: those in ``models`` (a needle report directory) when given, the
    ones ``all`` has just trained, or else it trains them itself; quant measures the language-model study in
    ``models`` (or the one ``all`` has just run); needle and icl, run alone with ``models`` (a report directory of
    the same experiment), evaluate its saved models again instead of training (for a grown evaluation, or another
    ``logit_bits``). ``log_to`` (TrainConfig.log_to) is where the language-model study's runs log their metrics
    besides metrics.jsonl (one TensorBoard run per model under lm's runs/); with tensorboard, needle and icl write
    one TensorBoard run of each model they trained, its learning curve (under their tensorboard/).
    """
    if what not in (*EXPERIMENTS, "all"):
        raise InputError(f"unknown experiment {what!r}; choose one of {', '.join(EXPERIMENTS)} or all")
    if seeds < 1:
        raise InputError(f"`seeds` must be at least 1, got {seeds}")
    if logit_bits is not None:
        from difftransformer.core.attention.logits import check_bits

        if what not in LOGIT_BITS:
            raise InputError(f"`logit_bits` applies to {' and '.join(LOGIT_BITS)} (their final evaluation), not {what}")
        check_bits(logit_bits)
    sinks = parse_sinks(log_to)
    if isinstance(sinks, str):
        raise InputError(f"`log_to` {sinks}")
    if sinks != ("jsonl",):
        if what not in CURVES and what not in ("lm", "all"):
            raise InputError(f"`log_to` applies to the studies that train: lm, {', '.join(CURVES)}, not {what}")
        if "wandb" in sinks and what in CURVES:
            raise InputError(
                f"`log_to` wandb applies to lm (the study trained by the library's training loop), not {what}, whose "
                "learning curves go to TensorBoard (tensorboard)"
            )
        check_available(sinks)  # before any model trains
    out = Path(out)
    if what not in CONTINUED:
        check_new_dir(out, "report directory")
    seed_list = list(range(seeds))
    todo = EXPERIMENTS if what == "all" else (what,)
    sections = []
    for name in todo:
        target = out / name if what == "all" else out
        if name not in CONTINUED:  # these check their directory themselves before they write anything
            target.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        module = importlib.import_module(f"difftransformer.apps.repro.{name}")
        if name == "allocation":
            source = Path(models) if models else (out / "needle" if what == "all" else None)
            module.run(target, scale, seed_list, workers or 2, steps, models=source)
        elif name == "quant":
            source = Path(models) if models else (out / "lm" if what == "all" else None)
            module.run(target, scale, seed_list, workers or 2, steps, models=source)
        elif name == "lm":  # the short-budget parts (all three by default), then the long and norm parts when asked for
            from difftransformer.apps.repro import lm_study

            short = tuple(p for p in parts or module.PARTS if p not in ("long", "norm"))
            if short:
                lm_study.run(target, scale, short, seed_list, workers, steps, corpora, log_to)
            if parts and "long" in parts:
                lm_study.run_long(target, scale, seed_list, workers, steps, corpora, log_to)
            if parts and "norm" in parts:
                lm_study.run_norm(target, scale, workers, steps, corpora, log_to)
        else:
            source = Path(models) if models and what == name else None
            from difftransformer.apps.repro.fit import curves_to_tensorboard, run_task

            result = run_task(module, target, scale, seed_list, workers or 2, steps, logit_bits, source)
            if "tensorboard" in sinks and source is None:  # trained here: each model's learning curve
                curves_to_tensorboard(result, target)
        print(f"difftx repro {name}: done in {time.perf_counter() - start:.0f} s -> {target / 'section.md'}")
        sections.append((target / "section.md").read_text())
    report = out / "report.md"
    report.write_text(f"# The paper's claims, {scale} scale\n\n" + "\n\n".join(sections))
    return report
