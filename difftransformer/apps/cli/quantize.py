"""`difftx quantize`."""

from __future__ import annotations

import argparse

from difftransformer.apps.cli.parsing import INPUT, OUTPUT, at_least, command, threads_flag
from difftransformer.fsutil import shell


def quantize_command(sub) -> None:
    quant = command(
        sub,
        "quantize",
        _quantize,
        "post-training quantization of a run into a new run directory (integer weights)",
        "difftx quantize --run runs/diff-tiny --scheme w8a8 --out runs/diff-tiny-w8a8",
    )
    quant.add_argument("--run", type=INPUT, required=True, help="the trained (float) run directory")
    quant.add_argument(
        "--scheme",
        required=True,
        choices=["w8a16", "w4a16", "w8a8"],
        help="w8a16: int8 per-channel weights; w4a16: int4 weights in groups of 32; w8a8: int8 weights and "
        "int8 linear-layer inputs with calibrated scales",
    )
    quant.add_argument("--out", type=OUTPUT, required=True, help="the new run directory (must not exist or be empty)")
    quant.add_argument(
        "--calib-samples",
        type=at_least(1),
        default=300,
        help="w8a8: training windows to calibrate on (default 300)",
    )
    quant.add_argument(
        "--calibrator",
        default="absmax",
        choices=["absmax", "percentile"],
        help="w8a8: input range = the largest |x| seen (default) or its 99.99th percentile",
    )
    quant.add_argument("--data", type=INPUT, help="w8a8: the data directory (default: the one the run was trained on)")
    threads_flag(quant)


def _quantize(args: argparse.Namespace) -> int:
    from difftransformer.inference.quantize import quantize_run

    spec = quantize_run(args.run, args.scheme, args.out, args.calib_samples, args.calibrator, args.data, progress=True)
    calibrated = ""
    if "calibration_windows" in spec:
        calibrated = f", inputs calibrated ({spec['calibrator']}) on {spec['calibration_windows']} training windows"
    print(f"{args.run} -> {args.out}: {spec['scheme']}, {len(spec['layers'])} linear layers{calibrated}")
    print(f"sample from it: difftx generate --run {shell(args.out)} --prompt 'The'")
    return 0
