"""The API reference of the public names (``difftransformer.__all__``): each docstring is in the Google style that
the site renders as tables (mkdocs.yml), names every argument of its signature under Args, and has Examples that
run as doctests, so that the documented calls cannot rot."""

from __future__ import annotations

import dataclasses
import doctest
import inspect
import sys

import griffe
import pytest

import difftransformer

PUBLIC = [name for name in difftransformer.__all__ if name != "__version__"]


def _sections(obj) -> dict[str, object]:
    parsed = griffe.Docstring(inspect.getdoc(obj) or "", parser="google").parse()
    return {str(section.kind.value): section.value for section in parsed}


@pytest.mark.parametrize("name", PUBLIC)
def test_the_docstring_names_every_argument(name):
    obj = getattr(difftransformer, name)
    if dataclasses.is_dataclass(obj):  # a config: its fields are its arguments, described on the class and in --help
        return
    signature = inspect.signature(obj)
    wanted = [p for p in signature.parameters if p != "self"]
    documented = [p.name for p in _sections(obj).get("parameters", [])]
    assert documented == wanted, f"{name}: Args lists {documented}, the signature has {wanted}"


@pytest.mark.parametrize("name", PUBLIC)
def test_the_examples_run(name, tmp_path, monkeypatch):
    obj = getattr(difftransformer, name)
    assert "examples" in _sections(obj), f"{name} has no Examples section"
    monkeypatch.chdir(tmp_path)
    module = sys.modules[obj.__module__]
    finder, runner = doctest.DocTestFinder(recurse=False), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(obj, name, module=module, globs=vars(module).copy())
    assert tests and tests[0].examples, f"{name}: no doctest example found"
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
