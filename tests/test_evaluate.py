"""lm-eval (HFLM) on a local JSONL task, against our own bits per byte on the same texts."""

import json

from conftest import SMALL, small_config

from difftransformer import load_run
from difftransformer.cli import main
from difftransformer.evaluate import bits_per_byte, read_texts
from difftransformer.train import train


def test_lm_eval_perplexity_matches_our_bits_per_byte(prepared, tmp_path, capsys):
    train(
        small_config(prepared, tmp_path / "run", max_steps=20, lr=3e-3, model={**SMALL, "max_seq_len": 64}), quiet=True
    )
    texts = ["Return the value of the named attribute.", "The attention noise cancels " * 5, "naïve café, ok."]
    jsonl = tmp_path / "task.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert main(["eval", "--run", str(tmp_path / "run"), "--jsonl", str(jsonl)]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{") :])
    model, tok = load_run(tmp_path / "run")
    ours = bits_per_byte(model, tok, read_texts(jsonl))
    assert abs(result["lm_eval"]["bits_per_byte"] - ours) < 1e-4
    assert result["ours"]["bits_per_byte"] == ours
    assert 1.0 < result["lm_eval"]["byte_perplexity"] < 257
