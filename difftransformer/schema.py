"""Schemas of the files the project reads back, checked before any field is used: a file edited by hand, written by
another version or damaged is a one-line error that names the file, the field and what was expected, never a
traceback from deep inside the code that read it, and never a run that goes on from a misread state.

A schema is written with plain Python values:

- ``int``, ``float`` (an int is a float too; a bool is neither), ``str``, ``bool``: that type;
- ``ANY``: any JSON value;
- a string or an integer: that value (``("uint16", "uint32")``: one of the two);
- a tuple of schemas: any one of them (``(float, None)``: a number or null);
- a list of one schema: a JSON array of such items;
- a dict: a JSON object holding exactly these keys (a key ending in ``?`` may be left out; the key ``"*"`` gives
  the schema of any other key, which the object is otherwise refused for).
"""

from __future__ import annotations

import math
from typing import Any

from difftransformer.errors import InputError

ANY = object()
NUMBER = float  # a JSON number: an int or a float


def violation(value: Any, schema: Any, path: str = "") -> str | None:
    """What in ``value`` breaks ``schema`` ("field: must be ..., got ..."), or None when it holds."""
    if schema is ANY:
        return None
    if isinstance(schema, tuple):
        problems = [violation(value, option, path) for option in schema]
        if all(problems):
            return f"{path or 'the file'} must be {describe(schema)}, got {_short(value)}"
        return None
    if isinstance(schema, list):
        if not isinstance(value, list):
            return f"{path or 'the file'} must be {describe(schema)}, got {_short(value)}"
        for i, item in enumerate(value):
            if problem := violation(item, schema[0], f"{path}[{i}]"):
                return problem
        return None
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{path or 'the file'} must be an object, got {_short(value)}"
        for key, sub in schema.items():
            name = key.removesuffix("?")
            if key == "*":
                continue
            if name not in value:
                if not key.endswith("?"):
                    return f"{_join(path, name)} is missing"
                continue
            if problem := violation(value[name], sub, _join(path, name)):
                return problem
        known = {key.removesuffix("?") for key in schema}
        for name in value:
            if name in known:
                continue
            if "*" not in schema:
                return f"{_join(path, name)} is not a field of this file (written by another version, or edited)"
            if problem := violation(value[name], schema["*"], _join(path, name)):
                return problem
        return None
    if isinstance(schema, (str, int)) and not isinstance(schema, bool):
        ok = value == schema and type(value) is type(schema)
    elif schema is None:
        ok = value is None
    elif schema is bool:
        ok = isinstance(value, bool)
    elif schema is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif schema is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, schema)
    return None if ok else f"{path or 'the file'} must be {describe(schema)}, got {_short(value)}"


def check(value: Any, schema: Any, where: str, fix: str) -> Any:
    """``value`` when it holds to ``schema``; else an InputError: "``where`` is damaged: <field> must be ...;
    ``fix``"."""
    problem = violation(value, schema)
    if problem is not None:
        raise InputError(f"{where} is damaged: {problem}; {fix}")
    return value


def describe(schema: Any) -> str:
    if schema is ANY:
        return "any value"
    if isinstance(schema, tuple):
        return " or ".join(describe(option) for option in schema)
    if isinstance(schema, list):
        return f"a list of {describe(schema[0]).removeprefix('a ').removeprefix('an ')}s"
    if isinstance(schema, dict):
        return "an object"
    if isinstance(schema, (str, int)):
        return repr(schema)
    names = {None: "null", bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(schema, getattr(schema, "__name__", str(schema)))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _short(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    text = "an object" if isinstance(value, dict) else "a list" if isinstance(value, list) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
