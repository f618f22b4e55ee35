"""`difftx demo` and `difftx presets`."""

from __future__ import annotations

import argparse

from difftransformer.apps.cli.parsing import OUTPUT, at_least, command, threads_flag

# apps.demo's PARTS and demo_icl.STEPS, here so that parsing the command line imports no torch (test_cli checks them)
PARTS = ("both", "icl", "lm")
ICL_STEPS = 1500


def _demo(args: argparse.Namespace) -> int:
    from difftransformer.apps.demo import run_demo

    run_demo(
        steps=args.steps, out=args.out, data=args.data, resume=args.resume, part=args.part, icl_steps=args.icl_steps
    )
    return 0


def _presets(args: argparse.Namespace) -> int:
    from difftransformer.apps.demo import norm_context
    from difftransformer.core.config import PRESETS, ModelConfig
    from difftransformer.core.head_norm_gain import matched_gains
    from difftransformer.core.model import count_parameters

    gains = " matched gain, first / last layer" if args.gains else ""
    print(
        f"{'preset':>8} {'d_model':>7} {'layers':>6} {'heads':>5} {'DIFF heads':>10} {'vocabulary':>10} "
        f"{'DIFF params':>15} {'standard params':>15}{gains}",
        flush=True,
    )
    for name in PRESETS:
        cfg = ModelConfig.preset(name)
        n_diff = count_parameters(cfg)
        n_std = count_parameters(ModelConfig.preset(name, attention="standard"))
        if args.gains:
            g = matched_gains(cfg)
            gains = f" {g[0]:>17.3f} / {g[-1]:.3f}"
        print(
            f"{name:>8} {cfg.d_model:>7} {cfg.n_layers:>6} {cfg.n_heads:>5} {cfg.attention_heads:>10} "
            f"{cfg.vocab_size:>10,} {n_diff:>15,} {n_std:>15,}{gains}",
            flush=True,
        )
    if args.gains:
        print(
            'The matched gain (ModelConfig(head_norm_gain="matched"), docs/guide/modules.md): the per-head norm\'s '
            "initial weight at which DIFF's attention block starts at the standard model's output RMS, per layer, "
            "for text whose tokens follow Zipf's law over the vocabulary; the paper's V1 starts it at 1 in every "
            "layer"
        )
    print(
        "A run takes its vocabulary from its data's tokenizer: the byte tokenizer's 257 tokens (256 bytes and an "
        "end-of-document token; the demo's) add one embedding row and one output row to a 256-token preset"
    )
    for line in norm_context():  # what the committed study found for DIFF V1's per-head norm at a small size
        print(line)
    return 0


def demo_command(sub) -> None:
    demo = command(
        sub,
        "demo",
        _demo,
        "part 1 (75 to 95 s): DIFF and standard trained side by side on in-context learning, their accuracy "
        "and attention drawn; part 2: tiny DIFF (V1 as published and with the matched gain) and standard language "
        "models; a report",
        "difftx demo\ndifftx demo --part icl\ndifftx demo --part lm --steps 240 --out runs/demo",
    )
    demo.add_argument(
        "--part", choices=PARTS, default="both", help="icl: part 1 alone; lm: part 2 alone; both (default)"
    )
    demo.add_argument("--icl-steps", type=at_least(1), default=ICL_STEPS, help="part 1's training steps of each model")
    demo.add_argument("--steps", type=at_least(1), default=240, help="part 2's training steps of each model")
    demo.add_argument(
        "--out", type=OUTPUT, default="runs/demo", help="report directory (a free name is chosen next to it)"
    )
    demo.add_argument(
        "--data", type=OUTPUT, default="data/pydocs", help="where the built-in corpus is prepared (reused)"
    )
    demo.add_argument(
        "--resume", action="store_true", help="continue the interrupted demo in --out (Ctrl-C saves every model)"
    )
    threads_flag(demo)


def presets_command(sub) -> None:
    command(
        sub,
        "presets",
        _presets,
        "list the model presets with DIFF and standard parameter counts",
        "difftx presets\ndifftx presets --gains",
    ).add_argument(
        "--gains",
        action="store_true",
        help="also each preset's matched per-head norm gain, first and last layer (about a minute for all of them)",
    )
