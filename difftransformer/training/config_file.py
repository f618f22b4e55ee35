"""A training run's settings in a file: `difftx train --config FILE` reads TOML, YAML or JSON, and `--print-config`
writes the effective config as TOML.

The keys are the flags' names (``lr``, ``batch_size`` or ``batch-size``), and ``model`` is a table of ModelConfig
overrides; ``betas``, which has no flag, may be given too. A key set to null (JSON, YAML) takes the value None, as
the run's saved ``train_config.json`` records an unset field: that file is such a config, and starts a new run with
the same recipe. Paths in a file (``data``, ``out``, ``init_from``) are read as given, relative to the working
directory, as the flags' are.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from difftransformer.errors import ConfigError, InputError
from difftransformer.fsutil import parse_json_object, parse_mapping, read_text
from difftransformer.paths import special_kind
from difftransformer.training.config import TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML with the backport (a dependency there)
    import tomli as tomllib

FORMATS = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}
KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig))
PATHS = ("data", "out", "init_from")  # read as written
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The TrainConfig fields a config file sets, its keys checked; the errors name the file."""
    path = Path(path)
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise InputError(
            f"`config` {path}: unknown format {path.suffix or '(no suffix)'!r}; name the file .toml, .yaml, .yml or "
            ".json"
        )
    if not path.is_file():
        kind = special_kind(path.stat().st_mode) if path.exists() else None
        problem = "is a directory" if path.is_dir() else f"is {kind}" if kind else "does not exist"
        raise FileNotFoundError(
            f"`config` {path} {problem}; give a TOML, YAML or JSON file (difftx train --print-config writes one)"
        )
    data = _parse(read_text(path), kind, str(path))
    fields: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in KEYS:
            raise InputError(f"{path}: unknown key {key!r}; the keys are the flags' names: {', '.join(KEYS)}")
        if name in fields:
            raise InputError(f"{path}: {name!r} is given twice (as {name!r} and {name.replace('_', '-')!r})")
        fields[name] = value
    if "model" in fields and not isinstance(fields["model"], dict):
        raise InputError(f"{path}: model must be a table of ModelConfig fields, got {fields['model']!r}")
    return fields


def _parse(text: str, kind: str, where: str) -> dict[str, Any]:
    """The file's settings. Bounded before anything is walked: at most MAX_BYTES, nesting at most MAX_DEPTH (deeper
    documents overflow the readers' recursion), no YAML alias (``*a``: a recursive one, ``a: &a [*a]``, has no end
    and nested ones grow exponentially, the "billion laughs"), no key given twice."""
    if len(text.encode("utf-8")) > MAX_BYTES:
        raise InputError(f"{where} is larger than a config file can be ({MAX_BYTES // 1024} KiB)")
    if _depth(text) > MAX_DEPTH:
        raise InputError(f"{where} nests more than {MAX_DEPTH} levels deep; a config file needs two")
    if kind == "JSON":
        return parse_json_object(text, where)
    if kind == "TOML":
        return parse_mapping(tomllib.loads, text, where, tomllib.TOMLDecodeError, "TOML", "a table of settings")
    import yaml  # an optional dependency (the yaml extra): the CLI names it when missing

    load = functools.partial(yaml.load, Loader=_loader(yaml, where))  # a SafeLoader without aliases
    data = parse_mapping(load, text, where, yaml.YAMLError, "YAML", "a mapping of settings")
    return {k: v if str(k).replace("-", "_") in PATHS else _yaml_numbers(v) for k, v in data.items()}


MAX_BYTES = 1 << 20
MAX_DEPTH = 16


def _depth(text: str) -> int:
    """An upper bound of a document's nesting: the most brackets open at once, or indentation steps (YAML)."""
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(0, depth - 1)
    indents = {len(line) - len(line.lstrip(" -")) for line in text.splitlines() if line.strip()}
    return max(deepest, len(indents))


def _loader(yaml, where: str):
    """PyYAML's SafeLoader that refuses aliases where it meets them (before building anything) and keys given twice
    in one mapping (YAML forbids them; PyYAML kept the last without a word)."""

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise InputError(
                    f"{where}: line {mark.line + 1} uses a YAML alias (*name), which a config file may not: write the "
                    "value out"
                )
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
            for i, key in enumerate(keys):
                if key in keys[:i]:
                    raise InputError(f"{where} gives the key {key!r} twice in one mapping; keep one")
            return super().construct_mapping(node, deep)

    return Loader


def _yaml_numbers(value: Any) -> Any:
    """PyYAML reads YAML 1.1, where ``3e-4`` (no dot) is a string, not a number: such strings become floats."""
    if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, dict):
        return {k: _yaml_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_yaml_numbers(v) for v in value]
    return value


def file_error(path: str | Path, err: ConfigError) -> InputError:
    """A range error of a field the file set, naming the file and its key (not a flag)."""
    return InputError(f"{path}: {err.render(str)}")


def to_toml(settings: dict[str, Any]) -> str:
    """A TrainConfig's fields (``dataclasses.asdict``) as a TOML file that `--config` reads back to the same config;
    an unset field (None) is a comment saying what applies instead."""
    lines = ["# difftx train --config FILE reads this; flags given beside it override it"]
    meta = {f.name: f.metadata for f in dataclasses.fields(TrainConfig)}
    settings = dict(settings)
    model = settings.pop("model", {}) or {}
    for name, value in settings.items():
        if value is None:
            instead = meta[name].get("default") or ("required" if name == "data" else "the default applies")
            lines.append(f"# {name} is unset ({instead}): {meta[name]['help']}")
        else:
            lines.append(f"{name} = {_value(value)}")
    lines += ["", "[model]  # ModelConfig overrides of the preset"]
    lines += [f"{name} = {_value(value)}" for name, value in model.items() if value is not None]
    return "\n".join(lines) + "\n"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):  # a basic string: JSON's escapes are TOML's, but DEL must be escaped too
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_value(v)}" for k, v in value.items()) + "}"
    raise InputError(f"cannot write {value!r} ({type(value).__name__}) as TOML")
