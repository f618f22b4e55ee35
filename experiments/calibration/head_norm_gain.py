"""The per-head norm's matched initial gain, measured (issue #49, first step): per layer, the weight of DIFF's
per-head norm that gives its attention block the standard model's output RMS at initialisation, on random tokens and
on the built-in corpus (byte tokens), beside the i.i.d. derivation g_l = init_std * sqrt(D * H_T / T) / (1 -
lambda_init_l) (uniform maps at initialisation: the standard head averages t + 1 independent values, RMS
init_std * sqrt(D / (t + 1)), whose mean square over positions is D init_std^2 H_T / T with H_T the T-th harmonic
number; DIFF's per-head norm rescales its averaged values to RMS g, times 1 - lambda_init; both then share out_proj).
The block's output is linear in the gain, so one forward pass at gain 1 gives it: standard RMS / DIFF RMS.

    .venv/bin/python experiments/calibration/head_norm_gain.py --presets tiny small
"""

from __future__ import annotations

import argparse
import math

import torch

from difftransformer import ModelConfig, TransformerLM
from difftransformer.store import corpus
from difftransformer.store.tokenizer import ByteTokenizer


def attention_rms(model: TransformerLM, tokens: torch.Tensor) -> list[float]:
    """The RMS of each layer's attention block output on ``tokens``."""
    rms: dict[int, float] = {}
    hooks = [
        block.attn.register_forward_hook(
            lambda m, a, out, i=i: rms.__setitem__(i, out.double().pow(2).mean().sqrt().item())
        )
        for i, block in enumerate(model.layers)
    ]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return [rms[i] for i in range(len(model.layers))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = ByteTokenizer()
    text = "".join(doc for _, doc in zip(range(400), corpus.pydocs_documents(), strict=False))
    ids = torch.tensor(tokenizer.encode(text))
    for name in args.presets:
        configs = {
            a: ModelConfig.preset(name, attention=a, vocab_size=tokenizer.vocab_size) for a in ("standard", "diff")
        }
        t = configs["standard"].max_seq_len
        models = {}
        for attention, config in configs.items():
            torch.manual_seed(args.seed)
            models[attention] = TransformerLM(config)
        harmonic = sum(1 / k for k in range(1, t + 1))
        c = configs["standard"]
        iid = [
            c.init_std * math.sqrt(c.d_model * harmonic / t) / (1 - b.attn.lambda_init) for b in models["diff"].layers
        ]
        g = torch.Generator().manual_seed(args.seed)
        inputs = {
            "random": torch.randint(0, tokenizer.vocab_size, (args.windows, t), generator=g),
            "pydocs": ids[: args.windows * t].view(args.windows, t),
        }
        print(f"{name}: d_model {c.d_model}, {c.n_layers} layers, T {t}, init_std {c.init_std}, seed {args.seed}")
        print(f"  i.i.d. derivation:  {' '.join(f'{x:.4f}' for x in iid)}")
        for label, tokens in inputs.items():
            std, diff = attention_rms(models["standard"], tokens), attention_rms(models["diff"], tokens)
            gains = [s / d for s, d in zip(std, diff, strict=True)]
            over = " ".join(f"{x / y:.2f}" for x, y in zip(gains, iid, strict=True))
            print(f"  matched, {label:>7}: {' '.join(f'{x:.4f}' for x in gains)}   (/ derivation: {over})")


if __name__ == "__main__":
    main()
