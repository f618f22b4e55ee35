"""`difftx repro`."""

from __future__ import annotations

import argparse

from difftransformer.apps.cli.parsing import INPUT, OUTPUT, at_least, command


def repro_command(sub) -> None:
    repro = command(
        sub,
        "repro",
        _repro,
        "the paper's claims: attention noise on synthetic tasks (needle, allocation, icl) and language modeling (lm)",
        "difftx repro needle --scale cpu --seeds 5 --out reports/needle\n"
        "difftx repro lm --scale cpu --out reports/lm --part sweep",
    )
    repro.add_argument("what", choices=["needle", "allocation", "icl", "lm", "quant", "all"], help="which experiment")
    repro.add_argument("--scale", default="cpu", choices=["cpu", "gpu"], help="model size and training budget")
    repro.add_argument(
        "--seeds", type=at_least(1), default=3, help="seeds 0..n-1; each trains a DIFF and a standard model"
    )
    repro.add_argument(
        "--out",
        type=OUTPUT,
        help="a new report directory (default reports/<what>, or reports for all); lm: the same one again continues "
        "an interrupted study",
    )
    repro.add_argument(
        "--workers", type=at_least(1), help="models trained at once (one thread each; default 2, lm on a GPU 1)"
    )
    repro.add_argument(
        "--steps", type=at_least(1), help="override the scale's training steps (quick checks; lm: the long budget)"
    )
    repro.add_argument(
        "--models",
        type=INPUT,
        help="allocation: a needle report directory whose trained models to measure; quant: a `repro lm` directory; "
        "needle, icl: a report directory of the same experiment whose models to evaluate again (no training)",
    )
    repro.add_argument(
        "--part",
        nargs="+",
        choices=["sweep", "grid", "ablations", "long", "norm"],
        help="lm: the parts to run (default sweep grid ablations, in order; grid and ablations need the sweep's "
        "result); long: the long-budget comparison of DIFF V1, its ablation, V2 and the baseline at 20 tokens per "
        "parameter (hours on CPU; not in the default); norm: the per-head norm's initial scale "
        "(ModelConfig.head_norm_gain) and its confounds at that size, every variant tuned at the whole budget "
        "(hours; not in the default)",
    )
    repro.add_argument(
        "--logit-bits",
        type=int,
        help="needle, icl: the final evaluation with attention logits quantized to this many bits (2-16)",
    )
    repro.add_argument(
        "--corpora",
        type=INPUT,
        nargs="+",
        help="lm: corpus directories used besides the built-in one (default data/shakespeare data/sotu, made by "
        "`difftx data fetch`)",
    )
    repro.add_argument(
        "--log-to",
        default="jsonl",
        help="where each trained model logs its metrics, as for difftx train: lm, every sink (jsonl,tensorboard: one "
        "TensorBoard run per model, tensorboard --logdir OUT/runs); needle and icl, tensorboard (each model's "
        "learning curve, in OUT/tensorboard)",
    )


def _repro(args: argparse.Namespace) -> int:
    from difftransformer.apps.repro import suite

    out = args.out or ("reports" if args.what == "all" else f"reports/{args.what}")
    parts = tuple(args.part) if args.part else None
    report = suite.run(
        args.what, out, args.scale, args.seeds, args.workers, args.steps, args.models, parts, args.corpora,
        args.logit_bits, args.log_to,
    )  # fmt: skip
    print(f"report: {report}")
    return 0
