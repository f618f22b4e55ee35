"""`difftx analyze attention` and `difftx analyze outliers`, each with its own flags."""

from __future__ import annotations

import argparse

from difftransformer.apps.cli.parsing import INPUT, OUTPUT, at_least, command, threads_flag


def analyze_command(sub) -> None:
    analyze = sub.add_parser(
        "analyze",
        help="attention: plots of a run's attention maps; outliers: the paper's Table 5 statistics",
        description="Analyses of trained runs: their attention maps on a prompt, or their activation outliers.",
    )
    modes = analyze.add_subparsers(dest="what", required=True, metavar="MODE")
    attention = command(
        modes,
        "attention",
        _analyze,
        "both maps of each head on a prompt and their difference, as one figure",
        "difftx analyze attention --run runs/diff-tiny --prompt-file prompt.txt --out reports/maps.png",
    )
    attention.add_argument(
        "--run", type=INPUT, required=True, help="a run directory (its newest checkpoint; a repro model too)"
    )
    attention.add_argument(
        "--prompt-file",
        type=INPUT,
        required=True,
        help="UTF-8 text (byte and BPE runs) or whitespace-separated token ids",
    )
    attention.add_argument("--out", type=OUTPUT, required=True, help="the PNG to write (its folder is made)")
    attention.add_argument("--layer", type=int, default=-1, help="the layer to show (-1: the last)")
    threads_flag(attention)
    outliers = command(
        modes,
        "outliers",
        _analyze,
        "the paper's Table 5: the largest attention logits and hidden states, per layer",
        "difftx analyze outliers --run runs/diff-tiny --run runs/std-tiny --tokens 65536 --out reports/outliers",
    )
    outliers.add_argument(
        "--run", type=INPUT, required=True, action="append", help="a run directory; repeat the flag for more runs"
    )
    outliers.add_argument("--out", type=OUTPUT, required=True, help="a new directory for the tables and histograms")
    outliers.add_argument(
        "--tokens",
        type=at_least(1),
        default=400_000,
        help="validation tokens per run (400000 as in the paper; fewer when the split is smaller)",
    )
    outliers.add_argument("--data", type=INPUT, help="the data directory (default: the one each run was trained on)")
    outliers.add_argument("--batch", type=at_least(1), default=4, help="windows per forward pass")
    threads_flag(outliers)


def _analyze(args: argparse.Namespace) -> int:
    if args.what == "outliers":
        from difftransformer.apps.analyze_outliers import analyze_outliers

        path = analyze_outliers(args.run, args.out, args.tokens, args.data, args.batch)
        print((path / "outliers.md").read_text(encoding="utf-8"))
        print(f"wrote {path}")
        return 0
    from difftransformer.apps.analyze import analyze_attention

    path = analyze_attention(args.run, args.prompt_file, args.out, args.layer)
    print(f"wrote {path}")
    return 0
