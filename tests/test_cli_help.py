"""`difftx ... --help` for every command: each mode of bench and analyze is a command of its own (no flag of another
mode), required flags say so, every default is shown, and each command ends with examples that parse with its own
parser (so that they cannot rot)."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from difftransformer.apps.cli import build_parser
from difftransformer.apps.cli.parsing import leaf_commands

COMMANDS = dict(leaf_commands(build_parser()))


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _shown(text: str) -> str:
    """Help text as one line (argparse wraps lines, also after a hyphen)."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


def test_every_command_is_listed():
    assert len(COMMANDS) == 21
    assert {path for path in COMMANDS if path[0] in ("bench", "analyze")} == {
        ("bench", mode) for mode in ("attention", "train", "decode", "quantized", "threads", "load", "context")
    } | {("analyze", "attention"), ("analyze", "outliers")}


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_help_marks_required_flags_and_shows_every_default(path):
    parser = COMMANDS[path]
    text = _shown(parser.format_help())
    for action in _flags(parser):
        flag = action.option_strings[-1]
        if action.required:
            assert _shown(f"{action.help} (required)") in text, f"{flag} is required but not marked"
        elif action.default not in (None, False):
            value = " ".join(map(str, action.default)) if isinstance(action.default, list) else str(action.default)
            assert f"(default {value})" in text or "(default" in _shown(action.help), f"{flag}: default not shown"


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_help_ends_with_examples_that_parse(path):
    parser = COMMANDS[path]
    assert parser.format_help().rstrip().split("\n\n")[-1].startswith("example:\n  difftx " + " ".join(path))
    examples = parser.epilog.splitlines()[1:]
    assert examples
    for line in examples:
        argv = shlex.split(line)
        assert argv[: 1 + len(path)] == ["difftx", *path]
        args = build_parser().parse_args(argv[1:])  # SystemExit (an unknown or malformed flag) fails the test
        assert args.parser.prog == parser.prog


def test_a_flag_of_another_mode_is_refused(capsys):
    """`--dim` belongs to bench attention only; `--prompt-file` to analyze attention only."""
    from difftransformer.apps.cli import main

    assert main(["bench", "decode", "--dim", "64"]) == 2
    assert "unrecognized arguments: --dim 64" in capsys.readouterr().err
    assert main(["analyze", "outliers", "--run", "r", "--out", "o", "--prompt-file", "p"]) == 2
    assert "unrecognized arguments: --prompt-file p" in capsys.readouterr().err


def _script_commands(text: str) -> list[list[str]]:
    """The difftx command lines of a benchmark script (`-m difftransformer ...`, or cpu.sh's `bench ...` helper),
    continuation lines joined."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True) if line.strip() and "$@" not in line else []  # not cpu.sh's helper
        if (
            "difftransformer" in words
            and words.index("difftransformer") > 0
            and words[words.index("difftransformer") - 1] == "-m"
        ):
            found.append(words[words.index("difftransformer") + 1 :])
        elif words[:1] == ["bench"]:
            found.append([*words, "--threads", "1"])  # cpu.sh's bench() adds --threads 1
    return [[w for w in argv if w not in ("||", "status=1")] for argv in found]


@pytest.mark.parametrize("script", ["cpu.sh", "gpu.sh"])  # lm_gpu.sh builds its command in an array
def test_the_benchmark_scripts_commands_parse(script):
    """gpu.sh's --cpu run (tests/test_gpu_script.py) skips the GPU benchmarks: their flags are checked here."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "benchmarks" / script).read_text()
    commands = _script_commands(text)
    assert commands, f"{script}: no difftx command found"
    for argv in commands:
        build_parser().parse_args(argv)  # SystemExit (an unknown flag, a missing one) fails the test
