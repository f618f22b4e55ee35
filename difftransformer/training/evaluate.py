"""The evaluator: the loss of every target token of a model over token windows, and what is computed from it (the
mean loss in nats per token, bits per byte). Validation during training, `difftx eval`'s bits per byte and the
studies' measurements all use it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def token_losses(
    model: torch.nn.Module,
    windows: torch.Tensor,
    batch: int = 8,
    amp: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(N, T) cross-entropy in nats of each target of ``windows`` (N, T + 1), in float32, with the model in eval mode
    (under autocast to ``amp`` when given, as the training loop runs), on ``device`` (default: the windows')."""
    was_training = model.training
    model.eval()
    out = []
    try:
        for i in range(0, len(windows), batch):
            chunk = windows[i : i + batch].to(device or windows.device)
            with torch.autocast(chunk.device.type, dtype=amp or torch.float32, enabled=amp is not None):
                logits = model(chunk[:, :-1]).float()
            out.append(F.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none"))
    finally:
        model.train(was_training)
    return torch.cat(out)


def loss_and_bits_per_byte(
    model: torch.nn.Module,
    windows: torch.Tensor,
    token_bytes: torch.Tensor,
    batch: int = 8,
    amp: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[float, float]:
    """The mean loss (nats per target token) and bits per byte over ``windows``, in eval mode without gradients.

    Args:
        model: the language model.
        windows: (N, T + 1) token windows: each scores its tokens 1..T given the ones before.
        token_bytes: ``token_bytes[i]`` is the number of UTF-8 bytes token ``i`` stands for (the tokenizer's
            ``token_bytes()``).
        batch: windows per forward pass.
        amp: the autocast dtype, or None for float32.
        device: where the model runs (default: where its weights are).

    Returns:
        (loss, bits per byte).

    Examples:
        >>> import math
        >>> import torch
        >>> from difftransformer import ModelConfig, TransformerLM
        >>> from difftransformer.store.tokenizer import ByteTokenizer
        >>> model = TransformerLM(ModelConfig.preset("tiny", vocab_size=257))
        >>> token_bytes = torch.from_numpy(ByteTokenizer().token_bytes())
        >>> loss, bpb = loss_and_bits_per_byte(model, torch.randint(0, 256, (4, 33)), token_bytes)
        >>> abs(loss - math.log(257)) < 0.5, abs(bpb - loss / math.log(2)) < 1e-6  # untrained; a token is a byte
        (True, True)
    """
    losses = token_losses(model, windows, batch, amp, device)
    total = float(losses.double().sum())
    n_bytes = int(token_bytes[windows[:, 1:].cpu()].sum())
    return total / losses.numel(), total / math.log(2) / max(1, n_bytes)


@torch.no_grad()
def text_bits_per_byte(model: torch.nn.Module, tokenizer, texts: list[str]) -> float:
    """Bits per byte of texts: each text's tokens after the end-of-text token, scored in consecutive blocks of at
    most the context length, each block seeing as many earlier tokens as the context holds."""
    limit = model.config.max_seq_len
    nll, n_bytes = 0.0, 0
    for text in texts:
        ids = torch.tensor([tokenizer.eot_id, *tokenizer.encode(text)])
        for first in range(1, len(ids), limit):  # targets ids[first:last]
            last = min(len(ids), first + limit)
            start = max(0, last - 1 - limit)
            nll += float(token_losses(model, ids[start:last][None])[0, first - 1 - start :].double().sum())
        n_bytes += len(text.encode("utf-8"))
    return nll / math.log(2) / n_bytes
