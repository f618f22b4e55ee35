"""The per-head norm's matched initial gain, measured against the rule (issue #49): per layer, the weight of the
per-head norm that gives DIFF's attention block the standard model's output RMS at initialisation (measured: the
block's output is linear in that weight, so one forward pass of each model at weight 1 gives it as standard RMS /
DIFF RMS), divided by what ``ModelConfig(head_norm_gain="matched")`` computes from the configuration
(``difftransformer.core.head_norm_gain``).

Token streams: uniformly random tokens (the rule given their collision probability, 1 / vocabulary), and the
built-in corpus as bytes and as a 2048-token BPE trained on it, each against the rule twice: as ``"matched"``
computes it by default (Zipf's law over the vocabulary) and given the windows' measured collision probability
(``token_collision``). Presets larger than ``--full-up-to`` parameters are measured on their first ``--prefix``
layers only, initialised as in the whole model (the rule of layer l depends only on the layers before it).

    .venv/bin/python experiments/calibration/head_norm_gain.py --configs tiny small medium large X X3 \\
        830m 1.4b 2.8b 6.8b 13.1b 3b --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import tempfile

import torch

from difftransformer import ModelConfig, TransformerLM
from difftransformer.core.head_norm_gain import matched_gains, token_collision
from difftransformer.store import corpus
from difftransformer.store.tokenizer import ByteTokenizer, train_bpe

# the norm study's sizes (difftx repro lm --part norm): width, layers, standard heads; vocabulary 2048, context 512
STUDY = {"X": (64, 5, 2)}


def study_config(name: str, **kw) -> ModelConfig:
    d, layers, heads = STUDY[name]
    return ModelConfig(d_model=d, n_layers=layers, n_heads=heads, max_seq_len=512, **kw)


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


def prefix_model(config: ModelConfig, layers: int, seed: int) -> TransformerLM:
    """The first ``layers`` blocks of ``config``'s model, initialised as in the whole model (the residual
    projections' std init_std / sqrt(2 n_layers) of the whole depth)."""
    torch.manual_seed(seed)
    model = TransformerLM(dataclasses.replace(config, n_layers=layers))
    with torch.no_grad():
        for block in model.layers:
            for proj in (block.attn.out_proj, block.ffn.down_proj):
                proj.weight.mul_(math.sqrt(layers / config.n_layers))
    return model


def measured_gains(config: ModelConfig, tokens: torch.Tensor, seed: int, layers: int | None = None) -> list[float]:
    """Per layer: standard attention RMS / DIFF attention RMS at norm weight 1, the models of one seed."""
    layers = layers or config.n_layers
    std = attention_rms(prefix_model(dataclasses.replace(config, attention="standard"), layers, seed), tokens)
    diff = attention_rms(prefix_model(dataclasses.replace(config, attention="diff"), layers, seed), tokens)
    return [s / d for s, d in zip(std, diff, strict=True)]


def corpus_ids(tokenizer, t: int, windows: int) -> torch.Tensor:
    text = "".join(corpus.pydocs_documents())
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    return ids[: windows * t].view(windows, t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["tiny", "small", "X"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--prefix", type=int, default=3)
    parser.add_argument("--full-up-to", type=float, default=2e8)
    parser.add_argument("--streams", nargs="+", default=["random/257", "pydocs/bytes", "random/2048", "pydocs/bpe2048"])
    args = parser.parse_args()
    byte = ByteTokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        bpe = train_bpe(corpus.pydocs_documents(), 2048, f"{tmp}/bpe")
    print(f"seeds {args.seeds}, {args.windows} windows; measured gain / rule, per layer: mean over seeds [min, max]")
    for name in args.configs:
        streams = {}
        for label, tokenizer in (("bytes", byte), ("bpe2048", bpe)):
            vocab = tokenizer.vocab_size
            if name in STUDY:
                config = study_config(name, vocab_size=vocab)
            else:
                config = ModelConfig.preset(name, vocab_size=vocab)
            t = config.max_seq_len
            streams[f"random/{vocab}"] = (config, torch.randint(0, vocab, (args.windows, t)), [1 / vocab])
            text = corpus_ids(tokenizer, t, args.windows)
            streams[f"pydocs/{label}"] = (config, text, [None, token_collision(text)])
        base = streams["pydocs/bytes"][0]
        big = base.n_layers > args.prefix and base.d_model**2 * 12 * base.n_layers > args.full_up_to
        layers = args.prefix if big else base.n_layers
        print(f"{name}: d_model {base.d_model}, {base.n_layers} layers, {base.n_heads} heads, T {base.max_seq_len}"
              + (f" (first {layers} layers)" if big else ""))  # fmt: skip
        for label, (config, tokens, collisions) in streams.items():
            if label not in args.streams:
                continue
            measured = [measured_gains(config, tokens, seed, layers) for seed in args.seeds]
            for collision in collisions:
                rule = matched_gains(config, collision)[:layers]
                cells = []
                for i in range(layers):
                    xs = [row[i] / rule[i] for row in measured]
                    cells.append(f"{statistics.mean(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]")
                given = "Zipf default" if collision is None else f"collision {collision:.4f}"
                print(f"  {label:>15}, {given}: rule {' '.join(f'{g:.3f}' for g in rule)}")
                print(f"  {'':>15}  measured / rule {'  '.join(cells)}", flush=True)


if __name__ == "__main__":
    main()
