"""The model card of `difftx convert --to hf`: Hub front matter, and the run's numbers, each checked against what the
export and the run hold (the exported tensors, metrics.jsonl), not against the card's own code."""

import json
import math
import re

import pytest
from conftest import LAMBDA_INIT, metric_rows, optional, small_config

from difftransformer.apps.cli import main
from difftransformer.training.loop import train

pytestmark = pytest.mark.slow
transformers = optional("transformers")
yaml = optional("yaml")


def front_matter(card: str) -> tuple[dict, str]:
    assert card.startswith("---\n")
    head, body = card[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


def exported_tensors(hf_dir) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.fixture(scope="module")
def trained(module_data, tmp_path_factory):
    """A trained run, which the tests only read."""
    run = tmp_path_factory.mktemp("model-card") / "run"
    train(small_config(module_data[1], run, max_steps=12, eval_interval=5, ckpt_interval=4, lr=1e-2), quiet=True)
    return run


def test_the_card_has_hub_front_matter_and_the_run_s_numbers(trained, tmp_path):
    hf = tmp_path / "my-diff-model"
    flags = ["--license", "mit", "--dataset", "org/corpus"]
    assert main(["convert", "--run", str(trained), "--to", "hf", "--out", str(hf), *flags]) == 0
    card = (hf / "README.md").read_text()
    meta, body = front_matter(card)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["license"] == "mit" and meta["datasets"] == ["org/corpus"]
    assert {"difftransformer", "differential-transformer", "diff_llama"} <= set(meta["tags"])
    assert str(tmp_path) not in card and str(trained.parent) not in card  # no machine path

    tensors = exported_tensors(hf)
    assert f"| parameters | {sum(t.numel() for t in tensors.values()):,} (" in body
    assert "| heads | 2 differential heads (half of a matched standard model's 4)" in body
    validation = [r for r in metric_rows(trained) if "val_loss" in r][-1]  # step 12, the last checkpoint
    assert validation["step"] == 12
    assert f"final validation (step 12): loss {validation['val_loss']:.4f} nats per token" in body
    assert f"{validation['val_bpb']:.4f} bits per byte" in body
    assert "- steps: 12, 1,536 training tokens (batch 4 x 32 tokens)" in body
    assert "- data: `data`" in body and "peak learning rate 0.01" in body
    for layer in range(2):  # lambda from the exported lambda vectors, lambda_init from the paper's schedule
        p = {n: tensors[f"model.layers.{layer}.self_attn.lambda_{n}"].double() for n in ("q1", "k1", "q2", "k2")}
        lam = math.exp((p["q1"] * p["k1"]).sum()) - math.exp((p["q2"] * p["k2"]).sum()) + LAMBDA_INIT[layer]
        assert f"| {layer} | {LAMBDA_INIT[layer]:.4f} | {lam:.4f} |" in body
    assert 'AutoModelForCausalLM.from_pretrained("my-diff-model")' in body
    assert "arXiv 2410.05258" in body and "@inproceedings{ye2025differential" in body


def test_a_checkpoint_s_card_states_that_checkpoint(trained, tmp_path):
    hf = tmp_path / "hf"
    checkpoint = trained / "checkpoints" / "step_00000008"
    assert main(["convert", "--run", str(checkpoint), "--to", "hf", "--out", str(hf)]) == 0
    meta, body = front_matter((hf / "README.md").read_text())
    assert "license" not in meta and "datasets" not in meta  # not known: not guessed
    validation = [r for r in metric_rows(trained) if r.get("step") == 5][0]
    assert "- steps: 8, 1,024 training tokens" in body
    assert f"final validation (step 5): loss {validation['val_loss']:.4f}" in body


def test_a_run_without_a_training_record_says_so(prepared, tmp_path):
    run = tmp_path / "run"
    train(small_config(prepared, run, attention="standard", max_steps=2, ckpt_interval=2), quiet=True)
    assert main(["convert", "--run", str(run), "--to", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    assert main(["convert", "--run", str(tmp_path / "back"), "--to", "hf", "--out", str(tmp_path / "again")]) == 0
    meta, body = front_matter((tmp_path / "again" / "README.md").read_text())
    assert "llama" in meta["tags"] and "| heads | 4 of size 16 |" in body
    assert "Not recorded: this run has no train_config.json" in body
    assert "lambda_init" not in body  # a standard model has no lambda
    assert re.search(r"\| parameters \| [\d,]+ \(", body)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
