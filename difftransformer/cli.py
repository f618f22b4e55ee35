"""`difftx`: the command-line interface (also `python -m difftransformer`)."""

from __future__ import annotations

import argparse
import sys

from difftransformer import __version__


def _demo(args: argparse.Namespace) -> int:
    from difftransformer.demo import run_demo

    run_demo(seed=args.seed)
    return 0


def _presets(args: argparse.Namespace) -> int:
    from difftransformer.config import PRESETS, ModelConfig
    from difftransformer.model import count_parameters

    print(
        f"{'preset':>8} {'d_model':>7} {'layers':>6} {'heads':>5} {'DIFF heads':>10} {'DIFF params':>15} "
        f"{'standard params':>15}"
    )
    for name in PRESETS:
        cfg = ModelConfig.preset(name)
        n_diff = count_parameters(cfg)
        n_std = count_parameters(ModelConfig.preset(name, attention="standard"))
        print(
            f"{name:>8} {cfg.d_model:>7} {cfg.n_layers:>6} {cfg.n_heads:>5} {cfg.n_heads // 2:>10} "
            f"{n_diff:>15,} {n_std:>15,}"
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from difftransformer import bench

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        result = bench.bench_attention(args.seq, args.dim, args.heads, args.batch, args.repeats)
    finally:
        torch.set_num_threads(threads)
    print(bench.format_attention(result))
    if args.json:
        bench.write_json(result, args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="difftx", description="The Differential Transformer: tools.")
    parser.add_argument("--version", action="version", version=f"difftransformer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build the tiny DIFF / standard pair and show the mechanism's properties")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    presets = sub.add_parser("presets", help="list the model presets with DIFF and standard parameter counts")
    presets.set_defaults(func=_presets)
    bench = sub.add_parser("bench", help="benchmarks: ratios measured side by side in one run")
    bench.add_argument("what", choices=["attention"])
    bench.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    bench.add_argument("--dim", type=int, default=512)
    bench.add_argument("--heads", type=int, default=8, help="standard heads (DIFF uses half)")
    bench.add_argument("--batch", type=int, default=1)
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--threads", type=int, default=1)
    bench.add_argument("--json", help="also write the results to this JSON file")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"difftx {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
