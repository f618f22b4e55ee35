"""Does the fused kernel make subnormal floats when attention is sharp, and what do they cost?

The long-budget study's shape: batch 8, 1 differential head (half-heads 32), T 512, 1 thread, float32. The rows are
sharpened by scaling the queries; each case is timed with subnormals kept and flushed (torch.set_flush_denormal).
Run from the checkout to measure: python diff_core.py [impl]  (impl: auto, the fused kernel on CPU, by default).
"""

import statistics
import sys
import time

import torch

from difftransformer.core.attention.kernels import diff_attention

torch.set_num_threads(1)
B, H, T, D = 8, 1, 512, 32
IMPL = sys.argv[1] if len(sys.argv) > 1 else "auto"


def subnormal_share(x: torch.Tensor) -> float:
    x = x.abs()
    return ((x > 0) & (x < torch.finfo(x.dtype).tiny)).float().mean().item()


def timed(sharp: float, flush: bool, reps: int = 30):
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(B, H, 2, T, D, generator=g) * sharp).requires_grad_()
    k = torch.randn(B, H, 2, T, D, generator=g).requires_grad_()
    v = torch.randn(B, H, T, 2 * D, generator=g).requires_grad_()
    lam = torch.tensor(0.5)
    grad_out = torch.randn(B, H, T, 2 * D, generator=g) * 1e-3
    torch.set_flush_denormal(flush)
    seconds = []
    try:
        for _ in range(reps + 5):
            start = time.perf_counter()
            out = diff_attention(q, k, v, lam, scale=D**-0.5, impl=IMPL)
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_flush_denormal(False)
    with torch.no_grad():
        s = (q[:, :, 0] * D**-0.5) @ k[:, :, 0].transpose(-1, -2)
        gap = (s.amax(-1, keepdim=True) - s).median().item()
    return statistics.median(seconds[5:]), gap, [subnormal_share(t) for t in (out, *grads)]


for sharp in (1, 8, 16, 32, 64):
    kept, gap, shares = timed(sharp, False)
    flushed, _, _ = timed(sharp, True)
    print(
        f"q x{sharp:3d}: median logit gap to the row max {gap:7.1f}; ms off {kept * 1e3:7.2f} flushed "
        f"{flushed * 1e3:7.2f} ratio {kept / flushed:5.2f}; subnormal share out/gq/gk/gv "
        f"{[f'{s:.3g}' for s in shares]}",
        flush=True,
    )
