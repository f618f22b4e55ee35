"""`difftx quantize`: a quantized run directory from a trained run (post-training quantization; the schemes and the
format are in ``difftransformer.quantize``).

The source run is only read. The new run holds the model config, the tokenizer, ``quantization.json`` and one
checkpoint (the source's newest step) with integer weights; it is written to a temporary sibling and renamed, so
an error leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path

from difftransformer.checkpoint import list_checkpoints, save_checkpoint
from difftransformer.errors import InputError
from difftransformer.fsutil import check_new_dir, write_new_dir, write_text_atomic
from difftransformer.quantize import (
    CALIB_SAMPLES,
    CALIBRATORS,
    QUANTIZATION,
    SCHEMES,
    calibrate,
    read_quantization,
    replace_linears,
    spec_json,
    target_linears,
)
from difftransformer.runs import MODEL_CONFIG, load_run, run_windows


def quantize_run(
    run: str | Path,
    scheme: str,
    out: str | Path,
    calib_samples: int = CALIB_SAMPLES,
    calibrator: str = "absmax",
    data: str | Path | None = None,
) -> dict:
    """Write the quantized run ``out`` and return its quantization.json contents."""
    run, out = Path(run), Path(out)
    if scheme not in SCHEMES:
        raise InputError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if calibrator not in CALIBRATORS:
        raise InputError(f"unknown calibrator {calibrator!r}; choose one of {', '.join(CALIBRATORS)}")
    if calib_samples < 1:
        raise InputError(f"the number of calibration windows must be at least 1, got {calib_samples}")
    check_new_dir(out, "output directory")
    earlier = read_quantization(run) if run.is_dir() else None
    if earlier is not None:
        raise InputError(
            f"{run} is already quantized ({earlier['scheme']}): quantize its float source {earlier['source']} instead"
        )
    model, tokenizer = load_run(run)
    step = int(list_checkpoints(run)[-1].name.split("_")[-1])
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
        scales = calibrate(model, windows[:, :-1], calibrator)
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
        meta = {"model_config": model.config.to_dict(), "quantization": spec}
        save_checkpoint(tmp, step, model.state_dict(), {"state": {}, "param_groups": []}, meta, keep_last=1)

    write_new_dir(out, "output directory", write)
    return spec
