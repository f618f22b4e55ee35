"""How close a training step comes to what the machine can do: the FLOPs a step must do, and the machine's own
float32 matrix-product rate, measured in the same run at the same thread count."""

from __future__ import annotations

import statistics
import time

import torch

from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM

# The matrix product that stands for the machine's limit: large enough that its fixed costs vanish (2 n^3 = 17
# GFLOP, a fraction of a second on one core), small enough (3 x 16 MiB) to run anywhere. On a GPU a larger one (1.1
# TFLOP, about 2 ms on an H100), timed with CUDA events over a warm loop: one synchronised 2048^3 product there takes
# tens of microseconds, so launch and synchronisation overhead would lower the reference.
MATMUL_SIZE = 2048
CUDA_MATMUL_SIZE = 8192
CUDA_LOOP = 10


def step_flops(config: ModelConfig, batch: int, t: int) -> int:
    """FLOPs of one training step (forward and backward; elementwise work and the optimizer not counted) of
    ``TransformerLM(config)`` on ``batch`` sequences of ``t`` tokens: 6 x (the weights of its matrix products: every
    non-embedding matrix and the output projection, which every token pays even when tied; norm and lambda vectors
    are elementwise) x tokens, plus the attention products with causality (query i meets i + 1 keys): Q K^T over
    the query/key width and the maps times V over the value width, 2 FLOPs per multiply-add, three times over for
    forward and backward. The embedding lookup is free.

    DIFF and the standard model do the same count: DIFF's two maps' query/key halves together are as wide as the
    standard model's queries, and it multiplies V once by the combined map (docs/paper.md section 1). V2 runs 2H
    ordinary query heads, each over its group's values: twice the standard model's attention products."""
    n = _matrix_weights(config)
    pairs = t * (t + 1) // 2  # (query, visible key) pairs of one causal sequence
    width = _attention_width(config)
    attention = 2 * pairs * 2 * width * config.n_layers * batch  # Q K^T and maps x V, each `width` wide
    return 6 * n * batch * t + 3 * attention


def _matrix_weights(config: ModelConfig) -> int:
    """Weights of the model's matrix products: its 2-D parameters but the input embedding, plus the output
    projection (counted here even when it is the tied embedding matrix). Built on the meta device."""
    with torch.device("meta"):
        model = TransformerLM(config)
    n = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p is not model.embed.weight)
    return n + (config.vocab_size * config.d_model if config.tie_embeddings else 0)


def _attention_width(config: ModelConfig) -> int:
    """The summed query/key width of one layer's attention products, equal to its summed value width."""
    heads, d = config.attention_heads, config.attention_head_dim
    if config.attention == "diff":
        return 2 * heads * d  # two query/key halves of d per head; values 2d wide
    if config.attention == "diff_v2":
        return 2 * heads * d  # 2H query heads of d, each reading d-wide values
    return heads * d


def matmul_size(device: str) -> int:
    """The size of the reference product on ``device``."""
    return CUDA_MATMUL_SIZE if str(device).startswith("cuda") else MATMUL_SIZE


def matmul_rate(
    size: int | None = None, repeats: int = 5, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> float:
    """The machine's matrix-product rate in ``dtype`` in FLOP/s (float32 with TF32 where PyTorch's switch has it on):
    the median of ``repeats`` timed ``torch.mm`` of two ``size`` x ``size`` matrices (``matmul_size`` by default)
    after a warm-up, at torch's current thread count; on a GPU each repeat is a loop of CUDA_LOOP products timed
    with CUDA events."""
    size = size or matmul_size(device)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device, dtype)
    b = torch.randn(size, size, generator=g).to(device, dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    cuda = str(device).startswith("cuda")
    loop = CUDA_LOOP if cuda else 1
    times = []
    for i in range(repeats + 1):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(loop):
                torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            seconds = time.perf_counter() - start
        if i:  # the first repeat warms up
            times.append(seconds / loop)
    return 2 * size**3 / statistics.median(times)
