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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="difftx", description="The Differential Transformer: tools.")
    parser.add_argument("--version", action="version", version=f"difftransformer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build the tiny DIFF / standard pair and show the mechanism's properties")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    presets = sub.add_parser("presets", help="list the model presets with DIFF and standard parameter counts")
    presets.set_defaults(func=_presets)
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
