"""`difftx train --config FILE` (TOML, YAML, JSON) and `--print-config`: what a file sets, what flags override, the
errors naming the file and its key, and a run's saved train_config.json as a config."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from conftest import SMALL, optional, train_args

from difftransformer.apps.cli import main
from difftransformer.errors import install_hint
from difftransformer.training.config import TrainConfig
from difftransformer.training.config_file import read_config_file, to_toml, tomllib

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))

TOML = """
data = "data/here"
lr = 0.002
batch-size = 8
betas = [0.9, 0.95]

[model]
n_layers = 2
d_model = 64
"""
YAML = """
data: data/here
lr: 2e-3
batch-size: 8
betas: [0.9, 0.95]
model:
  n_layers: 2
  d_model: 64
"""  # 2e-3 without a dot: a string in YAML 1.1 (PyYAML), read as the number users mean


def printed(capsys, *argv: str) -> dict:
    assert main(["train", *argv, "--print-config"]) == 0
    return tomllib.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name, text", [("run.toml", TOML), ("run.yaml", YAML), ("run.yml", YAML)])
def test_a_file_sets_the_fields_by_the_flags_names(tmp_path, name, text):
    if name.endswith((".yaml", ".yml")):
        optional("yaml")
    path = tmp_path / name
    path.write_text(text)
    fields = read_config_file(path)
    assert fields == {
        "data": "data/here",
        "lr": 0.002,
        "batch_size": 8,
        "betas": [0.9, 0.95],
        "model": {"n_layers": 2, "d_model": 64},
    }
    cfg = TrainConfig(**fields, out="o")
    assert (cfg.lr, cfg.batch_size, cfg.betas, cfg.model) == (0.002, 8, (0.9, 0.95), {"n_layers": 2, "d_model": 64})


def test_flags_override_the_file_and_model_keys_merge(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    shown = printed(capsys, "--config", str(path), "--lr", "0.004", "--model", '{"n_layers": 3, "n_heads": 2}')
    assert shown["lr"] == 0.004  # the flag
    assert shown["batch_size"] == 8 and shown["betas"] == [0.9, 0.95]  # the file
    assert shown["model"] == {"n_layers": 3, "d_model": 64, "n_heads": 2}  # the file's table, the flag's keys over it
    assert shown["max_steps"] == 2000 and shown["warmup_steps"] == 200  # neither: the defaults, resolved


def test_print_config_round_trips_and_says_what_is_unset(tmp_path, capsys):
    assert main(["train", "--lr", "0.003", "--seed", "7", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "# data is unset (required)" in out  # no --data: the printed file says what it lacks
    assert "# seq_len is unset (min(max_seq_len, 256))" in out
    path = tmp_path / "printed.toml"
    path.write_text(out)
    again = printed(capsys, "--config", str(path), "--data", "d")
    first = tomllib.loads(out)
    assert again == {**first, "data": "d"}  # the printed file reads back to the same settings
    assert again["lr"] == 0.003 and again["seed"] == 7


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("run.toml", 'data = "d"\nlr = 2.0\n', "run.toml: lr must be a finite number in (0, 1]"),
        ("run.toml", 'data = "d"\nlearning_rate = 0.1\n', "run.toml: unknown key 'learning_rate'"),
        ("run.toml", 'data = "d"\nbatch_size = 8\nbatch-size = 4\n', "'batch_size' is given twice"),
        ("run.toml", 'data = "d"\nmodel = 3\n', "run.toml: model must be a table"),
        ("run.toml", 'data = "d"\n[model]\nn_layerz = 2\n', "run.toml: model has 'n_layerz'"),
        ("run.toml", "data = \n", "run.toml is not valid TOML (Invalid value (at line 1"),
        ("run.yaml", "data: [1,\n", "run.yaml is not valid YAML"),
        ("run.yaml", "- 1\n- 2\n", "run.yaml must hold a mapping of settings, got list"),
        ("run.json", "[1]", "run.json must hold a JSON object, got list"),
        ("run.ini", "lr=1", "unknown format '.ini'; name the file .toml, .yaml, .yml or .json"),
        ("run.yaml", "data: d\nlr: 0.1\nlr: 0.2\n", "run.yaml gives the key 'lr' twice in one mapping; keep one"),
        ("run.json", '{"data": "d", "lr": 0.1, "lr": 0.2}', "run.json gives the key 'lr' twice in one object"),
        ("run.yaml", "data: d\nmodel: &a [*a]\n", "run.yaml: line 2 uses a YAML alias (*name)"),
        ("run.json", "[" * 5000 + "]" * 5000, "run.json nests more than 16 levels deep"),
        ("run.toml", "a = " + "[" * 5000 + "]" * 5000, "run.toml nests more than 16 levels deep"),
        ("run.yaml", "a: " + "x" * (1 << 20), "run.yaml is larger than a config file can be (1024 KiB)"),
        (
            "run.toml",
            'data = "d"\ninit_from = "r"\npreset = "small"\n',
            "run.toml: preset cannot be given with init_from: the model",
        ),
    ],
)
def test_errors_name_the_file_and_its_key(tmp_path, capsys, monkeypatch, name, text, message):
    if name.endswith(".yaml"):
        optional("yaml")
    monkeypatch.chdir(tmp_path)
    Path(name).write_text(text)
    assert main(["train", "--config", name, "--print-config"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err, err
    assert "--lr" not in err  # a file's key is named as the file names it, not as a flag


@pytest.mark.parametrize("levels", [2, 9])
def test_yaml_aliases_are_refused_in_time_however_they_nest(tmp_path, capsys, levels):
    """The recursive alias once ended in a RecursionError traceback and nested ones ("billion laughs") in gigabytes:
    each is now refused at its first alias, before anything is built."""
    import time

    optional("yaml")
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(levels)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    start = time.perf_counter()
    assert main(["train", "--config", str(path), "--print-config"]) == 2
    assert time.perf_counter() - start < 1.0
    assert (
        "line 2 uses a YAML alias (*name), which a config file may not: write the value out" in capsys.readouterr().err
    )


def test_a_flag_s_error_names_the_flag_not_the_file(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('data = "d"\nlr = 2.0\n')
    assert main(["train", "--config", str(path), "--lr", "3", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "--lr must be" in err and "run.toml" not in err


def test_a_missing_file_and_a_missing_yaml_module_are_named(tmp_path, capsys, monkeypatch):
    assert main(["train", "--config", str(tmp_path / "nope.toml"), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "--config" in err and "nope.toml does not exist" in err, err
    path = tmp_path / "run.yaml"
    path.write_text(YAML)
    monkeypatch.setitem(sys.modules, "yaml", None)  # as if PyYAML were not installed
    assert main(["train", "--config", str(path), "--print-config"]) == 2
    assert f"this needs yaml, an optional dependency: {install_hint('yaml')}" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="nope.json does not exist"):
        read_config_file(tmp_path / "nope.json")


def test_toml_writer_values_read_back():
    settings = {
        "data": 'a "quoted" path\\ with\ttab and \x7f and é and 😀',
        "out": "o",
        "lr": 1e-05,
        "betas": (0.9, 0.98),
        "compile": True,
        "threads": None,
        "model": {"dropout": 0.0, "tie_embeddings": False, "lambda_init": float("inf")},
    }
    read = tomllib.loads(to_toml(settings))
    assert read["data"] == settings["data"] and read["lr"] == 1e-05 and read["betas"] == [0.9, 0.98]
    assert read["compile"] is True and "threads" not in read
    assert read["model"] == {"dropout": 0.0, "tie_embeddings": False, "lambda_init": float("inf")}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_the_example_configs_load(path, capsys):
    fields = read_config_file(path)
    cfg = TrainConfig(**fields, out="o")
    assert cfg.preset in path.stem or path.stem.startswith("demo-")
    shown = printed(capsys, "--config", str(path))
    assert shown["preset"] == cfg.preset and shown["lr"] == cfg.lr


def _comment_examples(path: Path) -> list[list[str]]:
    """The train commands a config's comments give (``difftx train ...``, ``torchrun ... -m difftransformer train
    ...``, up to two spaces or a parenthesis), each also with the flags an ``e.g. --flag value`` sentence offers."""
    comments = [line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#")]
    commands = [re.split(r"\s{2,}|\s\(", re.split(r"difftx train |-m difftransformer train ", line, maxsplit=1)[1])[0]
                for line in comments if re.search(r"difftx train |-m difftransformer train ", line)]  # fmt: skip
    offered = [m.strip() for line in comments for m in re.findall(r"e\.g\. ((?:--[\w-]+ [^-\s]\S*\s?)+)", line)]
    return [shlex.split(c) for c in commands] + [shlex.split(f"{c} {flags}") for c in commands for flags in offered]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_example_in_a_configs_comments_runs(path, capsys):
    """#56: tiny.toml's "e.g. --attention standard for the baseline" failed on the file's head_norm_gain. Each example
    resolves to a whole config, its model's fields included (--print-config builds the model's config as training
    does; DIR stands for a data directory)."""
    examples = _comment_examples(path)
    assert examples, f"{path.name} gives no example command"
    for argv in examples:
        argv = ["data/here" if arg == "DIR" else arg for arg in argv]
        assert main(["train", *argv, "--print-config"]) == 0, (argv, capsys.readouterr().err)
        assert "[model]" in capsys.readouterr().out


def test_a_flags_attention_without_a_per_head_norm_leaves_the_files_rule_out_with_a_note(tmp_path, capsys):
    tiny = str(ROOT / "configs" / "tiny.toml")
    shown = printed(capsys, "--config", tiny, "--attention", "standard")
    assert "head_norm_gain" not in shown["model"]
    assert main(["train", "--config", tiny, "--attention", "standard", "--print-config"]) == 0
    assert "tiny.toml's [model] head_norm_gain (the norm's starting weight) is left out" in capsys.readouterr().err
    kept = printed(capsys, "--config", tiny, "--attention", "standard", "--model", '{"head_norm": true}')
    assert kept["model"] == {"head_norm_gain": "matched", "head_norm": True}
    bad = tmp_path / "bad.toml"  # the file itself pairs the rule with a model that has no norm: its error
    bad.write_text('data = "d"\nattention = "standard"\n[model]\nhead_norm_gain = "matched"\n')
    assert main(["train", "--config", str(bad), "--print-config"]) == 2
    assert f"{bad}: head_norm_gain is the initial weight of the per-head norm" in capsys.readouterr().err


def test_the_demo_configs_are_the_demo_s_settings():
    from difftransformer.apps.demo import MODELS, demo_config

    for kind in MODELS:
        fields = read_config_file(ROOT / "configs" / f"demo-{kind}.toml")
        expected = demo_config(kind, data=fields["data"], out="o")
        assert dataclasses.asdict(TrainConfig(**fields, out="o")) == dataclasses.asdict(expected)


@pytest.mark.slow
def test_a_runs_saved_config_starts_a_run_with_the_same_recipe(prepared, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["train", *train_args(prepared, out=first, max_steps=2, lr=0.004, seed=3)]) == 0
    saved = json.loads((first / "train_config.json").read_text())
    assert saved["lr"] == 0.004 and saved["model"] == SMALL
    assert main(["train", "--config", str(first / "train_config.json"), "--out", str(second), "--quiet"]) == 0
    assert json.loads((second / "train_config.json").read_text()) == saved  # the run's recipe, to the last field
