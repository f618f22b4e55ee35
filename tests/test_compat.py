"""Files written before the package's redesign still work: a run, its data and a Hugging Face export made by the
code of commit d6c92b6 (tests/fixtures/v0_1, written by tests/fixtures/make_v0_1.py) load, generate, resume and
convert with today's code, giving what that code computed from them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftransformer import generate, load_run

FIXTURE = Path(__file__).parent / "fixtures" / "v0_1"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


@pytest.fixture
def old(tmp_path):
    """A copy of the fixture (the run is moved: its saved data path no longer exists)."""
    shutil.copytree(FIXTURE, tmp_path / "v0_1")
    return tmp_path / "v0_1"


def old_logits() -> torch.Tensor:
    return load_file(FIXTURE / "expected.safetensors")["logits"]


def test_an_old_run_loads_and_gives_its_logits_and_generation(old):
    model, tokenizer = load_run(old / "run")
    with torch.no_grad():
        logits = model(torch.tensor([EXPECTED["tokens"]]))
    torch.testing.assert_close(logits, old_logits(), rtol=1e-5, atol=1e-5)
    assert generate(model, [EXPECTED["tokens"]], max_new_tokens=8, temperature=0.0)[0] == EXPECTED["greedy"]
    assert tokenizer.encode("the") == EXPECTED["tokens"][:3]


def test_an_old_run_resumes_with_moved_data_to_the_same_losses(old):
    from difftransformer.training.config import resume_config
    from difftransformer.training.loop import train

    train(resume_config(old / "run", max_steps=8, data=str(old / "tokens")), resume=True, quiet=True)
    rows = [json.loads(line) for line in (old / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert losses == pytest.approx(EXPECTED["resumed_losses"], rel=1e-5, abs=0)


def test_an_old_hugging_face_export_converts_back_to_the_same_logits(old, tmp_path):
    from difftransformer.interop.convert import hf_to_run

    hf_to_run(old / "hf", tmp_path / "back")
    model, _ = load_run(tmp_path / "back")
    with torch.no_grad():
        logits = model(torch.tensor([EXPECTED["tokens"]]))
    torch.testing.assert_close(logits, old_logits(), rtol=1e-5, atol=1e-5)


def test_an_old_run_exports_the_same_hugging_face_weights_as_before(old, tmp_path):
    from difftransformer.interop.convert import run_to_hf

    run_to_hf(old / "run", tmp_path / "hf")
    before, now = load_file(old / "hf" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert before.keys() == now.keys()
    assert all(torch.equal(before[name], now[name]) for name in before)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    expected = json.loads((old / "hf" / "config.json").read_text())
    # written by transformers itself, so by its version: its own version, and the dtype's key (torch_dtype before 5)
    for written in (config, expected):
        written.pop("transformers_version")
        written["dtype"] = written.pop("torch_dtype", written.get("dtype"))
    assert config == expected
