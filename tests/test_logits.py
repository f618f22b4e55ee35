"""The attention-logit probe and the absmax logit quantizer (the paper's Figure 8 protocol)."""

import pytest
import torch

from difftransformer.core.attention.logits import LogitQuantizer, logit_probe, quantize_absmax
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.errors import InputError

KINDS = ["diff", "diff_v2", "standard"]


def test_known_values_at_three_bits():
    # 3 bits: levels -3..3, step = absmax / 3; 0.5 / (1/3) = 1.5 rounds to 2 (half to even), 0.26 * 3 = 0.78 to 1
    scores = torch.tensor([[1.0, -0.5, 0.26, 0.0]])
    expected = torch.tensor([[1.0, -2 / 3, 1 / 3, 0.0]])
    torch.testing.assert_close(quantize_absmax(scores, 3), expected)


def test_masked_entries_do_not_set_the_scale():
    scores = torch.tensor([[10.0, 1.0, 0.5]])
    allowed = torch.tensor([[False, True, True]])
    out = quantize_absmax(scores, 3, allowed)
    torch.testing.assert_close(out[:, 1:], torch.tensor([[1.0, 2 / 3]]))  # step 1/3, not 10/3


def test_all_zero_row_is_unchanged_and_rows_have_their_own_scale():
    scores = torch.tensor([[0.0, 0.0, 0.0], [100.0, 1.0, -60.0]])
    out = quantize_absmax(scores, 2)  # 2 bits: levels -1..1
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 0.0], [100.0, 0.0, -100.0]]))


@pytest.mark.parametrize("bits", [16, 8, 6, 4])
def test_error_is_at_most_half_a_step(bits):
    scores = torch.randn(4, 3, 16, 16) * 20
    out = quantize_absmax(scores, bits)
    step = scores.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    assert ((out - scores).abs() <= step / 2 + 1e-6).all()
    assert len(torch.unique(out[0, 0, 0])) <= 2**bits - 1


def test_tensor_granularity_takes_one_scale_per_sequence():
    scores = torch.tensor([[[1.0, 0.1]], [[8.0, 0.1]]])  # batch of 2, one row each
    out = quantize_absmax(scores, 2, granularity="tensor")
    torch.testing.assert_close(out, torch.tensor([[[1.0, 0.0]], [[8.0, 0.0]]]))
    out = quantize_absmax(torch.tensor([[[1.0, 0.6], [8.0, 0.1]]]), 2, granularity="tensor")
    torch.testing.assert_close(out, torch.tensor([[[0.0, 0.0], [8.0, 0.0]]]))  # one scale: 8


@pytest.mark.parametrize("bits", [1, 17, 4.0, True, "8"])
def test_bad_bits_are_refused(bits):
    with pytest.raises(InputError, match="logit bits must be an integer from 2 to 16"):
        LogitQuantizer(bits)


def test_bad_granularity_is_refused():
    with pytest.raises(InputError, match="unknown logit quantization granularity 'column'"):
        LogitQuantizer(8, "column")


def _model(kind: str) -> TransformerLM:
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=64, attention=kind)
    return TransformerLM(cfg).eval()


@pytest.mark.parametrize("kind", KINDS)
def test_model_is_unchanged_at_16_bits_and_changed_at_4(kind):
    model = _model(kind)
    tokens = torch.randint(0, 64, (2, 48))
    with torch.no_grad():
        reference = model(tokens)
        with logit_probe(LogitQuantizer(16)):
            at16 = model(tokens)
        with logit_probe(LogitQuantizer(4)):
            at4 = model(tokens)
    torch.testing.assert_close(at16, reference, atol=1e-4, rtol=0)
    assert (at4 - reference).abs().max() > 10 * (at16 - reference).abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_every_layer_passes_its_logits_through_the_probe(kind):
    model = _model(kind)
    seen = []

    def probe(scores, allowed):
        seen.append((tuple(scores.shape), allowed is not None))
        return scores

    with torch.no_grad(), logit_probe(probe):
        model(torch.randint(0, 64, (2, 20)))
    maps = {"diff": (2, 2, 2, 20, 20), "diff_v2": (2, 8, 20, 20), "standard": (2, 4, 20, 20)}[kind]
    assert seen == [(maps, True)] * 2  # each layer once, causal mask given


@pytest.mark.parametrize("impl", ["block", "sdpa", "auto"])
def test_the_probe_overrides_the_fast_paths(impl):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_seq_len=256, attn_impl=impl)
    model = TransformerLM(cfg).eval()
    calls = []
    with torch.no_grad(), logit_probe(lambda s, a: calls.append(1) or s):
        model(torch.randint(0, 64, (1, 200)))
    assert calls == [1]


def test_a_cached_decode_passes_through_the_probe():
    from difftransformer.inference.generate import generate

    model = _model("diff")
    calls = []
    with logit_probe(lambda s, a: calls.append(s.shape[-2]) or s):
        generate(model, torch.randint(0, 64, (1, 5)), max_new_tokens=3, temperature=0.0)
    assert calls[:2] == [5, 5] and calls[2:] == [1] * (len(calls) - 2) and len(calls) > 2


def test_probes_nest_and_end_with_their_context():
    from difftransformer.core.attention.logits import active_probe

    outer, inner = LogitQuantizer(8), LogitQuantizer(4)
    with logit_probe(outer):
        with logit_probe(inner):
            assert active_probe() is inner
        assert active_probe() is outer
        with pytest.raises(RuntimeError), logit_probe(inner):
            raise RuntimeError("an error inside")
        assert active_probe() is outer
    assert active_probe() is None
