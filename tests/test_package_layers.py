"""The package's layers: imports run one way, from the applications down to the core.

    foundation (errors, fsutil, progress) < core < training < inference < interop < apps

A module may import its own layer and the layers below it, never one above (function-local imports included).
The package's ``__init__`` re-exports the public API and ``__main__`` starts the CLI: they are not checked, and
importing the package itself counts as importing the highest layer that its ``__init__`` imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "difftransformer"
LAYERS = ["foundation", "core", "training", "inference", "interop", "apps"]
FOUNDATION = {"errors", "fsutil", "progress"}


def layer_of(module: str) -> str:
    """The layer of a dotted module name inside the package ('difftransformer.core.model' -> 'core')."""
    parts = module.split(".")
    assert parts[0] == "difftransformer", module
    if len(parts) == 1:
        return max((layer_of(name) for _, name in imported_modules(PACKAGE / "__init__.py")), key=LAYERS.index)
    if parts[1] in FOUNDATION:
        return "foundation"
    if parts[1] in LAYERS:
        return parts[1]
    raise AssertionError(f"{module} belongs to no layer; place it in one of {LAYERS}")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return [(line, name) for line, name in found if name == "difftransformer" or name.startswith("difftransformer.")]


MODULES = sorted(
    p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).as_posix() not in ("__init__.py", "__main__.py")
)


def test_every_module_is_in_a_layer():
    for path in MODULES:
        layer_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_imports_run_one_way(path):
    own = layer_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
    upward = [
        f"line {line}: {name} ({layer_of(name)})"
        for line, name in imported_modules(path)
        if LAYERS.index(layer_of(name)) > LAYERS.index(own)
    ]
    assert not upward, f"{path.name} is in layer {own!r} and imports from above it: {upward}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check can fail: an import from a higher layer, written as a relative import, is found."""
    fake = PACKAGE / "core" / "attention" / "kernels.py"
    tree = imported_modules(fake)
    assert all(layer_of(name) in ("foundation", "core") for _, name in tree)
    probe = tmp_path / "difftransformer" / "core" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("def f():\n    from ..apps import cli\n    import difftransformer.training.loop\n")
    names = [name for _, name in _imports_relative_to(probe, tmp_path / "difftransformer")]
    assert names == ["difftransformer.apps", "difftransformer.training.loop"]
    assert [layer_of(n) for n in names] == ["apps", "training"]


def _imports_relative_to(path: Path, package: Path) -> list[tuple[int, str]]:
    global PACKAGE
    saved, PACKAGE = PACKAGE, package
    try:
        return imported_modules(path)
    finally:
        PACKAGE = saved
