"""Smoke test of the benchmark command: it runs, reports its setting, and its JSON matches its table."""

import json

import pytest

from difftransformer.apps.cli import main


@pytest.mark.slow
def test_bench_attention_smoke(tmp_path, capsys):
    out = tmp_path / "attn.json"
    assert (
        main(
            [
                "bench",
                "attention",
                "--seq",
                "32",
                "64",
                "--dim",
                "64",
                "--heads",
                "4",
                "--repeats",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "1 thread(s), float32" in text and "DIFF 2 heads vs standard 4 heads of size 16" in text
    result = json.loads(out.read_text())
    directions = ["forward", "forward+backward", "core forward+backward"]
    assert [(r["seq"], r["direction"]) for r in result["rows"]] == [(t, d) for t in (32, 64) for d in directions]
    for row in result["rows"]:
        expected = {"standard", "sdpa", "block", "plain"}
        if not row["direction"].startswith("core"):  # the core rows time our kernels alone: no HF columns
            expected |= {"hf-sdpa", "hf-eager"}
        assert set(row["seconds"]) == expected
        assert all(v > 0 for v in row["seconds"].values())


def test_bench_decode_smoke(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert (
        main(
            [
                "bench",
                "decode",
                "--context",
                "16",
                "32",
                "--preset",
                "tiny",
                "--tokens",
                "2",
                "--repeats",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert "| 16 |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["context"] for r in rows] == [16, 32] and all(r["tokens_per_s"]["diff"] > 0 for r in rows)


def test_saved_activation_bytes_counts_what_backward_keeps():
    import torch

    from difftransformer.apps.bench import saved_activation_bytes

    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)
    # x @ w saves x (4 x 8 float32 = 128 bytes) and w (a parameter: not counted); relu saves its output (another 128)
    assert saved_activation_bytes(lambda: torch.relu(x @ w).sum()) == 2 * 4 * 8 * 4
    # a linear layer saves weight.t(), a view of the parameter: not counted either (only its input x)
    linear = torch.nn.Linear(8, 8, bias=False)
    assert saved_activation_bytes(lambda: linear(x.requires_grad_()).sum()) == 4 * 8 * 4


@pytest.mark.slow
def test_bench_train_smoke(tmp_path, capsys):
    out = tmp_path / "train.json"
    assert (
        main(
            ["bench", "train", "--preset", "tiny", "--seq", "32", "--batch", "2", "--repeats", "1", "--json", str(out)]
        )
        == 0
    )
    assert "HF DiffLlama ms" in capsys.readouterr().out
    row = json.loads(out.read_text())["rows"][0]
    assert set(row["seconds"]) == {"diff", "standard", "hf-diffllama"}
    assert all(v > 0 for v in row["activation_bytes"].values())


def test_bench_decode_counts_every_rows_token_at_batch_8(tmp_path, capsys):
    out = tmp_path / "decode.json"
    args = ["bench", "decode", "--context", "16", "--preset", "tiny", "--tokens", "2", "--repeats", "1"]
    assert main([*args, "--batch", "8", "--json", str(out)]) == 0
    assert "batch 8," in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["shapes"]["batch"] == 8 and result["rows"][0]["tokens_per_s"]["diff"] > 0
    assert main([*args, "--batch", "8", "--hf"]) != 0  # transformers generate() is timed at batch 1 only
    assert "at batch 1 only" in capsys.readouterr().err
