"""Smoke test of the benchmark command: it runs, reports its setting, and its JSON matches its table."""

import importlib.util
import json

import pytest
import torch
from conftest import optional

from difftransformer.apps import bench
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
    args = ["bench", "train", "--preset", "tiny", "--seq", "32", "--batch", "2", "--repeats", "1", "--json", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "HF DiffLlama ms" in table and "diff / matmul" in table and "float32 matrix-product rate" in table
    result = json.loads(out.read_text())
    row = result["rows"][0]
    assert set(row["seconds"]) == {"diff", "standard", "hf-diffllama"}
    assert all(v > 0 for v in row["activation_bytes"].values())
    assert len(result["matmul"]["flops_per_s"]) == 2 and min(result["matmul"]["flops_per_s"]) > 0
    assert row["step_flops"]["hf-diffllama"] == row["step_flops"]["diff"] > 0  # the same architecture's count


def test_bench_train_times_the_trainers_step(monkeypatch):
    """bfloat16 means the trainer's recipe: float32 weights under bfloat16 autocast, the trainer's fused AdamW and
    its clipping (training/step.optimizer_step), not a model cast to bfloat16 with a plain AdamW; the utilisation is
    against a bfloat16 matrix product."""
    from difftransformer.training import step

    calls, real = [], step.optimizer_step

    def spy(model, optimizer, micro_batches, lr, grad_clip, device, amp=None):
        calls.append((model, optimizer, micro_batches[0][0].shape, amp))
        return real(model, optimizer, micro_batches, lr, grad_clip, device, amp)

    monkeypatch.setattr(step, "optimizer_step", spy)
    result = bench.bench_train("tiny", [16], batch=2, repeats=1, dtype=torch.bfloat16, matmul=128)
    names = set(result["rows"][0]["seconds"])
    assert len(calls) == 2 * len(names)  # a warm-up and a timed step of each model
    for model, optimizer, shape, amp in calls:
        assert amp == torch.bfloat16 and shape == (2, 16)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(group["fused"] for group in optimizer.param_groups)
        assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    assert result["matmul"]["dtype"] == "bfloat16" and result["step"].startswith("trainer: float32 weights, bfloat16")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_the_hf_attention_columns_are_causal(impl):
    """bench attention's Hugging Face layers attend causally (its eager column once ran without a mask): a change
    to the last token leaves every earlier output as it was, and eager and SDPA agree."""
    optional("transformers")
    torch.manual_seed(0)
    layer = bench._HFDiffLlamaAttention(64, 4, impl)
    other = bench._HFDiffLlamaAttention(64, 4, "sdpa" if impl == "eager" else "eager")
    other.load_state_dict(layer.state_dict())
    x = torch.randn(1, 12, 64)
    changed = x.clone()
    changed[:, -1] += 1.0
    with torch.no_grad():
        out, out_changed, out_other = layer(x), layer(changed), other(x)
    torch.testing.assert_close(out[:, :-1], out_changed[:, :-1], rtol=0, atol=1e-6)
    assert (out[:, -1] - out_changed[:, -1]).abs().max() > 1e-3
    torch.testing.assert_close(out, out_other, rtol=1e-5, atol=1e-5)


def test_bench_decode_counts_every_rows_token_at_batch_8(tmp_path, capsys):
    out = tmp_path / "decode.json"
    args = ["bench", "decode", "--context", "16", "--preset", "tiny", "--tokens", "2", "--repeats", "1"]
    assert main([*args, "--batch", "8", "--json", str(out)]) == 0
    assert "batch 8;" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["shapes"]["batch"] == 8 and result["rows"][0]["tokens_per_s"]["diff"] > 0
    assert main([*args, "--batch", "8", "--hf"]) != 0  # transformers generate() is timed at batch 1 only
    assert "at batch 1 only" in capsys.readouterr().err


def test_bench_threads_times_each_piece_of_work_at_both_counts(tmp_path, capsys, monkeypatch):
    from difftransformer.apps import bench_threads

    seen = []
    real = bench_threads._at
    monkeypatch.setattr(bench_threads, "_at", lambda n, fn: (seen.append(n), real(n, fn)))
    monkeypatch.setattr(
        bench_threads, "_core_inputs", lambda *a: bench._core_inputs(1, 8, 64, 64, "cpu", torch.float32)
    )
    out, before = tmp_path / "threads.json", torch.get_num_threads()
    args = ["bench", "threads", "--preset", "tiny", "--seq", "32", "--batch", "2", "--repeats", "1"]
    assert main([*args, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "DIFF 2t/1t" in table and "| training step | 2 | 32 |" in table
    result = json.loads(out.read_text())
    assert result["shapes"]["threads"] == [1, 2] and len(result["rows"]) == 2
    assert all(set(r["seconds"]["diff"]) == {"1", "2"} for r in result["rows"])
    assert set(seen) == {1, 2} and seen.count(1) == seen.count(2)
    assert torch.get_num_threads() == before  # restored


@pytest.mark.slow  # a process or more of its own (the fast tier, make test-quick, stays within a minute)
def test_bench_context_measures_each_t_in_its_own_process_and_resumes(tmp_path, capsys, monkeypatch):
    """Run as `difftx bench context --help`'s example prints it, at a cut size (tests/test_cli_examples.py leaves it
    to this test)."""
    from difftransformer.apps import bench_context
    from difftransformer.apps.cli import build_parser
    from difftransformer.apps.cli.parsing import leaf_commands

    (example,) = dict(leaf_commands(build_parser()))[("bench", "context")].epilog.splitlines()[1:]
    assert example.strip() == "difftx bench context --preset tiny --json context-tiny.json"
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "context-tiny.json"
    args = [*example.split()[1:], "--seq", "64", "--repeats", "1", "--kinds", "prefill"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "| 64 |" in out
    if importlib.util.find_spec("matplotlib") is None:  # the floor environment: the results stand, no figure
        assert "no figure drawn, matplotlib is not installed" in err and not store.with_suffix(".png").exists()
    else:
        assert store.with_suffix(".png").is_file()
    rows = json.loads(store.read_text())["rows"]
    assert {r["model"] for r in rows} == {"diff", "standard", "hf-diffllama"}
    assert all(r["fits"] and r["peak_rss"] >= r["rss_before"] > 0 for r in rows)

    def no_child(job, budget):
        raise AssertionError(f"measured again: {job}")

    monkeypatch.setattr(bench_context, "_measure", no_child)  # a rerun resumes: nothing measured twice
    assert main(args) == 0
    assert json.loads(store.read_text())["rows"] == rows
    assert f"continuing the study in {store.name} ({len(rows)} measurements kept)" in capsys.readouterr().err
    assert main(["bench", "context", "--preset", "small", "--seq", "64", "--json", str(store)]) != 0
    assert "holds another study" in capsys.readouterr().err
    assert main(["bench", "context", "--preset", "tiny"]) != 0  # the store is needed
    assert "--json" in capsys.readouterr().err


def test_bench_context_predicts_and_skips_what_cannot_fit_or_finish():
    from difftransformer.apps.bench_context import _skip_reason

    def measured(t, seconds, peak):
        return {"seq": t, "fits": True, "seconds": [seconds], "repeats": 1, "peak_rss": peak}

    quadratic = [measured(1024, 1.0, 1 << 30), measured(2048, 4.0, 4 << 30)]
    assert _skip_reason(quadratic, 4096, budget=32 << 30, max_seconds=100) is None  # 16 GiB, 16 s predicted
    assert "predicted peak 16.0 GiB" in _skip_reason(quadratic, 4096, budget=8 << 30, max_seconds=100)["skipped"]
    slow = _skip_reason(quadratic, 4096, budget=32 << 30, max_seconds=10)
    assert slow["fits"] is None and "predicted 16 s" in slow["skipped"]
    linear = [measured(1024, 1.0, 1 << 30), measured(2048, 1.5, 1 << 30)]  # growth below linear counts as linear
    assert "predicted peak 2.0 GiB" in _skip_reason(linear, 4096, budget=1 << 30, max_seconds=100)["skipped"]
    failed = [measured(1024, 1.0, 1 << 30), {"seq": 2048, "fits": False, "error": "out of memory"}]
    assert _skip_reason(failed, 4096, budget=1 << 40, max_seconds=1e9) == {
        "fits": False,
        "skipped": "a shorter T (2048) did not fit",
    }
    assert _skip_reason([], 1024, budget=1, max_seconds=1) is None  # the first T always runs
    timed_out = [*quadratic, {"seq": 4096, "fits": None, "skipped": "predicted 16 s > --max-seconds 10"}]
    later = _skip_reason(timed_out, 8192, budget=1 << 40, max_seconds=10)  # a time skip is no failure to fit
    assert later["fits"] is None and "predicted 64 s" in later["skipped"]


def test_a_rerun_decides_its_skips_again(tmp_path, monkeypatch):
    """A skip is a prediction: the same store rerun with a larger --max-seconds measures what was skipped."""
    from difftransformer.apps import bench_context

    def fake(job, budget):
        return {"fits": True, "seconds": [job["seq"] ** 2 / 1e6], "repeats": 1, "peak_rss": job["seq"] << 10}

    monkeypatch.setattr(bench_context, "_measure", fake)
    store = tmp_path / "context.json"
    run = dict(seqs=[1000, 2000, 4000], kinds=("prefill",), models=("diff",), repeats=1)
    rows = bench_context.bench_context(store, max_seconds=10, **run)["rows"]
    assert [("seconds" in e, e["fits"]) for e in rows] == [(True, True), (True, True), (False, None)]  # 16 s > 10
    rows = bench_context.bench_context(store, max_seconds=100, **run)["rows"]
    assert [e["seq"] for e in rows if "seconds" in e] == [1000, 2000, 4000] and len(rows) == 3


@pytest.mark.slow
def test_a_t_beyond_the_memory_budget_is_a_result_not_a_crash():
    """The child's data segment is capped at the budget: the allocation that would exceed it fails inside torch and
    the child reports that T as not fitting (a KV cache of 64 x 4096 slots x 6 layers, 1.5 GiB, in a 1 GiB budget)."""
    from difftransformer.apps.bench_context import _measure

    job = dict(kind="prefill", model="standard", preset="tiny", seq=4096, batch=64, repeats=1, threads=1)
    entry = _measure(job, budget=1 << 30)
    assert entry == {"fits": False, "error": "out of memory within the 1.0 GiB budget"}


def test_a_context_figure_names_the_machine_that_measured_not_the_one_that_draws(tmp_path, monkeypatch):
    """#48: committed figures measured on a Xeon were titled with the EPYC that drew them again."""
    optional("matplotlib")
    from difftransformer.apps import bench_context, figures

    titles = []
    monkeypatch.setattr(figures, "finish", lambda fig, path, title, **kw: titles.append(title))
    result = {
        "machine": {"cpu": "Some Other CPU", "threads": 1},
        "shapes": {"preset": "tiny", "batch": 1},
        "rows": [{"kind": "train", "model": "diff", "seq": 1024, "seconds": [1.0], "peak_rss": 2**30}],
    }
    bench_context.figure(result, tmp_path / "x.png")
    assert titles == ["Long context, preset tiny, batch 1, Some Other CPU, 1 thread"]
