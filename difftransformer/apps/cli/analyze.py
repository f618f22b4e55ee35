"""`difftx analyze`."""

from __future__ import annotations

import argparse

from difftransformer.apps.cli.parsing import at_least, command


def analyze_command(sub) -> None:
    analyze = command(
        sub, "analyze", _analyze, "attention: plots of a run's attention maps; outliers: the paper's Table 5 statistics"
    )
    analyze.add_argument(
        "what", choices=["attention", "outliers"], help="attention maps of a prompt, or activation outliers"
    )
    analyze.add_argument(
        "--run",
        required=True,
        action="append",
        help="a run directory (its newest checkpoint; a repro model is one too); outliers: repeat for more",
    )
    analyze.add_argument("--prompt-file", help="attention: UTF-8 text (byte/BPE runs) or whitespace-separated ids")
    analyze.add_argument("--out", required=True, help="attention: the PNG to write; outliers: a new directory")
    analyze.add_argument("--layer", type=int, default=-1, help="attention: layer to show (default the last)")
    analyze.add_argument(
        "--tokens",
        type=at_least(1),
        default=400_000,
        help="outliers: validation tokens per run (default 400000, as in the paper; fewer when the split is smaller)",
    )
    analyze.add_argument("--data", help="outliers: the data directory (default: the one each run was trained on)")
    analyze.add_argument("--batch", type=at_least(1), default=4, help="outliers: windows per forward pass")


def _analyze(args: argparse.Namespace) -> int:
    if args.what == "outliers":
        from difftransformer.apps.analyze_outliers import analyze_outliers

        path = analyze_outliers(args.run, args.out, args.tokens, args.data, args.batch)
        print((path / "outliers.md").read_text(encoding="utf-8"))
        print(f"wrote {path}")
        return 0
    from difftransformer.apps.analyze import analyze_attention

    if len(args.run) != 1 or args.prompt_file is None:
        from difftransformer.errors import InputError

        raise InputError("analyze attention takes one --run and a --prompt-file")
    path = analyze_attention(args.run[0], args.prompt_file, args.out, args.layer)
    print(f"wrote {path}")
    return 0
