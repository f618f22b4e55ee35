"""Generation with a preallocated KV cache: one prefill over the prompts, then one-token decode steps.

Greedy (temperature 0), temperature, top-k and top-p sampling with a seed; stop tokens and stop strings; batches
of prompts of different lengths, left-padded, with the padding masked out of attention and the rotary positions
of each prompt starting at 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from difftransformer.core.attention.diff import fixed_lambdas
from difftransformer.core.model import TransformerLM
from difftransformer.errors import Fields, InputError
from difftransformer.inference.cache import KVCache

if TYPE_CHECKING:
    from difftransformer.store.tokenizer import Tokenizer


@dataclass
class SamplingConfig:
    """How tokens are drawn: greedy at temperature 0; otherwise softmax(logits / temperature) restricted to the
    ``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``. ``generate`` checks
    its arguments through it.

    Examples:
        >>> SamplingConfig(max_new_tokens=20, temperature=0.8, top_p=0.95).top_p
        0.95
        >>> SamplingConfig(max_new_tokens=20, top_p=1.5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        difftransformer.errors.ConfigError: SamplingConfig.top_p ...
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        check = Fields(self)
        check.integer("max_new_tokens", 1, 1 << 22)
        check.number("temperature", 0, 100, hint=" (0 for greedy decoding)")
        check.integer("top_k", 1, optional=True)
        check.number("top_p", 0, 1, low_open=True, optional=True)
        check.integer("seed", 0, (1 << 63) - 1, optional=True)


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token id per row of ``logits`` (B, V): argmax when temperature is 0."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature  # the same softmax; no overflow at any temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest set whose mass reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(-1)


def _as_prompts(prompt_tokens) -> tuple[list[list[int]], bool]:
    if isinstance(prompt_tokens, torch.Tensor):
        prompt_tokens = prompt_tokens.tolist()
    if prompt_tokens and isinstance(prompt_tokens[0], (list, tuple)):
        return [list(map(int, p)) for p in prompt_tokens], True
    return [list(map(int, prompt_tokens))], False


@torch.no_grad()
def generate(
    model: TransformerLM,
    prompt_tokens: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_tokens: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    tokenizer: Tokenizer | None = None,
    on_token: Callable[[int, int], None] | None = None,
    truncate: bool = False,
) -> list[int] | list[list[int]]:
    """New tokens after one prompt (a list of ids) or after each of several prompts (a list of lists).

    The prompts are prefilled into a static KVCache, then one token per step is decoded; several prompts of
    different lengths are left-padded and decoded together.

    Args:
        model: the language model (``load_run`` gives a trained one and its tokenizer).
        prompt_tokens: one prompt (a list of ids), several (a list of lists), or a (B, T) tensor.
        max_new_tokens: tokens to generate at most per prompt.
        temperature: 0 for greedy decoding; otherwise the logits are divided by it before sampling.
        top_k: sample among the k most likely tokens only.
        top_p: sample among the most likely tokens whose probabilities add up to p (nucleus sampling).
        seed: the sampling's seed (None: torch's global generator).
        stop_tokens: ids that end a row (not included in it).
        stop_strings: texts that end a row once its decoded text contains one (the completing token is included;
            needs ``tokenizer``).
        tokenizer: what decodes the text for ``stop_strings``.
        on_token: called as ``on_token(row, token)`` for every kept token, for streaming.
        truncate: keep the end of a prompt too long for the context with ``max_new_tokens`` (else it raises).

    Returns:
        The new tokens: a list of ids for one prompt, a list of lists for several.

    Raises:
        InputError: an empty prompt, one too long for the context (without ``truncate``), or a bad setting.

    Examples:
        >>> import torch
        >>> from difftransformer import ModelConfig, TransformerLM
        >>> model = TransformerLM(ModelConfig.preset("tiny")).eval()
        >>> new = generate(model, [1, 2, 3], max_new_tokens=5, temperature=0)
        >>> len(new)
        5
        >>> [len(row) for row in generate(model, [[1, 2], [3, 4, 5]], max_new_tokens=4, seed=0)]
        [4, 4]
    """
    SamplingConfig(max_new_tokens, temperature, top_k, top_p, seed)
    prompts, batched = _as_prompts(prompt_tokens)
    limit = model.config.max_seq_len
    if stop_strings and tokenizer is None:
        raise InputError("stop_strings needs the tokenizer to decode the generated text")
    for i, stop in enumerate(stop_strings):
        if not isinstance(stop, str) or not stop:
            raise InputError(
                f"stop string {i} is {stop!r}: it must hold at least one character (an empty one matches at once)"
            )
    room = limit - max_new_tokens
    if room < 1:
        raise InputError(
            f"`max_new_tokens` {max_new_tokens} leaves no room for a prompt in the model's context of {limit} tokens; "
            f"ask for at most {limit - 1}"
        )
    for i, p in enumerate(prompts):
        if not p:
            raise InputError(f"prompt {i} is empty; give at least one token")
        if len(p) > room:
            if not truncate:
                raise InputError(
                    f"prompt {i} has {len(p)} tokens; with {max_new_tokens} new tokens it exceeds the model's context "
                    f"of {limit}. Shorten the prompt, ask for fewer tokens, or set `truncate` to keep "
                    f"its last {max(room, 0)} tokens"
                )
            prompts[i] = p[-room:]
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    b, width = len(prompts), max(len(p) for p in prompts)
    total = width + max_new_tokens
    tokens = torch.zeros(b, width, dtype=torch.long, device=device)
    keys = torch.ones(b, total, dtype=torch.bool, device=device)  # which positions may be attended
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) :] = torch.tensor(p, device=device)
        keys[i, : width - len(p)] = False
    positions = (keys.long().cumsum(-1) - 1).clamp(min=0)
    was_training = model.training
    model.eval()
    with fixed_lambdas(model):  # the weights do not change during a generation: lambda once per layer
        cache = KVCache(model, b, total)
        mask = keys if b > 1 else None  # over the cache's slots: the padding is never attended
        logits = model(tokens, mask=mask, positions=positions[:, :width], cache=cache)[:, -1]
        out: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b
        for step in range(max_new_tokens):
            finite = torch.isfinite(logits).all(-1)  # (B,): checked with the sampled ids, in the same synchronisation
            nxt = sample_next(torch.where(finite[:, None], logits, 0.0), temperature, top_k, top_p, generator)
            for i, tok in enumerate(torch.where(finite, nxt, -1).tolist()):
                if done[i]:
                    continue
                if tok < 0:
                    raise InputError(
                        f"the model's scores for the next token of prompt {i} are not finite (NaN or infinity): its "
                        "weights diverged in training. Use a checkpoint from before the divergence"
                    )
                if tok in stop_tokens:
                    done[i] = True
                    continue
                out[i].append(tok)
                if on_token is not None:
                    on_token(i, tok)
                if stop_strings and any(s in tokenizer.decode(out[i]) for s in stop_strings):
                    done[i] = True
            if all(done) or step == max_new_tokens - 1:
                break
            end = width + step + 1
            logits = model(nxt[:, None], mask=mask, positions=positions[:, end - 1 : end], cache=cache)[:, -1]
    model.train(was_training)
    return out if batched else out[0]
