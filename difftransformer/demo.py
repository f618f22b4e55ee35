"""`difftx demo`: the matched tiny DIFF / standard pair, its parameter counts, lambda schedule and map properties."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from difftransformer.config import ModelConfig
from difftransformer.model import TransformerLM

SAMPLE = (
    "Differential attention takes the difference between two softmax attention maps, "
    "cancelling the attention that both spread over irrelevant context."
)


def loss_on(model: TransformerLM, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[0, 1:]).item()


def run_demo(seed: int = 0, steps: int = 40) -> dict:
    """Build the tiny pair with one seed, run a forward pass, print and return what it measured."""
    models = {}
    for attention in ("diff", "standard"):
        torch.manual_seed(seed)
        models[attention] = TransformerLM(ModelConfig.preset("tiny", attention=attention)).eval()
    diff, std = models["diff"], models["standard"]
    n_diff, n_std = diff.num_parameters(), std.num_parameters()
    cfg = diff.config
    print(f"tiny preset: d_model={cfg.d_model}, n_layers={cfg.n_layers}, head size {cfg.head_dim}")
    print(f"  DIFF     : {cfg.n_heads // 2} differential heads, {n_diff:,} parameters")
    print(f"  standard : {cfg.n_heads} heads, {n_std:,} parameters")
    print(f"  difference {n_diff - n_std:+,} ({(n_diff - n_std) / n_std:+.3%}): 4d + 2d = {6 * cfg.head_dim} per layer")

    lambda_start = [block.attn.lambda_full().item() for block in diff.layers]

    tokens = torch.tensor([list(SAMPLE.encode("utf-8"))])
    losses = {name: [loss_on(m, tokens)] for name, m in models.items()}
    for name, m in models.items():  # a few steps on the sample, so that the maps are no longer uniform
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        for _ in range(steps):
            loss = F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[0, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[name].append(loss_on(m, tokens))
    print(f"\nloss on {tokens.shape[1]} bytes of text, untrained (ln 256 = 5.545) -> after {steps} AdamW steps on it:")
    for name in models:
        print(f"  {name:<8}: {losses[name][0]:.4f} -> {losses[name][1]:.4f}")
    print("lambda per layer: lambda_init = 0.8 - 0.6 exp(-0.3 l), then lambda at the start and after training:")
    for i, block in enumerate(diff.layers):
        print(
            f"  layer {i}: lambda_init {block.attn.lambda_init:.4f}   lambda {lambda_start[i]:.4f} -> "
            f"{block.attn.lambda_full().item():.4f}"
        )
    last = diff.layers[-1]
    with torch.no_grad():
        x = diff.embed(tokens)
        for block in diff.layers[:-1]:
            x = block(x)
        _, weights = last.attn(last.attn_norm(x), need_weights=True)
    lam = last.attn.lambda_full().item()
    row_error = (weights.sum(-1) - (1 - lam)).abs().max().item()
    negative = (weights < 0).float().mean().item()
    print(f"differential map of layer {len(diff.layers) - 1}, shape {tuple(weights.shape)} (batch, heads, query, key):")
    print(f"  rows sum to 1 - lambda = {1 - lam:.4f}: max deviation {row_error:.2e}")
    print(f"  negative weights: {negative:.1%} of entries (a softmax map has none)")
    return {
        "parameters": {"diff": n_diff, "standard": n_std},
        "loss": losses,
        "lambda": lam,
        "row_error": row_error,
        "negative_share": negative,
    }
