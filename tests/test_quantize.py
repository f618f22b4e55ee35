"""Post-training quantization: the integer formats on known values, the layers, and quantized runs end to end."""

import json

import pytest
import torch
from conftest import SMALL, small_config
from torch import nn

from difftransformer.apps.cli import main
from difftransformer.core.quantized import (
    QuantizedLinear,
    dequantize_weight,
    fake_quantize,
    pack_int4,
    quantize_weight,
    unpack_int4,
)
from difftransformer.errors import InputError


def test_int8_per_channel_on_known_values():
    weight = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    values, scale = quantize_weight(weight, 8, 4)
    # row 0: step 1/127; -63.5 rounds half to even (-64), 31.75 to 32; row 1 is all zero: values 0
    assert values.dtype == torch.int8
    assert values.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0]]
    torch.testing.assert_close(scale[0], torch.tensor([1 / 127]))
    assert torch.equal(dequantize_weight(values, scale)[1], torch.zeros(4))


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 32), (4, 64)])
def test_error_is_at_most_half_a_step_of_each_group(bits, group):
    weight = torch.randn(16, 64) * torch.logspace(-2, 1, 16)[:, None]  # rows of very different ranges
    values, scale = quantize_weight(weight, bits, group)
    assert scale.shape == (16, 64 // group)
    assert values.abs().max() <= 2 ** (bits - 1) - 1
    error = (dequantize_weight(values, scale) - weight).abs().view(16, 64 // group, group)
    assert (error <= scale[..., None] / 2 + 1e-7).all()
    assert error.max() > 0  # it is a quantization, not a copy


def test_int4_packing_round_trips_every_value():
    values = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)  # (3, 32)
    packed = pack_int4(values)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16)
    assert torch.equal(unpack_int4(packed), values)
    assert packed[0, 0] == (0 | (1 << 4))  # -8 -> 0 in the low nibble, -7 -> 1 in the high one


def test_group_that_does_not_divide_is_refused():
    with pytest.raises(InputError, match="group size 32 does not divide the 48 input features"):
        quantize_weight(torch.randn(4, 48), 4, 32)


def test_fake_quantize_snaps_to_the_grid_and_clips():
    x = torch.tensor([0.0, 0.26, -1.0, 5.0])
    out = fake_quantize(x, torch.tensor(1 / 127))
    torch.testing.assert_close(out, torch.tensor([0.0, 33 / 127, -1.0, 1.0]))


@pytest.mark.parametrize("bits, act", [(8, False), (4, False), (8, True)])
def test_quantized_linear_is_the_linear_of_its_dequantized_weight(bits, act):
    linear = nn.Linear(64, 24, bias=False)
    layer = QuantizedLinear.from_linear(linear, bits, 0.02 if act else None)
    x = torch.randn(3, 5, 64)
    values, scale = quantize_weight(linear.weight, bits, 32 if bits == 4 else 64)
    inputs = torch.round(x / 0.02).clamp(-127, 127) * 0.02 if act else x
    torch.testing.assert_close(layer(x), inputs @ (values.float() * scale.repeat_interleave(64 // scale.shape[1], 1)).T)
    assert layer.qweight.dtype == (torch.uint8 if bits == 4 else torch.int8)


@pytest.fixture(scope="module")
def trained(module_data, tmp_path_factory):
    """A trained run, which the tests only read."""
    from difftransformer.training.loop import train

    run = tmp_path_factory.mktemp("quantize") / "run"
    config = small_config(module_data[1], run, model={**SMALL, "n_layers": 2}, max_steps=6, ckpt_interval=6)
    train(config, quiet=True)
    return run


@pytest.mark.parametrize("scheme", ["w8a16", "w4a16", "w8a8"])
def test_a_quantized_run_reloads_bit_exactly_and_generates(trained, tmp_path, scheme, capsys):
    from difftransformer import load_run
    from difftransformer.inference.quantize import quantize_run
    from difftransformer.store.checkpoint import list_checkpoints, load_model_tensors

    out = tmp_path / scheme
    spec = quantize_run(trained, scheme, out, calib_samples=8)
    tensors = load_model_tensors(list_checkpoints(out)[-1])
    qweight = tensors["layers.0.attn.q_proj.qweight"]
    assert qweight.dtype == (torch.uint8 if scheme == "w4a16" else torch.int8)
    assert ("layers.0.ffn.up_proj.input_scale" in tensors) == (scheme == "w8a8")
    assert "layers.0.attn.q_proj.weight" not in tensors and "embed.weight" in tensors
    assert json.loads((out / "quantization.json").read_text())["scheme"] == scheme
    float_model, _ = load_run(trained)
    first, _ = load_run(out)
    second, _ = load_run(out)
    tokens = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        assert torch.equal(first(tokens), second(tokens))
        error = (first(tokens) - float_model(tokens)).abs().max()
    assert 0 < error < 0.5
    if scheme == "w8a8":
        assert spec["calibration_split"] == "train" and spec["calibration_windows"] == 8
    argv = ["generate", "--run", str(out), "--prompt", "the ", "--max-new-tokens", "5", "--temperature", "0"]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("the ")


def test_calibration_reads_only_training_windows(trained, tmp_path, monkeypatch):
    import difftransformer.inference.quantize as ptq
    import difftransformer.store.runs as runs

    splits = []
    original = runs.eval_windows

    def recording(data, seq_len, max_tokens):
        splits.append(data.split)
        return original(data, seq_len, max_tokens)

    monkeypatch.setattr(runs, "eval_windows", recording)
    ptq.quantize_run(trained, "w8a8", tmp_path / "q", calib_samples=4)
    assert splits == ["train"]


def test_percentile_calibration_clips_below_absmax(trained, tmp_path):
    from difftransformer.inference.quantize import quantize_run
    from difftransformer.store.checkpoint import list_checkpoints, load_model_tensors

    quantize_run(trained, "w8a8", tmp_path / "abs", calib_samples=8, calibrator="absmax")
    quantize_run(trained, "w8a8", tmp_path / "pct", calib_samples=8, calibrator="percentile")
    scales = [load_model_tensors(list_checkpoints(tmp_path / n)[-1]) for n in ("abs", "pct")]
    names = [k for k in scales[0] if k.endswith("input_scale")]
    assert len(names) == 2 * 7
    assert all(scales[1][n] <= scales[0][n] for n in names)
    assert any(scales[1][n] < scales[0][n] for n in names)


def test_eval_runs_a_quantized_run(trained, tmp_path, capsys):
    from difftransformer.inference.quantize import quantize_run

    quantize_run(trained, "w8a16", tmp_path / "q")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(json.dumps({"text": "the attention noise"}) + "\n")
    assert main(["eval", "--run", str(tmp_path / "q"), "--jsonl", str(jsonl)]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{") :])
    assert result["ours"]["bits_per_byte"] > 0 and result["lm_eval"].startswith("skipped")


def test_bench_quantized_names_the_runs_not_their_paths(trained, tmp_path, capsys):
    """The result of `difftx bench quantized` is committed with the benchmarks: it names the runs by their directory
    names, never a path of the machine it ran on."""
    from difftransformer.inference.quantize import quantize_run

    quantize_run(trained, "w8a16", tmp_path / "q")
    out = tmp_path / "bench.json"
    assert main(["bench", "quantized", "--run", str(tmp_path / "q"), "--context", "8", "--tokens", "2", "--repeats",
                 "1", "--json", str(out)]) == 0  # fmt: skip
    shapes = json.loads(out.read_text())["shapes"]
    assert (shapes["run"], shapes["source"]) == ("q", "run")
    assert str(tmp_path) not in out.read_text() and str(tmp_path) not in capsys.readouterr().out


def test_bench_quantized_names_the_context_that_fits(trained, tmp_path, capsys):
    """A context too long for the model is refused with the model's own context and the longest --context that
    fits; that one runs."""
    from difftransformer import load_run
    from difftransformer.inference.quantize import quantize_run

    quantize_run(trained, "w8a16", tmp_path / "q")
    window = load_run(trained)[0].config.max_seq_len
    argv = ["bench", "quantized", "--run", str(tmp_path / "q"), "--tokens", "2", "--repeats", "1"]
    assert main([*argv, "--context", str(window - 2)]) == 2
    expected = (
        f"needs {window + 1} positions, more than the model's context of {window}: use --context {window - 3} or less"
    )
    assert capsys.readouterr().err.strip().endswith(expected)
    assert main([*argv, "--context", str(window - 3)]) == 0
    capsys.readouterr()
    tokens = ["--tokens", str(window), "--repeats", "1"]
    assert main(["bench", "quantized", "--run", str(tmp_path / "q"), "--context", "1", *tokens]) == 2
    assert capsys.readouterr().err.strip().endswith(f"use --tokens {window - 2} or fewer")  # no context would fit


def test_one_checkpoint_of_a_run_quantizes(trained, tmp_path, capsys):
    """`--run RUN/checkpoints/step_N`, which generate, eval and convert take, once ended in an IndexError."""
    from difftransformer import load_run
    from difftransformer.store.checkpoint import list_checkpoints

    checkpoint = list_checkpoints(trained)[-1]
    assert main(["quantize", "--run", str(checkpoint), "--scheme", "w8a16", "--out", str(tmp_path / "q")]) == 0
    spec = json.loads((tmp_path / "q" / "quantization.json").read_text())
    assert spec["source"] == str(trained.resolve()) and spec["source_step"] == 6
    model, _ = load_run(tmp_path / "q")
    assert model.config == load_run(checkpoint)[0].config
