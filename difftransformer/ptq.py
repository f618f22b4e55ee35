"""`difftx quantize`: a quantized run directory from a trained run (post-training quantization; the schemes and the
format are in ``difftransformer.quantize``).

The source run is only read. The new run holds the model config, the tokenizer, ``quantization.json`` and one
checkpoint (the source's newest step) with integer weights; it is written to a temporary sibling and renamed, so
an error leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path

import torch

from difftransformer.checkpoint import list_checkpoints, save_checkpoint
from difftransformer.data import TokenData, eval_windows
from difftransformer.errors import InputError
from difftransformer.fsutil import check_new_dir, read_json_object, write_new_dir, write_text_atomic
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
from difftransformer.runs import MODEL_CONFIG, TRAIN_CONFIG, load_run


def calibration_windows(run: Path, tokenizer, samples: int, data: str | Path | None) -> tuple[torch.Tensor, Path]:
    """``samples`` evenly spaced windows of the run's training split (never validation), seq_len + 1 tokens each."""
    train_config = read_json_object(run / TRAIN_CONFIG) if (run / TRAIN_CONFIG).is_file() else {}
    source = data if data is not None else train_config.get("data")
    if source is None:
        raise InputError(
            f"w8a8 calibrates on the run's training data, but {run} does not say which data it was trained on "
            f"(no {TRAIN_CONFIG}): name the data directory"
        )
    data_dir = Path(source)
    if not data_dir.is_dir():
        raise FileNotFoundError(
            f"w8a8 calibrates on the run's training data, but its data directory {data_dir} does not exist (moved or "
            "removed): name the data directory prepared with the run's tokenizer"
        )
    split = TokenData(data_dir, "train")
    expected = split.manifest["tokenizer"]["fingerprint"]
    if tokenizer.fingerprint() != expected:
        raise InputError(
            f"{data_dir} was tokenised with {expected}, but {run} uses {tokenizer.fingerprint()}: name data prepared "
            "with the run's tokenizer"
        )
    seq_len = int(train_config.get("seq_len") or 256)
    return eval_windows(split, seq_len, samples * seq_len), data_dir


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
        windows, data_dir = calibration_windows(run, tokenizer, calib_samples, data)
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
