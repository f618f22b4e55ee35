"""`make demo` installs a lean environment (#48 part 3): requirements-demo.txt, whose versions all come from
requirements-dev.txt, names none of the development tools, and the demo runs with none of them importable."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (transformers is in the demo's environment, for the README's `difftx convert`; the demo itself does not import it)
DEV_ONLY = ("triton", "lm-eval", "wandb", "tensorboard", "mkdocs", "pandas", "pyarrow", "scikit-learn")


def _names(path: Path) -> list[str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return [re.split(r"[=<>\[; ]", line)[0].lower() for line in lines if line and not line.startswith("-")]


def test_the_demo_requirements_are_lean_and_pinned_by_the_dev_ones():
    demo = (ROOT / "requirements-demo.txt").read_text()
    assert "-c requirements-dev.txt" in demo.splitlines()
    names, dev = _names(ROOT / "requirements-demo.txt"), _names(ROOT / "requirements-dev.txt")
    assert not set(names) & set(DEV_ONLY), "the demo's environment would install development tools"
    assert set(names) <= set(dev), f"unpinned in requirements-dev.txt: {set(names) - set(dev)}"
    makefile = (ROOT / "Makefile").read_text()
    assert "demo: $(DEMO_STAMP)" in makefile and "$(call install_venv,requirements-demo.txt)" in makefile


WATCHED = """
import sys
from difftransformer.apps.cli import main
code = main(["demo", "--icl-steps", "2", "--steps", "2", "--out", sys.argv[1], "--data", sys.argv[2], "--threads", "1"])
DEV = {"lm_eval", "wandb", "tensorboard", "mkdocs", "transformers", "pandas", "pyarrow", "sklearn", "yaml",
       "accelerate", "datasets", "hypothesis"}
print(sorted({name.split(".")[0] for name in sys.modules} & DEV))
sys.exit(code)
"""


@pytest.mark.slow
def test_the_demo_imports_no_development_tool(tmp_path):
    """A whole demo (both parts, 2 steps each) in a fresh interpreter imports none of what only requirements-dev.txt
    installs (but triton, which torch._dynamo imports by itself wherever it is installed; a demo in the lean
    environment, which has none, ran on 2026-12-05)."""
    done = subprocess.run([sys.executable, "-c", WATCHED, str(tmp_path / "demo"), str(tmp_path / "data")],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "[]", done.stdout.splitlines()[-1]
    assert (tmp_path / "demo" / "report.md").is_file() and (tmp_path / "demo" / "loss_curves.png").is_file()
    assert (tmp_path / "demo" / "icl" / "attention.png").is_file()  # both parts ran
