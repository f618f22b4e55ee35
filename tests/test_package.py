"""The package as a user installs it: an sdist and a wheel built from this checkout, installed into a fresh virtual
environment with only the required dependencies, give a working `difftx`; a command that needs an optional extra
names the extra to install."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd, cwd=None, check=True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=600)
    if check:
        assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_sdist_and_wheel_install_into_a_fresh_environment_with_a_working_difftx(tmp_path):
    dist = tmp_path / "dist"
    # sdist first, then the wheel built from the unpacked sdist: a file missing from the sdist fails here
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, ROOT)
    (sdist,) = dist.glob("difftransformer-*.tar.gz")
    (wheel,) = dist.glob("difftransformer-*-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "difftransformer/core/attention/csrc/diff_block.cpp" in names  # the CPU kernel's source ships
    assert "difftransformer/apps/cli/train.py" in names and "difftransformer/store/runs.py" in names
    assert not any(n.startswith("tests/") for n in names)
    assert f"difftransformer-{_version()}.dist-info/licenses/LICENSE" in names  # the MIT text ships with the wheel
    assert any(n.endswith("/csrc/diff_block.cpp") for n in tarfile.open(sdist).getnames())

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    python, difftx = venv / "bin" / "python", venv / "bin" / "difftx"
    # required dependencies only, at the versions this checkout pins (the CPU build of torch)
    _run(python, "-m", "pip", "install", "--quiet", "-c", ROOT / "requirements-dev.txt", wheel)
    where = _run(python, "-c", "import difftransformer; print(difftransformer.__file__)", cwd=tmp_path).stdout
    assert where.startswith(str(venv)), where  # the installed copy, not this checkout
    assert _run(difftx, "--version", cwd=tmp_path).stdout.strip() == f"difftransformer {_version()}"
    assert "tiny" in _run(difftx, "presets", cwd=tmp_path).stdout

    work = tmp_path / "work"
    work.mkdir()
    (work / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    _run(difftx, "data", "prepare", "--input", "a.txt", "--out", "data", cwd=work)
    flags = ["--max-steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-interval", "2", "--warmup-steps", "1"]
    trained = _run(difftx, "train", "--data", "data", "--out", "run", *flags, cwd=work)
    assert "next: difftx generate --run run" in trained.stdout
    assert _run(difftx, "generate", "--run", "run", "--prompt", "the", "--max-new-tokens", "5", cwd=work).stdout

    # transformers is an extra: the command that needs it says which one, in one line, without a traceback
    for cmd, extra in (
        (["convert", "--run", "run", "--out", "hf"], "hf"),
        (["eval", "--run", "run", "--jsonl", "x"], "eval"),
    ):
        done = _run(difftx, *cmd, cwd=work, check=False)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip() == (
            f"difftx {cmd[0]}: error: this needs transformers, an optional dependency: pip install "
            f"'difftransformer[{extra}]'"
        )
    assert not (work / "hf").exists()

    # the sdist installs too (built here, without the network: the environment's setuptools)
    _run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall", "--no-build-isolation", sdist)
    assert _run(difftx, "--version", cwd=tmp_path).stdout.strip() == f"difftransformer {_version()}"


def _version() -> str:
    from difftransformer import __version__

    return __version__


def test_citation_file_is_the_software_and_the_paper_as_the_package_and_the_model_card_cite_them():
    """CITATION.cff (read by GitHub and Zenodo) carries the fields CFF 1.2.0 requires, this package's version and
    licence, and the paper's authors, title and year as the model card's BibTeX gives them: a version bump or an
    edited author list that misses one of the two fails here."""
    import re

    from conftest import optional

    from difftransformer.interop.model_card import CITATION
    from difftransformer.training.config_file import tomllib

    yaml = optional("yaml")

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert cff["cff-version"] == "1.2.0" and cff["message"] and cff["title"] and cff["authors"]
    assert (cff["version"], cff["license"]) == (project["version"], project["license"]) == (_version(), "MIT")
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")
    paper = cff["preferred-citation"]
    authors = re.search(r"author\s*=\s*\{(.*)\}", CITATION).group(1).split(" and ")
    assert [f"{a['family-names']}, {a['given-names']}" for a in paper["authors"]] == authors
    assert f"title     = {{{paper['title']}}}" in CITATION and f"year      = {{{paper['year']}}}" in CITATION
    assert "arXiv:2410.05258" in [i["value"] for i in paper["identifiers"]] and "2410.05258" in CITATION
