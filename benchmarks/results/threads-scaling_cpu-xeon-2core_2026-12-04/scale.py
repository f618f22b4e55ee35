"""How this VM's second core scales compute-bound, memory-bound and attention work: 1 vs 2 threads, interleaved."""

import statistics
import time

import torch
import torch.nn.functional as F

from difftransformer.core.attention.kernels import diff_attention

T, D = 4096, 32
g = torch.Generator().manual_seed(0)
a, b = torch.randn(2048, 2048, generator=g), torch.randn(2048, 2048, generator=g)
big = torch.randn(64 << 20, generator=g)  # 256 MiB
qd = torch.randn(1, 4, 2, T, D, generator=g).requires_grad_()
kd = torch.randn(1, 4, 2, T, D, generator=g).requires_grad_()
vd = torch.randn(1, 4, T, 2 * D, generator=g).requires_grad_()
qs = torch.randn(1, 8, T, D, generator=g).requires_grad_()
ks = torch.randn(1, 8, T, D, generator=g).requires_grad_()
vs = torch.randn(1, 8, T, D, generator=g).requires_grad_()
lam = torch.tensor(0.5)


def diff_core():
    out = diff_attention(qd, kd, vd, lam, scale=D**-0.5)
    torch.autograd.grad(out, (qd, kd, vd), torch.ones_like(out))


def sdpa_core():
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    torch.autograd.grad(out, (qs, ks, vs), torch.ones_like(out))


work = {
    "mm 2048^3": lambda: torch.mm(a, b),
    "add 256 MiB": lambda: big.add(1.0),
    "diff core fwd+bwd T4096": diff_core,
    "sdpa core fwd+bwd T4096": sdpa_core,
}
times = {(n, t): [] for n in work for t in (1, 2)}
for _ in range(5):
    for name, fn in work.items():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            fn()
            start = time.perf_counter()
            for _ in range(3):
                fn()
            times[name, threads].append((time.perf_counter() - start) / 3)
for name in work:
    one, two = statistics.median(times[name, 1]), statistics.median(times[name, 2])
    print(f"{name}: 1 thread {one * 1e3:.1f} ms, 2 threads {two * 1e3:.1f} ms, 2t/1t {two / one:.2f}")
