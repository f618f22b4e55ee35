"""The `difftx` parser: one subcommand per command module of this package."""

from __future__ import annotations

import argparse

from difftransformer import __version__
from difftransformer.apps.cli import analyze, bench, convert, data, demo, eval, generate, quantize, repro, train
from difftransformer.apps.cli.parsing import Parser


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="difftx",
        description="The Differential Transformer: train, sample, convert, evaluate and reproduce the paper's claims.",
        epilog="Each command's flags and their defaults: difftx COMMAND --help. A first run: difftx demo. "
        "The tutorials and the API reference: make docs in a checkout, then site/index.html.",
    )
    parser.add_argument("--version", action="version", version=f"difftransformer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        demo.demo_command,
        demo.presets_command,
        data.data_command,
        data.tokenizer_command,
        train.train_command,
        generate.generate_command,
        convert.convert_command,
        eval.eval_command,
        quantize.quantize_command,
        bench.bench_command,
        repro.repro_command,
        analyze.analyze_command,
    ):
        add(sub)
    return parser
