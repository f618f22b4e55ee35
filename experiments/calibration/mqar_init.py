"""Associative recall without filler (MQAR): does a small model of the library learn to match keys, and how fast?

The diagnostic behind the needle calibration's initialisation finding (experiments/LOG.md, 2026-12-01): P pairs
[key value] (P distinct keys from 30 tokens, values from 30 others), then the P keys again in a random order, each
followed by its value; the loss is on the values of the second half, so only matching a key to its earlier
occurrence and copying the token after it beats 1/P (the induction-head circuit). Prints the training batch's
accuracy every 200 steps.

    .venv/bin/python experiments/calibration/mqar_init.py --attention standard --init-std 0.07
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from difftransformer import TransformerLM
from difftransformer.core.config import ModelConfig

KEYS, VOCAB, BATCH = 30, 64, 32


def batch(gen: torch.Generator, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.rand(BATCH, KEYS, generator=gen).argsort(-1)[:, :pairs]
    values = KEYS + torch.randint(0, KEYS, (BATCH, pairs), generator=gen)
    order = torch.rand(BATCH, pairs, generator=gen).argsort(-1)
    context = torch.stack((keys, values), -1).view(BATCH, 2 * pairs)
    queries = torch.stack((keys.gather(1, order), values.gather(1, order)), -1).view(BATCH, 2 * pairs)
    tokens = torch.cat((context, queries), 1)
    targets = torch.full_like(tokens, -100)
    targets[:, 2 * pairs :: 2] = tokens[:, 2 * pairs + 1 :: 2]  # at each asked key: its value
    return tokens, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="standard", choices=("standard", "diff"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4, help="the standard model's heads (DIFF uses half)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--init-std", type=float, default=0.02)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=1400)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--head-norm", choices=("default", "on", "off"), default="default",
        help="the per-head RMSNorm (ModelConfig.head_norm): each attention's own choice, or forced on or off",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    config = ModelConfig(
        vocab_size=VOCAB, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, max_seq_len=4 * args.pairs,
        attention=args.attention, tie_embeddings=True, init_std=args.init_std,
        head_norm={"default": None, "on": True, "off": False}[args.head_norm],
    )  # fmt: skip
    model = TransformerLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen, start = torch.Generator().manual_seed(args.seed + 1), time.perf_counter()
    for step in range(args.steps + 1):
        tokens, targets = batch(gen, args.pairs)
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 200 == 0:
            asked = targets != -100
            accuracy = (logits.argmax(-1)[asked] == targets[asked]).float().mean().item()
            seconds = time.perf_counter() - start
            print(f"step {step:5d}  loss {loss.item():.3f}  accuracy {accuracy:.3f}  {seconds:.0f} s")


if __name__ == "__main__":
    main()
