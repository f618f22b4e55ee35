"""The same question for PyTorch's scaled_dot_product_attention (the standard model's core): 2 heads of 32,
causal, batch 8, T 512, 1 thread, float32, queries scaled to sharpen the rows; subnormals kept and flushed."""

import statistics
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
B, H, T, D = 8, 2, 512, 32

for sharp in (1, 16, 32, 64):
    medians = []
    for flush in (False, True):
        g = torch.Generator().manual_seed(1)
        q = (torch.randn(B, H, T, D, generator=g) * sharp).requires_grad_()
        k = torch.randn(B, H, T, D, generator=g).requires_grad_()
        v = torch.randn(B, H, T, D, generator=g).requires_grad_()
        grad_out = torch.randn(B, H, T, D, generator=g) * 1e-3
        torch.set_flush_denormal(flush)
        seconds = []
        for _ in range(35):
            start = time.perf_counter()
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad_out)
            seconds.append(time.perf_counter() - start)
        torch.set_flush_denormal(False)
        medians.append(statistics.median(seconds[5:]))
    kept, flushed = medians
    print(f"sdpa q x{sharp}: ms off {kept * 1e3:.2f} flushed {flushed * 1e3:.2f} ratio {kept / flushed:.2f}")
