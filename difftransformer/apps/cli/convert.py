"""`difftx convert`."""

from __future__ import annotations

import argparse

from difftransformer.apps.cli.parsing import INPUT, OUTPUT, command, threads_flag
from difftransformer.fsutil import shell


def convert_command(sub) -> None:
    conv = command(
        sub,
        "convert",
        _convert,
        "a run to a Hugging Face directory (--to hf), or back (--from-hf)",
        "difftx convert --run runs/diff-tiny --to hf --out hf/diff-tiny --license mit\n"
        "difftx convert --from-hf hf/diff-tiny --out runs/diff-tiny-back",
    )
    conv.add_argument("--run", type=INPUT, help="the run directory to convert")
    conv.add_argument("--to", choices=["hf"], default="hf", help="the format of --run's export")
    conv.add_argument("--from-hf", type=INPUT, help="a DiffLlama or Llama save_pretrained directory")
    conv.add_argument(
        "--attention",
        choices=["diff"],
        help="with --from-hf of a Llama: build a DIFF model from it (approximate: it starts near the Llama's loss, "
        "to fine-tune with difftx train --init-from)",
    )
    conv.add_argument(
        "--out", type=OUTPUT, required=True, help="the new directory (a Hugging Face directory, or a run)"
    )
    conv.add_argument("--license", help="--to hf: the license in the model card's front matter (a Hub id, e.g. mit)")
    conv.add_argument(
        "--dataset",
        action="append",
        help="--to hf: a Hub dataset id the model was trained on, for the model card's front matter (repeat for more)",
    )
    threads_flag(conv)


def _convert(args: argparse.Namespace) -> int:
    from transformers.utils import logging

    from difftransformer.errors import InputError
    from difftransformer.fsutil import read_json_object
    from difftransformer.interop.convert import hf_to_run, run_to_hf

    logging.disable_progress_bar()  # one line per conversion, not transformers' loading bars

    if bool(args.run) == bool(args.from_hf):
        raise InputError("give either --run RUN --to hf, or --from-hf DIR")
    if args.run:
        out = run_to_hf(args.run, args.out, args.license, args.dataset)
        arch = read_json_object(out / "config.json")["architectures"][0]
        print(
            f"{args.run} -> {out}: a {arch} directory with a model card (README.md); load it with "
            "transformers.AutoModelForCausalLM.from_pretrained"
        )
    else:
        out = hf_to_run(args.from_hf, args.out, attention=args.attention)
        approximate = (
            " (a DIFF model built from a standard one: an approximation, near its loss, not the same function; "
            f"fine-tune it with: difftx train --init-from {shell(out)} --data DATA --out RUN)"
            if args.attention == "diff"
            else ""
        )
        print(
            f"{args.from_hf} -> {out}: a run directory{approximate}; sample with: difftx generate --run {shell(out)} "
            "--prompt 'Your text'"
        )
    return 0
