"""What the PyTorch block method and the PyTorch decode are for: the cases the fused CPU kernel does not take
(bfloat16, no compiler, torch.compile's training graphs, other devices) fall back to them; the alternative would be
the padded SDPA path. This times both on the CPU, kernel off, for one differential attention layer's core (q, k, v
already projected, the small preset's shapes: 4 differential heads of half-size 32, batch 4):

- training: forward and backward at T = 256 and 512, block (PyTorch) against sdpa, float32 and bfloat16;
- decoding: one query row against a cache of 512 and 2048, no gradient, the PyTorch decode against sdpa;
- training in bfloat16 with 2 heads of half-size 64 (the same width) at T = 128, 256 and 512.

Medians of 15 interleaved repeats after a warm-up, 1 thread. Usage: python measure.py > output.md (a Markdown table)."""

import platform
import statistics
import time

# before torch, so that OpenMP's idle threads wait passively
import difftransformer  # noqa: F401

# isort: split
import torch

from difftransformer.core.attention import kernels

torch.set_num_threads(1)
B = 4


def inputs(t_q, t_k, dtype, grad, h=4, d=32):
    torch.manual_seed(0)
    q = torch.randn(B, h, 2, t_q, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, h, 2, t_k, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, h, t_k, 2 * d, dtype=dtype, requires_grad=grad)
    return q, k, v


def train_call(method, dtype, t, h=4, d=32):
    q, k, v = inputs(t, t, dtype, True, h, d)
    lam = torch.tensor(0.5)

    def run():
        out = method(q, k, v, lam, scale=d**-0.5, causal=True, mask=None)
        out.float().sum().backward()

    return run


def decode_call(method, dtype, t):
    q, k, v = inputs(1, t, dtype, False)
    lam = torch.tensor(0.5)

    def run():
        with torch.no_grad():
            method(q, k, v, lam, scale=32**-0.5, causal=False, mask=None)

    return run


def timed(calls: dict, repeats=15) -> dict:
    for run in calls.values():
        run()
    seconds = {name: [] for name in calls}
    for _ in range(repeats):
        for name, run in calls.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def torch_decode(q, k, v, lam, *, scale, causal, mask):
    return kernels._diff_decode_torch(q, k, v, lam, scale, causal, mask)


def row(case: str, dtype: torch.dtype, t: int, seconds: dict, ours: str, digits: int) -> str:
    mine, sdpa = seconds[ours] * 1e3, seconds["sdpa"] * 1e3
    name = str(dtype).removeprefix("torch.")
    return f"| {case} | {name} | {t} | {mine:.{digits}f} | {sdpa:.{digits}f} | {sdpa / mine:.2f} |"


machine = platform.processor() or platform.machine()
print(f"{machine}, torch {torch.__version__}, 1 thread, the PyTorch methods called directly")
print("| case | dtype | T | PyTorch method ms | sdpa ms | sdpa / PyTorch |")  # half-size 32 unless said
print("|---|---|---|---|---|---|")
for dtype in (torch.float32, torch.bfloat16):
    for t in (256, 512):
        s = timed({"block": train_call(kernels._block_torch, dtype, t), "sdpa": train_call(kernels._sdpa, dtype, t)})
        print(row("training (block)", dtype, t, s, "block", 2))
    for t in (512, 2048):
        s = timed({"decode": decode_call(torch_decode, dtype, t), "sdpa": decode_call(kernels._sdpa, dtype, t)})
        print(row("decoding", dtype, t, s, "decode", 3))
for t in (128, 256, 512):
    methods = (("block", kernels._block_torch), ("sdpa", kernels._sdpa))
    s = timed({name: train_call(method, torch.bfloat16, t, h=2, d=64) for name, method in methods})
    print(row("training (block), half-size 64", torch.bfloat16, t, s, "block", 2))
