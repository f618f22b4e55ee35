"""The documentation: every block of the README and of each tutorial runs as written (so that they cannot rot), the
command-line page names every command, and the README tells a new user where `difftx` is."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.M | re.S)


def test_the_four_tutorials_exist_and_have_code():
    names = {p.stem for p in TUTORIALS}
    assert names == {"add-to-your-model", "train-on-your-text", "convert-your-llama", "reproduce-the-claims"}
    for page in TUTORIALS:
        kinds = [kind for kind, _ in BLOCK.findall(page.read_text())]
        assert len(kinds) >= 3, f"{page.name} has {len(kinds)} runnable blocks"


# What `make test` adds to the demo's environment (requirements-dev.txt beyond requirements-demo.txt), by module
DEV_ONLY_MODULES = ("triton", "lm_eval", "wandb", "tensorboard", "mkdocs", "pandas", "pyarrow", "sklearn",
                    "hypothesis", "accelerate", "datasets", "pytest", "pyte")  # fmt: skip
# a sitecustomize under which they are not found, as in the demo's environment (for an import, and for a library's
# probe with importlib.util.find_spec, as transformers probes accelerate)
DEMO_ENV = f"""import sys
from importlib.machinery import PathFinder
class _DemoEnvironment(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in {DEV_ONLY_MODULES!r}:
            return None
        return PathFinder.find_spec(name, path, target)
sys.meta_path[:] = [_DemoEnvironment if finder is PathFinder else finder for finder in sys.meta_path]
"""


def run_blocks(text: str, name: str, demo_env: Path | None = None) -> dict:
    """Each python and bash block of ``text``, in order, in the working directory: python blocks share one
    namespace (as in one session), which is returned; bash blocks run with this environment's difftx first on PATH
    and, with ``demo_env`` (a folder for its sitecustomize), unable to import what only `make test` installs."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if demo_env is not None:
        demo_env.mkdir(parents=True, exist_ok=True)
        (demo_env / "sitecustomize.py").write_text(DEMO_ENV)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(demo_env), env.get("PYTHONPATH", "")]))
    namespace: dict = {"__name__": "__docs__"}
    for i, (kind, code) in enumerate(BLOCK.findall(text)):
        where = f"{name}, block {i + 1} ({kind})"
        if kind == "python":
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the page's own code
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{where} failed:\n{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return namespace


@pytest.mark.slow
@pytest.mark.parametrize("page", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_runs_as_written(page, tmp_path, monkeypatch):
    """Every python and bash block of the page, in order, in an empty directory; the bash blocks in the demo's
    environment (#56: what a reader has after `make demo`), whose python blocks import only what it installs
    (test_the_tutorials_python_imports_what_the_demo_installs)."""
    monkeypatch.chdir(tmp_path)
    run_blocks(page.read_text(), page.name, demo_env=tmp_path / "demo-env")


def test_the_tutorials_python_imports_what_the_demo_installs():
    """The python blocks run in this process, not under the demo environment's stand-in: their imports are checked
    here instead, against what requirements-demo.txt installs and Python's own library."""
    demo = {"torch", "difftransformer", "transformers"}
    for page in TUTORIALS:
        imported = python_imports(page.read_text())
        assert imported <= demo | sys.stdlib_module_names, (page.name, imported - demo - sys.stdlib_module_names)


def python_imports(text: str) -> set[str]:
    """The top-level packages that the python blocks of ``text`` import (at any indentation)."""
    code = "\n".join(c for kind, c in BLOCK.findall(text) if kind == "python")
    return {m.split(".")[0] for m in re.findall(r"^\s*(?:from|import) ([\w.]+)", code, re.M)}


# The README's blocks that no test runs: the set-up (`make test` is this suite; `make demo` is run_demo's test at
# a toy size, tests/test_cli.py) and the install into your own environment (a download). Every other block is
# fenced as bash or python and runs in test_the_readme_runs_as_written.
SET_UP = [
    ["make demo", "make test"],
    ["pip install torch --index-url https://download.pytorch.org/whl/cpu", 'pip install ".[hf,plot]"'],
]
ANY_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def test_the_readme_starts_with_the_two_commands_and_runs_every_other_block():
    blocks = ANY_BLOCK.findall((ROOT / "README.md").read_text())
    commands = [[line.split("#")[0].strip() for line in code.strip().splitlines()] for _, code in blocks]
    assert blocks[0][0] == "" and commands[0] == SET_UP[0]  # the README starts with them
    assert [c for (kind, _), c in zip(blocks, commands, strict=True) if kind == ""] == SET_UP
    assert {kind for kind, _ in blocks} == {"", "bash", "python"}
    assert len(BLOCK.findall((ROOT / "README.md").read_text())) == len(blocks) - len(SET_UP)


@pytest.mark.slow
def test_the_readme_runs_as_written(tmp_path, monkeypatch):
    """The module example's shapes and lambda, then the command-line example: it trains, samples and exports, in the
    demo's environment (#56: the export failed there, transformers missing; its python blocks import only torch and
    difftransformer, which test_the_readmes_python_imports_what_the_demo_installs checks)."""
    import torch

    monkeypatch.chdir(tmp_path)
    scope = run_blocks((ROOT / "README.md").read_text(), "README.md", demo_env=tmp_path / "demo-env")
    assert scope["y"].shape == (2, 64, 1024) and scope["w"].shape == (2, 8, 64, 64)
    assert scope["logits"].shape == (2, 128, 256)
    assert abs(scope["attn"].lambda_init - 0.2) < 1e-12 and isinstance(scope["attn"].lambda_full(), torch.Tensor)
    assert (tmp_path / "runs" / "diff-tiny" / "checkpoints" / "step_00000020" / "model.safetensors").is_file()
    assert (tmp_path / "hf" / "diff-tiny" / "README.md").read_text().startswith("---\n")


def test_the_readmes_python_imports_what_the_demo_installs():
    imported = python_imports((ROOT / "README.md").read_text())
    assert imported == {"torch", "difftransformer"}, imported


def test_the_demo_environment_stand_in_blocks_what_only_make_test_installs(tmp_path):
    """The stand-in the README's test runs under: a development tool fails to import, the library and its export
    dependencies import (a check that it blocks something and not everything)."""
    # matplotlib where this environment has it (the floor's has no extras); pytest is here wherever tests run, so its
    # failure to import is the stand-in's doing
    needed = ["transformers", "difftransformer"] + (["matplotlib"] if importlib.util.find_spec("matplotlib") else [])
    run_blocks(f"```bash\npython -c 'import {', '.join(needed)}'\n```\n", "x", tmp_path / "e")
    with pytest.raises(AssertionError, match="No module named 'pytest'"):
        run_blocks("```bash\npython -c 'import pytest'\n```\n", "x", tmp_path / "e")


def test_cli_page_names_every_command():
    from difftransformer.apps.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    page = (ROOT / "docs" / "cli.md").read_text()
    missing = [name for name in commands if f"`difftx {name}" not in page]
    assert not missing, f"docs/cli.md lacks {missing}"


def test_readme_says_where_difftx_is():
    readme = (ROOT / "README.md").read_text()
    assert "source .venv/bin/activate" in readme and "make shell" in readme
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndocs:" in makefile


@pytest.mark.slow
def test_make_shell_puts_difftx_on_path():
    env = {**os.environ, "SHELL": "/bin/bash", "MAKEFLAGS": ""}
    done = subprocess.run(
        ["make", "-s", "shell"], input="command -v difftx\n", cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(ROOT / ".venv" / "bin" / "difftx")


@pytest.mark.slow
def test_the_site_builds_and_a_broken_link_fails_the_build(tmp_path):
    """What make docs runs, on this checkout and on a copy with one broken link (warnings are errors)."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    cmd = [mkdocs, "build", "--strict", "--site-dir"]
    built = subprocess.run([*cmd, tmp_path / "site"], cwd=ROOT, capture_output=True)
    assert built.returncode == 0, built.stderr.decode()[-2000:]
    assert (tmp_path / "site" / "tutorials" / "convert-your-llama.html").is_file()  # a file per page: opens from disk
    copy = tmp_path / "copy"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy)
    (copy / "difftransformer").symlink_to(ROOT / "difftransformer")  # the API reference reads the package
    page = copy / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [a page that is not there](missing.md).\n")
    broken = subprocess.run([*cmd, tmp_path / "s2"], cwd=copy, capture_output=True)
    assert broken.returncode != 0 and b"missing.md" in broken.stderr


def test_gitignore_covers_every_output_the_documented_commands_write():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an unpacked sdist): nothing to ignore")
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    written = {path for page in pages for path in re.findall(r"--(?:out|json) ([^\s`,]+)", page.read_text())}
    written |= {"runs/demo/report.md", "data/pydocs/manifest.json", "runs/diff-tiny/metrics.jsonl"}  # defaults
    written |= {"site/index.html", "dist/difftransformer-0.1.0.tar.gz", ".venv/bin/difftx"}  # make docs, build
    assert len(written) > 20
    # a directory's pattern (reports/) matches a path only as a directory: name a file inside the ones without suffix
    paths = sorted(p if Path(p).suffix else p.rstrip("/") + "/file" for p in written)
    done = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert sorted(done.stdout.split()) == paths, f"not ignored: {sorted(set(paths) - set(done.stdout.split()))}"


DEMO_RUN = ROOT / "benchmarks" / "results" / "demo_cpu-xeon-2core_2026-12-07"


def _stamp(log: str, text: str) -> float:
    """The seconds stamped on the first line of ``log`` that holds ``text``."""
    return float(re.search(r"^\[\s*([\d.]+)\] .*" + re.escape(text), log, re.M).group(1))


def test_the_readmes_demo_numbers_and_times_are_its_committed_run():
    """#56: the README's account of `make demo` quotes one committed run (its part 1 results and its stamped output),
    so that the numbers cannot drift from what was measured."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    runs = json.loads((DEMO_RUN / "icl-results.json").read_text())["runs"]
    log = (DEMO_RUN / "make-demo.log").read_text()
    d, s = runs["diff"], runs["standard"]
    quoted = [
        f"DIFF answered {d['accuracy']:.2f} of new 4-class prompts and the standard model {s['accuracy']:.2f}",
        f"DIFF's attention put {d['shares']['answer']:+.2f} on the pairs that hold the answer and "
        f"{d['shares']['noise']:+.2f} on the others",
        f"model put {s['shares']['answer']:+.2f} on the answer and {s['shares']['noise']:+.2f} on the rest",
        f"{_stamp(log, '.venv/bin/difftx demo'):.0f} s to create `.venv`",
        f"{_stamp(log, 'figure: ') - _stamp(log, 'part 1 of 2'):.0f} s for part 1",
    ]
    part2 = round(_stamp(log, "report: ") - _stamp(log, "part 2 of 2"))
    quoted.append(f"{part2 // 60}m{part2 % 60:02d}s for part 2")
    losses = re.search(r"nats per token: DIFF ([\d.]+), DIFF matched ([\d.]+), standard ([\d.]+)", log).groups()
    diff, matched, standard = (f"{float(x):.3f}" for x in losses)
    quoted.append(f"{diff} nats per token against the standard model's {standard} (lower is better), {matched} with")
    missing = [q for q in quoted if q not in readme]
    assert not missing, missing
