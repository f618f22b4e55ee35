"""lm-eval (HFLM) on a local JSONL task, against our own bits per byte on the same texts."""

import json

import pytest
from conftest import SMALL, optional, small_config

from difftransformer import load_run
from difftransformer.apps.cli import main
from difftransformer.inference.evaluate import read_texts
from difftransformer.training.evaluate import text_bits_per_byte
from difftransformer.training.loop import train


@pytest.mark.slow
def test_lm_eval_perplexity_matches_our_bits_per_byte(prepared, tmp_path, capsys):
    optional("lm_eval")
    train(
        small_config(prepared, tmp_path / "run", max_steps=20, lr=3e-3, model={**SMALL, "max_seq_len": 64}), quiet=True
    )
    texts = [
        "Return the value of the named attribute.",
        "The attention noise cancels " * 5,
        "naïve café, ok.",
        "a literal <|endoftext|> inside a text is text, for both",  # lm-eval read it as the end token (issue #28)
    ]
    jsonl = tmp_path / "task.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert main(["eval", "--run", str(tmp_path / "run"), "--jsonl", str(jsonl)]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{") :])
    model, tok = load_run(tmp_path / "run")
    ours = text_bits_per_byte(model, tok, read_texts(jsonl))
    assert abs(result["lm_eval"]["bits_per_byte"] - ours) < 1e-4
    assert result["ours"]["bits_per_byte"] == ours
    assert 1.0 < result["lm_eval"]["byte_perplexity"] < 257


@pytest.mark.slow
def test_eval_with_quantized_logits_reports_both(prepared, tmp_path, capsys):
    train(small_config(prepared, tmp_path / "run", max_steps=20, lr=3e-3), quiet=True)
    jsonl = tmp_path / "task.jsonl"
    jsonl.write_text(json.dumps({"text": "The attention noise cancels " * 4}) + "\n")
    results = {}
    for bits in ("16", "2"):
        assert main(["eval", "--run", str(tmp_path / "run"), "--jsonl", str(jsonl), "--logit-bits", bits]) == 0
        out = capsys.readouterr().out
        results[bits] = json.loads(out[out.index("{") :])
    full = results["16"]["ours"]["bits_per_byte"]
    assert results["2"]["ours"]["bits_per_byte"] == full  # the float measure is not touched by the option
    at16 = abs(results["16"]["ours_quantized_logits"]["bits_per_byte"] - full)
    at2 = abs(results["2"]["ours_quantized_logits"]["bits_per_byte"] - full)
    assert at16 < 1e-5 and at2 > 1e-4 and at2 > 10 * at16  # 20 steps leave the maps nearly flat: a small effect
    assert results["2"]["ours_quantized_logits"]["logit_bits"] == 2
    assert results["2"]["lm_eval"].startswith("skipped")
