"""Post-training quantization of a trained run (`difftx quantize`): calibration and the quantized run directory.

The format (schemes, QuantizedLinear) is in ``difftransformer.core.quantized``. For w8a8 each linear layer's input
scale is calibrated on windows of the run's *training* split: ``absmax`` (the largest |x| seen) or ``percentile``
(the 99.99th percentile of |x|, within 1.2%: the rarest outliers are clipped so the rest keep their precision).

The source run is only read. The new run holds the model config, the tokenizer, ``quantization.json`` (scheme,
calibration, source) and one checkpoint (the source's newest step) whose ``model.safetensors`` holds the integer
weights and float32 scales; it is written to a temporary sibling and renamed, so an error leaves nothing behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from difftransformer.core.quantized import SCHEMES, levels, replace_linears, target_linears
from difftransformer.errors import InputError
from difftransformer.fsutil import check_new_dir, write_new_dir, write_text_atomic
from difftransformer.inference.magnitudes import MagnitudeStats
from difftransformer.progress import Progress, batches
from difftransformer.store.checkpoint import PREFIX, list_checkpoints, save_checkpoint
from difftransformer.store.runs import (
    MODEL_CONFIG,
    QUANTIZATION,
    load_run,
    read_quantization,
    run_and_checkpoint,
    run_windows,
)

CALIBRATORS = ("absmax", "percentile")

PERCENTILE = 0.9999

# 300 calibration windows: with windows of 256-1024 tokens that is 77k-307k tokens, so the 99.99th percentile of a
# layer's inputs (pooled over its features) has 8-31 values per feature above it on average. Measured on the study's
# M pairs (experiments/reports/quant, seed 0): the w8a8 loss increase with 30, 100 and 300 absmax windows agrees
# within 0.0001 nats, so these models would do with 30; 300 is kept as a margin for inputs with longer tails.
CALIB_SAMPLES = 300


@torch.no_grad()
def calibrate(
    model: nn.Module, windows: torch.Tensor, calibrator: str, batch: int = 4, progress: Progress | None = None
) -> dict[str, float]:
    """Static input scales (range / 127) of every target linear layer, from ``model``'s forward over ``windows``
    (``progress``: a live line counting the windows)."""
    if calibrator not in CALIBRATORS:
        raise InputError(f"unknown calibrator {calibrator!r}; choose one of {CALIBRATORS}")
    stats = {name: MagnitudeStats() for name in target_linears(model)}
    handles = [
        linear.register_forward_pre_hook(lambda _m, args, name=name: stats[name].add(args[0]))
        for name, linear in target_linears(model).items()
    ]
    try:
        model.eval()
        for chunk in batches(windows, batch, progress, windows.shape[1]):
            model(chunk)
    finally:
        for handle in handles:
            handle.remove()
    scales = {}
    for name, s in stats.items():
        bound = float(s.top[0]) if calibrator == "absmax" else s.quantile(PERCENTILE, upper=True)
        scales[name] = max(bound, 1e-8) / levels(8)
    return scales


def spec_json(spec: dict) -> str:
    return json.dumps(spec, indent=1) + "\n"


def quantize_run(
    run: str | Path,
    scheme: str,
    out: str | Path,
    calib_samples: int = CALIB_SAMPLES,
    calibrator: str = "absmax",
    data: str | Path | None = None,
    progress: bool = False,
) -> dict:
    """Post-training quantization of a run into a new run directory, which loads, samples and evaluates like any run.

    Args:
        run: the trained (float) run directory.
        scheme: ``w8a16`` (int8 weights per output channel), ``w4a16`` (int4 weights in groups of 32) or ``w8a8``
            (int8 weights and int8 inputs to every linear layer, with calibrated scales).
        out: the new run directory.
        calib_samples: w8a8: training windows to calibrate the input scales on.
        calibrator: w8a8: ``absmax`` (the largest |x| seen) or ``percentile`` (its 99.99th percentile).
        data: w8a8: the data directory (default: the one the run was trained on).
        progress: a live line while w8a8 calibrates.

    Returns:
        The contents of the new run's quantization.json (the scheme, its layers, the float source).

    Examples:
        >>> from difftransformer.store.examples import example_run
        >>> run = example_run()  # an untrained tiny DIFF model's run, in a new temporary directory
        >>> record = quantize_run(run, "w8a16", f"{run}-w8a16")
        >>> record["scheme"]
        'w8a16'
    """
    run, out = Path(run), Path(out)
    if scheme not in SCHEMES:
        raise InputError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if calibrator not in CALIBRATORS:
        raise InputError(f"unknown calibrator {calibrator!r}; choose one of {', '.join(CALIBRATORS)}")
    if calib_samples < 1:
        raise InputError(f"the number of calibration windows must be at least 1, got {calib_samples}")
    check_new_dir(out, "output directory")
    run, checkpoint = run_and_checkpoint(run)  # a run, or one of its checkpoints (RUN/checkpoints/step_N)
    earlier = read_quantization(run) if run.is_dir() else None
    if earlier is not None:
        raise InputError(
            f"{run} is already quantized ({earlier['scheme']}): quantize its float source {earlier['source']} instead"
        )
    model, tokenizer = load_run(checkpoint or run)
    step = int((checkpoint or list_checkpoints(run)[-1]).name.removeprefix(PREFIX))
    spec = {
        "scheme": scheme,
        "weight_bits": SCHEMES[scheme][0],
        "source": str(run.resolve()),
        "source_step": step,
        "layers": sorted(target_linears(model)),
    }
    scales = None
    if SCHEMES[scheme][1]:
        try:  # the training split only: calibration never sees validation text
            windows, data_dir = run_windows(run, tokenizer, "train", windows=calib_samples, data=data)
        except (InputError, OSError) as err:
            kind = InputError if isinstance(err, InputError) else FileNotFoundError
            raise kind(f"w8a8 calibrates on the run's training data: {err}") from None
        live = Progress(len(windows), "calibrating", unit="windows") if progress else None
        scales = calibrate(model, windows[:, :-1], calibrator, progress=live)
        spec.update(
            calibrator=calibrator,
            calibration_data=str(data_dir),
            calibration_split="train",
            calibration_windows=len(windows),
            calibration_tokens=int(windows[:, :-1].numel()),
        )
    replace_linears(model, scheme, scales)

    def write(tmp: Path) -> None:
        model.config.to_json(tmp / MODEL_CONFIG)
        tokenizer.save(tmp)
        write_text_atomic(tmp / QUANTIZATION, spec_json(spec))
        meta = {"model_config": model.config.to_dict(), "tokenizer": tokenizer.fingerprint(), "quantization": spec}
        save_checkpoint(tmp, step, model.state_dict(), {"state": {}, "param_groups": []}, meta, keep_last=1)

    write_new_dir(out, "output directory", write)
    return spec
