"""Sampling from a TransformerLM: greedy, temperature, top-k and top-p, with a seed.

This version recomputes the whole sequence for every new token; it serves the demo and the tests until the
KV-cache engine replaces its inside (the call stays the same).
"""

from __future__ import annotations

import torch

from difftransformer.model import TransformerLM


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None
) -> torch.Tensor:
    """One token id per row of ``logits`` (B, V): argmax when temperature is 0."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest set whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: TransformerLM,
    prompt_tokens: list[int] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens: tuple[int, ...] = (),
) -> list[int]:
    """New token ids after ``prompt_tokens`` (one prompt), stopping at a stop token (not included)."""
    tokens = torch.as_tensor(prompt_tokens, dtype=torch.long).flatten()
    limit = model.config.max_seq_len
    if len(tokens) == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if len(tokens) + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {len(tokens)} tokens plus {max_new_tokens} new tokens exceeds the model's context of {limit}; "
            "shorten the prompt or ask for fewer new tokens"
        )
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    was_training = model.training
    model.eval()
    seq = tokens.to(device)[None]
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = sample_next(model(seq)[:, -1], temperature, top_k, top_p, generator)
        if int(nxt) in stop_tokens:
            break
        out.append(int(nxt))
        seq = torch.cat([seq, nxt[:, None]], dim=1)
    model.train(was_training)
    return out
