"""`difftx bench MODE`: one subcommand per benchmark, each with its own flags."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from difftransformer.apps.cli.parsing import INPUT, OUTPUT, at_least, command


def _bench(args: argparse.Namespace) -> int:
    import torch

    from difftransformer.apps import bench
    from difftransformer.devices import resolve_device

    if (device := resolve_device(getattr(args, "device", "cpu"))).type == "cuda":  # refuses a device not here
        torch.cuda.set_device(device)  # every tensor and synchronisation of the benchmark on that GPU

    _check_json(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.what == "attention":
            result = bench.bench_attention(
                args.seq,
                args.dim,
                args.heads,
                args.batch,
                args.repeats,
                device=args.device,
                dtype=getattr(torch, args.dtype),
            )
            print(bench.format_attention(result))
        elif args.what == "train":
            result = bench.bench_train(
                args.preset, args.seq, args.batch, args.repeats, args.device, getattr(torch, args.dtype), args.matmul
            )
            print(bench.format_train(result))
        elif args.what == "threads":
            from difftransformer.apps.bench_threads import bench_threads, format_threads

            result = bench_threads(args.threads, args.seq, args.batch, args.preset, repeats=args.repeats)
            print(format_threads(result))
        elif args.what == "load":
            from difftransformer.apps.bench_load import bench_load, format_load

            result = bench_load(args.threads, args.preset, args.seq, args.batch, args.repeats, args.rounds)
            print(format_load(result))
        elif args.what == "context":
            from difftransformer.apps import bench_context

            budget = None if args.memory_gib is None else int(args.memory_gib * 2**30)
            result = bench_context.bench_context(
                args.json, args.preset, args.seq, tuple(args.kinds), batch=args.batch, repeats=args.repeats,
                budget_bytes=budget, max_seconds=args.max_seconds, threads=args.threads,
            )  # fmt: skip
            print(bench_context.format_context(result))
            if any("seconds" in e for e in result["rows"]):
                from difftransformer.apps.figures import PLOT_EXTRA, has_pyplot

                if not has_pyplot():  # hours of measurements are not lost to a figure
                    print(f"bench context: no figure drawn, matplotlib is not installed ({PLOT_EXTRA}); the table "
                          "above and the store hold every result", file=sys.stderr)  # fmt: skip
                else:
                    bench_context.figure(result, Path(args.json).with_suffix(".png"))
            return 0  # the store is the JSON, written after each measurement
        elif args.what == "quantized":
            result = bench.bench_quantized(args.run, args.context, args.tokens, args.repeats)
            print(bench.format_quantized(result))
        else:
            result = bench.bench_decode(
                args.context, args.preset, args.tokens, args.repeats, args.compile, args.hf, args.batch,
                args.device, getattr(torch, args.dtype),
            )  # fmt: skip
            print(bench.format_decode(result))
    finally:
        torch.set_num_threads(threads)
    if args.json:
        from difftransformer.fsutil import write_json

        write_json(args.json, result, indent=2)
    return 0


def _check_json(args: argparse.Namespace) -> None:
    """The output rule for --json, before anything is measured: a results file is never written over; the context
    study's store is continued (its help says so), and its figure (the store's name with .png) may be replaced only
    when it is the study's own (the store exists)."""
    from difftransformer.errors import InputError

    if args.json is None:
        return
    path = Path(args.json)
    if args.what != "context":
        if os.path.lexists(path):
            raise InputError(f"--json {path} already exists; choose another path (results are never written over)")
        return
    if path.suffix.lower() != ".json":
        raise InputError(f"--json {path} must name a .json file (the figure goes beside it, as .png)")
    figure = path.with_suffix(".png")
    if not path.exists() and os.path.lexists(figure):
        raise InputError(
            f"{figure} already exists and is not this new study's figure (bench context draws its figure beside the "
            "--json store, with .png): move it, or choose another --json path"
        )


def bench_command(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmarks: ratios measured side by side in one run",
        description="Benchmarks: DIFF against the standard model (and Hugging Face) measured side by side in one run, "
        "medians of interleaved repeats, printed with the machine, threads, dtype and shapes.",
    )
    modes = bench.add_subparsers(dest="what", required=True, metavar="MODE")
    attention = command(
        modes,
        "attention",
        _bench,
        "one attention layer, forward and backward, DIFF / standard / HF",
        "difftx bench attention --seq 1024 4096 --dim 512 --heads 8",
    )
    attention.add_argument("--seq", type=at_least(1), nargs="+", default=[1024, 4096], help="sequence lengths")
    attention.add_argument("--dim", type=at_least(1), default=512, help="the model width")
    attention.add_argument("--heads", type=at_least(2), default=8, help="standard heads (DIFF uses half)")
    attention.add_argument("--batch", type=at_least(1), default=1, help="sequences per pass")
    _device_flags(attention)
    _common(attention)

    train = command(
        modes,
        "train",
        _bench,
        "a training step of a preset (forward, backward, AdamW), with achieved FLOP/s",
        "difftx bench train --preset small --seq 256 1024 --batch 4",
    )
    train.add_argument("--preset", default="small", help="the model preset")
    train.add_argument("--seq", type=at_least(1), nargs="+", default=[256, 1024, 2048], help="sequence lengths")
    train.add_argument("--batch", type=at_least(1), default=4, help="sequences per step")
    train.add_argument(
        "--matmul", type=at_least(16), default=None, metavar="N",
        help="the size of the reference matrix product for utilisation (default 2048 on a CPU, 8192 on a GPU)",
    )  # fmt: skip
    _device_flags(train)
    _common(train)

    decode = command(
        modes,
        "decode",
        _bench,
        "decode tokens/s from a prefilled cache, batch 1 or more",
        "difftx bench decode --preset small --context 512 2048 --compile",
    )
    decode.add_argument("--preset", default="small", help="the model preset")
    decode.add_argument("--context", type=at_least(1), nargs="+", default=[512, 2048], help="prompt lengths")
    decode.add_argument("--tokens", type=at_least(1), default=32, help="timed decode steps per repeat")
    decode.add_argument("--batch", type=at_least(1), default=1, help="prompts decoded together")
    decode.add_argument("--compile", action="store_true", help="also each model's step under torch.compile")
    decode.add_argument("--hf", action="store_true", help="also transformers' generate() on the same weights")
    _device_flags(decode)
    _common(decode)

    quantized = command(
        modes,
        "quantized",
        _bench,
        "a quantized run against its float source: size on disk, decode tokens/s",
        "difftx bench quantized --run runs/diff-tiny-w8a8 --context 128",
    )
    quantized.add_argument("--run", type=INPUT, required=True, help="a run made by difftx quantize")
    quantized.add_argument("--context", type=at_least(1), nargs="+", default=[512, 2048], help="prompt lengths")
    quantized.add_argument("--tokens", type=at_least(1), default=32, help="timed decode steps per repeat")
    _common(quantized)

    threads = command(
        modes,
        "threads",
        _bench,
        "the same work at 1 thread and at --threads: a training step and the core",
        "difftx bench threads --threads 2 --preset small --seq 1024",
    )
    threads.add_argument("--preset", default="small", help="the model preset")
    threads.add_argument("--seq", type=at_least(1), nargs="+", default=[1024, 4096], help="sequence lengths")
    threads.add_argument("--batch", type=at_least(1), nargs="+", default=[1, 4], help="sequences per step")
    _common(threads, threads=2)

    load = command(
        modes,
        "load",
        _bench,
        "a training and a decode step at 1 and --threads threads, OpenMP spinning or passive, idle and with a "
        "core busy",
        "difftx bench load --threads 2 --json load.json",
    )
    load.add_argument("--preset", default="tiny", help="the model preset (default: the demo's)")
    load.add_argument("--seq", type=at_least(1), default=256, help="tokens per sequence")
    load.add_argument("--batch", type=at_least(1), default=16, help="sequences per training step")
    load.add_argument("--rounds", type=at_least(1), default=2, help="rounds over every setting and condition")
    _common(load, threads=2)

    context = command(
        modes,
        "context",
        _bench,
        "prefill and a training step against the context length: time and peak memory",
        "difftx bench context --preset tiny --json context-tiny.json",
    )
    context.add_argument("--preset", default="tiny", help="the model preset")
    context.add_argument("--seq", type=at_least(1), nargs="+", help="context lengths (default 1024 to 65536, doubling)")
    context.add_argument("--kinds", nargs="+", choices=["prefill", "train"], default=["prefill", "train"],
                         help="what to time at each length")  # fmt: skip
    context.add_argument("--batch", type=at_least(1), default=1, help="sequences per pass")
    context.add_argument("--memory-gib", type=float, help="the memory budget (default 80%% of what is free)")
    context.add_argument("--max-seconds", type=float, default=1800, help="skip a length predicted to take longer")
    _common(context, store=True)


def _common(mode, threads: int = 1, store: bool = False) -> None:
    """The flags every `difftx bench MODE` has, after its own: repeats, threads and the JSON output."""
    mode.add_argument("--repeats", type=at_least(1), default=3, help="interleaved repeats; medians are reported")
    what = "the threads compared with 1 (at least 2)" if threads > 1 else "CPU threads"
    mode.add_argument("--threads", type=at_least(threads), default=threads, help=what)
    if store:
        mode.add_argument(
            "--json",
            type=OUTPUT,
            required=True,
            help="the study's store (a .json file): results are written after each measurement, the same file again "
            "continues the study, and the figure is drawn beside it (the same name with .png, replaced at each run)",
        )
    else:
        mode.add_argument("--json", type=OUTPUT, help="also write the results to this new JSON file")


def _device_flags(mode) -> None:
    mode.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    mode.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the dtype")
