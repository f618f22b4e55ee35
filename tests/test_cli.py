"""The command line and the README's usage block."""

import re
import subprocess
import sys
from pathlib import Path

import torch

from difftransformer.cli import main
from difftransformer.demo import run_demo

ROOT = Path(__file__).resolve().parents[1]


def test_demo_shows_the_properties(capsys):
    result = run_demo(steps=10)
    out = capsys.readouterr().out
    assert "DIFF     : 4 differential heads, 1,345,728 parameters" in out
    assert "standard : 8 heads, 1,345,152 parameters" in out
    assert result["row_error"] < 1e-5
    assert result["negative_share"] > 0
    for name in ("diff", "standard"):
        assert result["loss"][name][1] < result["loss"][name][0] - 0.5


def test_presets_command(capsys):
    assert main(["presets"]) == 0
    assert "13,123,046,400" in capsys.readouterr().out


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "difftransformer", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "demo" in proc.stdout


def test_readme_starts_with_the_two_commands_and_its_usage_runs():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```")[1]
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == ["make demo", "make test"]
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["y"].shape == (2, 64, 1024) and scope["w"].shape == (2, 8, 64, 64)
    assert scope["logits"].shape == (2, 128, 256)
    assert abs(scope["attn"].lambda_init - 0.2) < 1e-12 and isinstance(scope["attn"].lambda_full(), torch.Tensor)
