"""What the language-model study measures on a trained model: per-token validation losses, split into
associative-recall hits and other tokens (the paper's Table 6), and the loss at each position of long documents
(its Figure 4).

- A target token is a *recall hit* (order ``n``) when the ``n`` tokens before it, followed by it, already occurred
  earlier in the same window: the model could predict it by finding the earlier occurrence of its ``n``-gram
  prefix and copying what came next. All other targets are "other". Positions with fewer than ``n`` tokens before
  them are never hits.
- Per-position loss: windows that start at the first token of a validation document at least ``seq_len + 1``
  tokens long (documents end at the tokenizer's end token), so position p is position p of the document.
"""

from __future__ import annotations

import numpy as np
import torch

from difftransformer.store.data import TokenData

RECALL_ORDER = 2  # a hit repeats a 3-gram: two tokens of prefix and the target


def recall_hits(window: torch.Tensor | np.ndarray | list[int], order: int = RECALL_ORDER) -> np.ndarray:
    """For a window of T + 1 tokens, a (T,) boolean array: whether target ``i`` (token ``i + 1``) is a recall hit."""
    tokens = [int(t) for t in (window.tolist() if hasattr(window, "tolist") else window)]
    hits = np.zeros(len(tokens) - 1, dtype=bool)
    seen: set[tuple[int, ...]] = set()
    for pos in range(order, len(tokens)):  # pos: the index of the predicted token in the window
        gram = tuple(tokens[pos - order : pos + 1])
        if gram in seen:
            hits[pos - 1] = True
        seen.add(gram)
    return hits


def split_by_recall(losses: torch.Tensor, windows: torch.Tensor, order: int = RECALL_ORDER) -> dict:
    """Mean loss over all targets, over recall hits and over the others, with the counts."""
    hits = torch.from_numpy(np.stack([recall_hits(w, order) for w in windows]))
    return {
        "loss": float(losses.mean()),
        "recall_loss": float(losses[hits].mean()) if hits.any() else float("nan"),
        "other_loss": float(losses[~hits].mean()) if (~hits).any() else float("nan"),
        "recall_tokens": int(hits.sum()),
        "other_tokens": int((~hits).sum()),
    }


def document_windows(data: TokenData, eot_id: int, seq_len: int, limit: int = 64) -> torch.Tensor:
    """(N, seq_len + 1): the first seq_len + 1 tokens of the split's documents that are at least that long (up to
    ``limit`` of them, evenly spread over the split's documents)."""
    tokens = np.concatenate([np.asarray(s) for s in data.shards])
    ends = np.flatnonzero(tokens == eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1]) if len(ends) else np.array([0])
    lengths = (ends if len(ends) else np.array([len(tokens)])) - starts
    long_starts = starts[lengths >= seq_len + 1]
    if len(long_starts) > limit:
        long_starts = long_starts[np.linspace(0, len(long_starts) - 1, limit).astype(int)]
    rows = [tokens[s : s + seq_len + 1].astype(np.int64) for s in long_starts]
    return torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, seq_len + 1, dtype=torch.int64)


def per_position(losses: torch.Tensor, bucket: int = 32) -> list[float]:
    """Mean loss over windows at each position, averaged within buckets of ``bucket`` positions."""
    curve = losses.mean(0)
    n = len(curve) // bucket * bucket
    return curve[:n].view(-1, bucket).mean(1).tolist()
