"""The package's layers: imports run one way, from the applications down to the core.

    foundation (devices, errors, fsutil, progress, threads) < core < store < training < inference < interop < apps

A module may import its own layer and the layers below it, never one above (function-local imports included).
The package's ``__init__`` re-exports the public API and ``__main__`` starts the CLI: they are not checked, and
importing the package itself counts as importing the highest layer that its ``__init__`` imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "difftransformer"
LAYERS = ["foundation", "core", "store", "training", "inference", "interop", "apps"]
FOUNDATION = {"devices", "errors", "fsutil", "paths", "progress", "schema", "threads"}


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


def import_statements(path: Path, package: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names imported from it) of every import in ``path``, function-local ones included,
    relative imports resolved against the module's package; ``package`` is the package's directory."""
    module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
    own = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = own.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name, [alias.name for alias in node.names]))
    top = package.name
    return [(line, name, names) for line, name, names in found if name == top or name.startswith(top + ".")]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    return [(line, name) for line, name, _ in import_statements(path, PACKAGE)]


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


def module_edges(path: Path, package: Path) -> set[str]:
    """The package's modules that ``path`` imports, with ``from pkg import sub`` resolved to the submodule
    ``pkg.sub`` where ``sub`` is one (an import of a name from a module stays that module)."""
    module = ".".join(path.relative_to(package.parent).with_suffix("").parts)

    def exists(name: str) -> bool:
        rel = package.parent / Path(*name.split("."))
        return rel.with_suffix(".py").is_file() or (rel / "__init__.py").is_file()

    found = set()
    for _, name, names in import_statements(path, package):
        found |= {f"{name}.{n}" for n in names if exists(f"{name}.{n}")} or {name}
    return found - {module}


def import_cycles(package: Path) -> list[list[str]]:
    """Cycles of imports between the package's modules, as lists of modules, each found once by a depth-first
    search: none exactly when the imports have no cycle (a graph with cycles may have more than are listed). Package
    ``__init__`` files are left out: importing a submodule runs its package first, an edge no module chose."""
    modules = {
        ".".join(p.relative_to(package.parent).with_suffix("").parts): p
        for p in package.rglob("*.py")
        if p.name != "__init__.py"
    }
    graph = {m: sorted(e for e in module_edges(p, package) if e in modules) for m, p in modules.items()}
    cycles, seen = [], set()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    cycles.append(cycle + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_no_import_cycle_between_modules():
    cycles = import_cycles(PACKAGE)
    assert not cycles, "import cycles (split a module's shared part into one both can import):\n" + "\n".join(
        " -> ".join(c) for c in cycles
    )


def test_the_cycle_check_finds_a_cycle_through_a_local_import(tmp_path):
    pkg = tmp_path / "difftransformer"
    (pkg / "apps").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "apps" / "__init__.py"):
        init.write_text("")
    (pkg / "apps" / "a.py").write_text("from difftransformer.apps import b\n")
    (pkg / "apps" / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "apps" / "c.py").write_text("from difftransformer.apps.a import thing\n")
    (pkg / "apps" / "d.py").write_text("from difftransformer.apps import a, b\n")  # imports both, no cycle
    assert import_cycles(pkg) == [["difftransformer.apps.a", "difftransformer.apps.b", "difftransformer.apps.c",
                                   "difftransformer.apps.a"]]  # fmt: skip


TRAINING_STACK = (
    "difftransformer.training.loop",
    "difftransformer.training.distributed",
    "difftransformer.training.step",
    "difftransformer.training.tracking",
    "torch.utils.tensorboard",
)


STATEMENTS = [
    "import difftransformer",
    "from difftransformer.inference import generate",
    "from difftransformer import generate, load_run\nimport difftransformer.interop.convert",
    "from difftransformer.store import load_run\nload_run",
]
# One process for every statement: torch, which each of them imports, is imported once; each statement then runs in
# a child forked from it, whose modules are the parent's (torch and the standard library) and what it imports.
FORKED = """
import json, os, sys
import torch
out = {}
for statement in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            exec(statement, {})
            os.write(write, "\\n".join(sys.modules).encode())
        finally:
            os._exit(0 if sys.exc_info()[0] is None else 1)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        names = f.read().decode().split()
    assert os.waitpid(pid, 0)[1] == 0, statement
    out[statement] = names
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def imported() -> dict[str, set[str]]:
    """The modules an interpreter holds after running each statement (and ``import difftransformer.training.loop``,
    which the check must see)."""
    import json
    import subprocess
    import sys

    statements = [*STATEMENTS, "import difftransformer.training.loop"]
    proc = subprocess.run(
        [sys.executable, "-c", FORKED, json.dumps(statements)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {statement: set(names) for statement, names in json.loads(proc.stdout).items()}


@pytest.mark.slow  # one interpreter with torch, forked for each statement: about 9 s
@pytest.mark.parametrize("statement", STATEMENTS)
def test_loading_and_sampling_do_not_import_the_training_stack(statement, imported):
    loaded = imported[statement]
    assert "difftransformer" in loaded
    assert not loaded & set(TRAINING_STACK), sorted(loaded & set(TRAINING_STACK))


@pytest.mark.slow
def test_the_import_check_sees_the_training_stack(imported):
    assert "difftransformer.training.loop" in imported["import difftransformer.training.loop"]
    assert "torch.utils.tensorboard" not in imported["import difftransformer"]  # not in what the parent imported


def test_every_top_level_name_is_its_home_modules_object():
    """``difftransformer.X`` for each name of ``__all__`` is the object its own module defines (the lazy table
    names a module that holds it), and a name outside the table is an AttributeError naming it."""
    import importlib

    import difftransformer

    homes = {
        "ModelConfig": "core.config",
        "MultiheadAttention": "core.attention.standard",
        "MultiheadDiffAttn": "core.attention.diff",
        "MultiheadDiffAttnV2": "core.attention.diff_v2",
        "TrainConfig": "training.config",
        "TransformerLM": "core.model",
        "count_parameters": "core.model",
        "generate": "inference.generate",
        "load_run": "store.runs",
        "train": "training.loop",
    }
    assert sorted(difftransformer.__all__) == sorted([*homes, "__version__"])
    for name, home in homes.items():
        assert getattr(difftransformer, name) is getattr(importlib.import_module(f"difftransformer.{home}"), name)
    with pytest.raises(AttributeError, match="'difftransformer' has no attribute 'Trainer'"):
        difftransformer.Trainer  # noqa: B018
