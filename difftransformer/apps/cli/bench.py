"""`difftx bench`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from difftransformer.apps.cli.parsing import at_least, command


def _bench(args: argparse.Namespace) -> int:
    import torch

    from difftransformer.apps import bench
    from difftransformer.errors import ConfigError
    from difftransformer.training.config import device_problem

    if (problem := device_problem(args.device)) is not None:
        raise ConfigError("bench", "device", problem)

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.what == "attention":
            result = bench.bench_attention(
                args.seq or [1024, 4096],
                args.dim,
                args.heads,
                args.batch or 1,
                args.repeats,
                device=args.device,
                dtype=getattr(torch, args.dtype),
            )
            print(bench.format_attention(result))
        elif args.what == "train":
            result = bench.bench_train(
                args.preset, args.seq, args.batch or 4, args.repeats, args.device, getattr(torch, args.dtype)
            )
            print(bench.format_train(result))
        elif args.what == "threads":
            from difftransformer.apps.bench_threads import bench_threads, format_threads

            result = bench_threads(max(2, args.threads), args.seq, None if args.batch is None else [args.batch],
                                   args.preset, repeats=args.repeats)  # fmt: skip
            print(format_threads(result))
        elif args.what == "context":
            from difftransformer.apps import bench_context

            if not args.json:
                raise ConfigError("bench", "json", "is needed by bench context: the study's store (the same file again "
                                  "resumes it)")  # fmt: skip
            budget = None if args.memory_gib is None else int(args.memory_gib * 2**30)
            result = bench_context.bench_context(
                args.json, args.preset, args.seq, tuple(args.kinds), batch=args.batch or 1, repeats=args.repeats,
                budget_bytes=budget, max_seconds=args.max_seconds, threads=args.threads,
            )  # fmt: skip
            print(bench_context.format_context(result))
            if any("seconds" in e for e in result["rows"]):
                from difftransformer.apps.repro.report import PLOT_EXTRA, has_pyplot

                if not has_pyplot():  # hours of measurements are not lost to a figure
                    print(f"bench context: no figure drawn, matplotlib is not installed ({PLOT_EXTRA}); the table "
                          "above and the store hold every result", file=sys.stderr)  # fmt: skip
                else:
                    bench_context.figure(result, Path(args.json).with_suffix(".png"))
            return 0  # the store is the JSON, written after each measurement
        elif args.what == "quantized":
            if args.run is None:
                raise ConfigError("bench", "run", "is needed by bench quantized: a run made by difftx quantize")
            result = bench.bench_quantized(args.run, args.context, args.tokens, args.repeats)
            print(bench.format_quantized(result))
        else:
            result = bench.bench_decode(
                args.context, args.preset, args.tokens, args.repeats, args.compile, args.hf, args.batch or 1
            )
            print(bench.format_decode(result))
    finally:
        torch.set_num_threads(threads)
    if args.json:
        from difftransformer.fsutil import write_json

        write_json(args.json, result, indent=2)
    return 0


def bench_command(sub) -> None:
    bench = command(sub, "bench", _bench, "benchmarks: ratios measured side by side in one run")
    bench.add_argument(
        "what", choices=["attention", "train", "decode", "quantized", "threads", "context"], help="what to measure"
    )
    bench.add_argument("--run", help="quantized: a run made by difftx quantize (compared with its float source)")
    bench.add_argument("--context", type=at_least(1), nargs="+", default=[512, 2048], help="decode: prompt lengths")
    bench.add_argument("--preset", default="small", help="train, decode: the model preset")
    bench.add_argument("--tokens", type=at_least(1), default=32, help="decode: timed steps per repeat")
    bench.add_argument(
        "--seq",
        type=at_least(1),
        nargs="+",
        help="attention, threads: 1024 4096 by default; train: 256 1024 2048; context: 1K to 64K",
    )
    bench.add_argument("--dim", type=at_least(1), default=512, help="attention: the model width")
    bench.add_argument("--heads", type=at_least(2), default=8, help="standard heads (DIFF uses half)")
    bench.add_argument("--batch", type=at_least(1), help="attention: 1, train: 4, decode: 1, threads: 1 and 4")
    bench.add_argument("--repeats", type=at_least(1), default=3, help="interleaved repeats; medians are reported")
    bench.add_argument(
        "--threads", type=at_least(1), default=1, help="CPU threads (threads: 1 against this, at least 2)"
    )
    bench.add_argument("--device", default="cpu", help="attention, train: cpu or cuda")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="attention/train")
    bench.add_argument("--compile", action="store_true", help="decode: also each model's step under torch.compile")
    bench.add_argument("--hf", action="store_true", help="decode: also transformers generate() on the same weights")
    bench.add_argument("--json", help="also write the results to this JSON file (context: its store, resumed)")
    bench.add_argument("--kinds", nargs="+", choices=["prefill", "train"], default=["prefill", "train"],
                       help="context: what to time at each T")  # fmt: skip
    bench.add_argument("--memory-gib", type=float, help="context: the memory budget (default 80%% of what is free)")
    bench.add_argument("--max-seconds", type=float, default=1800, help="context: skip a T predicted to take longer")
