"""The API reference: every name its pages show (the ``:::`` entries of docs/reference/*.md) and every top-level
name (``difftransformer.__all__``) has a Google-style docstring, which the site renders as tables (mkdocs.yml),
that names every argument of its signature under Args and has Examples that run as doctests, so that the
documented calls cannot rot."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import inspect
import os
import sys
from pathlib import Path

import pytest

if os.environ.get("DIFFTX_REQUIRE_OPTIONAL") == "1":  # the pinned environment has the docs' parser
    import griffe
else:  # the floor environment has no docs tooling
    griffe = pytest.importorskip("griffe", reason="needs griffe, the docs' docstring parser (requirements-dev.txt)")

import difftransformer

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs" / "reference").glob("*.md"))
SHOWN = [line.split()[1] for page in PAGES for line in page.read_text().splitlines() if line.startswith("::: ")]
PUBLIC = sorted({f"difftransformer.{name}" for name in difftransformer.__all__ if name != "__version__"} | set(SHOWN))


def _object(name: str):
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def test_the_reference_pages_show_the_top_level_names():
    shown = {_object(name) for name in SHOWN}
    missing = [n for n in difftransformer.__all__ if n != "__version__" and getattr(difftransformer, n) not in shown]
    assert len(SHOWN) >= 40 and not missing, missing


def _sections(obj) -> dict[str, object]:
    parsed = griffe.Docstring(inspect.getdoc(obj) or "", parser="google").parse()
    return {str(section.kind.value): section.value for section in parsed}


@pytest.mark.parametrize("name", PUBLIC)
def test_the_docstring_names_every_argument(name):
    obj = _object(name)
    if dataclasses.is_dataclass(obj) or (inspect.isclass(obj) and issubclass(obj, Exception)):
        return  # a config's fields are its arguments, described on the class and in --help; a warning has none
    signature = inspect.signature(obj)
    wanted = [p for p in signature.parameters if p != "self"]
    documented = [p.name for p in _sections(obj).get("parameters", [])]
    assert documented == wanted, f"{name}: Args lists {documented}, the signature has {wanted}"


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n.endswith("lm_eval_perplexity") else n for n in PUBLIC]
)  # lm-eval's example evaluates a model through it: 10 s
def test_the_examples_run(name, tmp_path, monkeypatch):
    obj = _object(name)
    assert "examples" in _sections(obj), f"{name} has no Examples section"
    monkeypatch.chdir(tmp_path)
    module = sys.modules[obj.__module__]
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(obj, name, module=module, globs=vars(module).copy())
    assert tests and tests[0].examples, f"{name}: no doctest example found"
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
