"""Synthetic tasks for the attention-noise claims: multi-needle retrieval and in-context classification.

Both use a small vocabulary of VOCAB tokens: content tokens first, then a few special tokens. Every generator
takes a ``torch.Generator``, so DIFF and standard models trained with the same seed see the same examples.

Multi-needle retrieval (docs/paper.md section 3): a haystack of random content tokens holds N
needles ``[MARK, key, value]`` with distinct keys and distinct values; R queries ``[QRY, key, value]`` follow, asking
distinct needles. The model reads ``QRY key`` and must produce that needle's value. Only the first query is scored
(a later one could copy an earlier answer); its needle sits at the requested depth of the haystack.

In-context classification: each episode draws C classes, gives each class FEATURES_PER_CLASS of its own feature
tokens and its own label token (both drawn afresh per episode, so only the demonstrations tell them); an example is
EXAMPLE_FEATURES feature tokens of its class followed by its label. The model sees k demonstrations and a query
example and must produce the query's label: it has to find demonstrations that share the query's features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difftransformer.errors import InputError

VOCAB = 64
IGNORE = -100

# Needle task: content tokens 0..59, then the markers. With the "shared" vocabulary filler, keys and values are all
# drawn from the 60 content tokens; with "disjoint" keys are 0..19, values 20..39 and filler 40..59.
NEEDLE_CONTENT = 60
MARK, QRY = 60, 61
NEEDLE_KEYS, NEEDLE_VALUES, NEEDLE_FILLER = range(0, 20), range(20, 40), range(40, 60)
NEEDLE_VOCABS = ("shared", "disjoint")

# ICL task: feature tokens 0..47, label tokens 48..55.
ICL_FEATURES = 48
ICL_LABELS = 48
MAX_CLASSES = 8
FEATURES_PER_CLASS = 1  # 4 left a query's feature unseen in the demonstrations too often (experiments/LOG.md)
EXAMPLE_FEATURES = 1  # feature tokens per example (2 gave no signal within the CPU budget: experiments/LOG.md)
ICL_EXAMPLE = EXAMPLE_FEATURES + 1  # the features and the label


@dataclass
class NeedleBatch:
    tokens: torch.Tensor  # (B, L) int64
    targets: torch.Tensor  # (B, L): next-token targets at the query-key and answer positions, IGNORE elsewhere
    answer_pos: torch.Tensor  # (B,) the position whose next token is the first query's answer (its key token)
    answer: torch.Tensor  # (B,) the first query's value
    other_values: torch.Tensor  # (B, N - 1) the other needles' values
    needle_start: torch.Tensor  # (B,) where the first query's needle [MARK, key, value] starts


def needle_batch(
    gen: torch.Generator,
    batch: int,
    length: int,
    n_needles: int,
    n_queries: int,
    depth: float | None = None,
    vocab: str = "shared",
    key_noise: float = 0.0,
) -> NeedleBatch:
    """B sequences of ``length`` tokens: haystack with N needles, then R queries (first scored).

    depth: where the first query's needle starts, as a fraction of the haystack (0 = first position, 1 = last
    possible); None draws it uniformly. vocab: "shared" draws filler, keys and values from one set of tokens (a key
    also turns up in the filler, without its MARK); "disjoint" draws them from three sets, and ``key_noise`` is then
    the share of filler tokens replaced by random key tokens (distractor keys without a MARK).
    """
    if not 1 <= n_queries <= n_needles:
        raise InputError(f"need 1 <= R <= N, got N={n_needles}, R={n_queries}")
    if vocab not in NEEDLE_VOCABS:
        raise InputError(f"unknown needle vocabulary {vocab!r}; choose one of {NEEDLE_VOCABS}")
    most = NEEDLE_CONTENT // 2 if vocab == "shared" else len(NEEDLE_KEYS)
    if n_needles > most:
        raise InputError(f"at most {most} needles (distinct keys and values), got {n_needles}")
    if not 0.0 <= key_noise <= 1.0 or (key_noise and vocab == "shared"):
        raise InputError(f"key_noise must be in [0, 1] and needs the disjoint vocabulary, got {key_noise} ({vocab})")
    hay = length - 3 * n_queries
    if hay < 5 * n_needles - 2:  # so that a free start is left for every needle, wherever the others went
        raise InputError(
            f"length {length} is too short for {n_needles} needles and {n_queries} queries: the needles may fill "
            f"at most about 60% of the haystack; use a length of at least {5 * n_needles - 2 + 3 * n_queries}"
        )
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise InputError(f"depth must be in [0, 1], got {depth}")
    if vocab == "shared":
        tokens = torch.randint(0, NEEDLE_CONTENT, (batch, length), generator=gen)
    else:
        tokens = NEEDLE_FILLER[0] + torch.randint(0, len(NEEDLE_FILLER), (batch, length), generator=gen)
        if key_noise:
            noisy = torch.rand(batch, length, generator=gen) < key_noise
            keys = NEEDLE_KEYS[0] + torch.randint(0, len(NEEDLE_KEYS), (batch, length), generator=gen)
            tokens = torch.where(noisy, keys, tokens)
    targets = torch.full((batch, length), IGNORE)
    answer_pos = torch.empty(batch, dtype=torch.long)
    answer = torch.empty(batch, dtype=torch.long)
    others = torch.empty(batch, n_needles - 1, dtype=torch.long)
    starts = torch.empty(batch, dtype=torch.long)
    for i in range(batch):
        if vocab == "shared":
            symbols = torch.randperm(NEEDLE_CONTENT, generator=gen)
            keys, values = symbols[:n_needles], symbols[n_needles : 2 * n_needles]
        else:
            keys = NEEDLE_KEYS[0] + torch.randperm(len(NEEDLE_KEYS), generator=gen)[:n_needles]
            values = NEEDLE_VALUES[0] + torch.randperm(len(NEEDLE_VALUES), generator=gen)[:n_needles]
        slots = _needle_slots(gen, hay, n_needles, depth)  # slots[0] holds needle 0, the first one queried
        for j, start in enumerate(slots):
            tokens[i, start : start + 3] = torch.stack((torch.tensor(MARK), keys[j], values[j]))
        asked = torch.cat((torch.tensor([0]), 1 + torch.randperm(n_needles - 1, generator=gen)[: n_queries - 1]))
        for r, j in enumerate(asked.tolist()):
            pos = hay + 3 * r
            tokens[i, pos : pos + 3] = torch.stack((torch.tensor(QRY), keys[j], values[j]))
            targets[i, pos] = keys[j]  # which needle is asked: learnable only as "one of the needles"
            targets[i, pos + 1] = values[j]
        answer_pos[i], answer[i], starts[i] = hay + 1, values[0], slots[0]
        others[i] = values[1:]
    return NeedleBatch(tokens, targets, answer_pos, answer, others, starts)


def _needle_slots(gen: torch.Generator, hay: int, n: int, depth: float | None) -> list[int]:
    """Non-overlapping starts of n needles (3 tokens each) in a haystack of ``hay`` tokens; the first at ``depth``."""
    last = hay - 3
    first = round(depth * last) if depth is not None else int(torch.randint(0, last + 1, (), generator=gen))
    taken = [first]
    while len(taken) < n:  # rejection sampling; a needle blocks 5 starts, and hay >= 5n - 2 leaves one free
        start = int(torch.randint(0, last + 1, (), generator=gen))
        if all(abs(start - s) >= 3 for s in taken):
            taken.append(start)
    return taken


def answer_kinds(
    pred: torch.Tensor, answer: torch.Tensor, others: torch.Tensor, tokens: torch.Tensor, last: torch.Tensor, other: str
) -> dict[str, torch.Tensor]:
    """What each prediction (B,) is, as boolean masks over the batch that partition it: ``correct``; ``other`` (one
    of the row's ``others`` (B, m), real answers from the context but the wrong ones, such as another needle's value
    or another class's label); ``in_context`` (another token of the prompt, such as a key or filler);
    ``not_in_context`` (a token the prompt does not hold at all: a contextual hallucination). The prompt of row b is
    ``tokens[b, : last[b] + 1]``."""
    correct = pred == answer
    wrong_answer = (pred[:, None] == others).any(-1) & ~correct
    prompt = torch.arange(tokens.shape[1])[None, :] <= last[:, None]
    seen = ((tokens == pred[:, None]) & prompt).any(-1)
    return {
        "correct": correct,
        other: wrong_answer,
        "in_context": seen & ~correct & ~wrong_answer,
        "not_in_context": ~seen & ~correct & ~wrong_answer,
    }


@dataclass
class ICLBatch:
    tokens: torch.Tensor  # (B, ICL_EXAMPLE * k + EXAMPLE_FEATURES): k demonstrations, then the query's features
    targets: torch.Tensor  # (B, 3k + 2): every demonstration's label and the query's label, IGNORE elsewhere
    query_pos: torch.Tensor  # (B,) the position whose next token is the query's label (the last position)
    answer: torch.Tensor  # (B,) the query's label token


@dataclass
class ICLEpisodes:
    """Episodes before ordering: features and labels of the demonstrations and the query, per episode."""

    demo_features: torch.Tensor  # (B, k, EXAMPLE_FEATURES)
    demo_classes: torch.Tensor  # (B, k)
    query_features: torch.Tensor  # (B, EXAMPLE_FEATURES)
    query_class: torch.Tensor  # (B,)
    label_tokens: torch.Tensor  # (B, C): the label token of each class
    n_classes: int


def icl_episodes(gen: torch.Generator, batch: int, n_classes: int, shots: int, balanced: bool = False) -> ICLEpisodes:
    """B episodes with C classes and k demonstrations (classes drawn uniformly, or k/C of each when balanced)."""
    if not 2 <= n_classes <= MAX_CLASSES:
        raise InputError(f"n_classes must be in [2, {MAX_CLASSES}], got {n_classes}")
    if balanced and shots % n_classes:
        raise InputError(f"balanced episodes need shots divisible by n_classes, got {shots} and {n_classes}")
    features = torch.stack(
        [torch.randperm(ICL_FEATURES, generator=gen)[: n_classes * FEATURES_PER_CLASS] for _ in range(batch)]
    ).view(batch, n_classes, FEATURES_PER_CLASS)
    labels = torch.stack([ICL_LABELS + torch.randperm(MAX_CLASSES, generator=gen)[:n_classes] for _ in range(batch)])
    if balanced:
        demo_classes = torch.arange(n_classes).repeat(shots // n_classes).expand(batch, shots).clone()
    else:
        demo_classes = torch.randint(0, n_classes, (batch, shots), generator=gen)
    query_class = torch.randint(0, n_classes, (batch,), generator=gen)
    return ICLEpisodes(
        demo_features=_examples(gen, features, demo_classes),
        demo_classes=demo_classes,
        query_features=_examples(gen, features, query_class[:, None])[:, 0],
        query_class=query_class,
        label_tokens=labels,
        n_classes=n_classes,
    )


def _examples(gen: torch.Generator, features: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Distinct feature tokens of each example's class: (B, n) classes -> (B, n, EXAMPLE_FEATURES) tokens."""
    b, n = classes.shape
    pick = torch.rand(b, n, FEATURES_PER_CLASS, generator=gen).argsort(-1)[..., :EXAMPLE_FEATURES]  # distinct
    own = features[torch.arange(b)[:, None], classes]  # (B, n, FEATURES_PER_CLASS)
    return own.gather(-1, pick)


def icl_batch(episodes: ICLEpisodes, order: torch.Tensor | None = None) -> ICLBatch:
    """Token sequences of the episodes, with demonstrations in ``order`` ((B, k) permutation; default as drawn)."""
    b, k = episodes.demo_classes.shape
    if order is None:
        order = torch.arange(k).expand(b, k)
    feats = episodes.demo_features.gather(1, order[..., None].expand(b, k, EXAMPLE_FEATURES))
    classes = episodes.demo_classes.gather(1, order)
    demo_labels = episodes.label_tokens.gather(1, classes)  # (B, k)
    answer = episodes.label_tokens.gather(1, episodes.query_class[:, None])[:, 0]
    demos = torch.cat((feats, demo_labels[..., None]), dim=-1).view(b, ICL_EXAMPLE * k)
    tokens = torch.cat((demos, episodes.query_features), dim=1)
    targets = torch.full_like(tokens, IGNORE)
    label_pos = torch.arange(k) * ICL_EXAMPLE + EXAMPLE_FEATURES - 1  # a demonstration's last feature: its label
    targets[:, label_pos] = demo_labels
    targets[:, -1] = answer
    return ICLBatch(tokens, targets, torch.full((b,), tokens.shape[1] - 1), answer)


def demo_order(gen: torch.Generator, classes: torch.Tensor, arrangement: str) -> torch.Tensor:
    """A (B, k) order of the demonstrations with classes (B, k).

    random: a uniform permutation. grouped: all demonstrations of one class, then the next class, with the order of
    classes and the order within a class random. alternating: one demonstration of each class in turn (round robin),
    in a random class order that repeats. The same generator state gives the same orders.
    """
    b, k = classes.shape
    if arrangement == "random":
        return torch.rand(b, k, generator=gen).argsort(-1)
    if arrangement not in ("grouped", "alternating"):
        raise InputError(f"unknown arrangement {arrangement!r}; choose random, grouped or alternating")
    n_classes = int(classes.max()) + 1
    class_rank = torch.rand(b, n_classes, generator=gen).argsort(-1).argsort(-1)  # the position of each class
    within = torch.rand(b, k, generator=gen).argsort(-1).argsort(-1).double() / k  # random tie-break in a class
    rank_of_class = class_rank.gather(1, classes).double()
    if arrangement == "grouped":
        key = rank_of_class + within
    else:  # the i-th demonstration of a class (in the random within-class order) goes to round i
        round_in_class = (within[..., None] > within[:, None, :]) & (classes[..., None] == classes[:, None, :])
        key = round_in_class.sum(-1).double() * n_classes + rank_of_class
    return key.argsort(-1)
