"""The GPU acceptance checks that benchmarks/gpu.sh runs: kernel parity against float64, the KV cache against the full
forward, Hugging Face DiffLlama parity, training killed with SIGKILL and resumed (under torchrun with a process
group of one), and compiled, and peak memory (reported). Each check prints one line, PASS, FAIL or SKIP with the reason
and its numbers; one check that fails (or raises) prints FAIL with its error and the others still run. The exit
status is the number of failed checks (at most 100).

One configuration, one branch: every check takes its sizes from SIZES and runs the CUDA branch's code. ``--cpu`` is
the rehearsal: it sets ``DIFFTX_REHEARSE=cuda`` (difftransformer.devices), so that CPU tensors take the CUDA branch's
choices wherever the operation exists on the CPU: ``auto`` attention runs the padded SDPA method and decoding the
PyTorch decode path, training autocasts to bfloat16 with the fused AdamW and pins its host batches, the Triton kernels
run in Triton's interpreter at the GPU's tiles. What only a GPU can run (devices.GPU_ONLY) is printed with what runs in
its place. The rehearsal changes sizes only where the CPU would take too long (CPU_CHANGES: the training run's batch
and length, the interpreted Triton parity's lengths); make test runs it (tests/test_gpu_script.py), so the GPU run's
only unknown is the device itself.

Tolerances come from an error model, not constants:
- a fast method in bfloat16 or float32 may err at most FACTOR times what the standard model's own attention (SDPA)
  errs in that dtype on the same inputs (each map's queries and keys with the shared values), propagated to DIFF's
  output, q, k, v and lambda gradients;
- the cache and Hugging Face checks: DIFF's error at most FACTOR times the standard model's in the same comparison;
- training runs with deterministic algorithms, so a killed and resumed run must repeat the uninterrupted one at
  float32 rounding (RESUME_REL); a resume that lost the optimizer state or the data order moves the weights by about
  a step's change, which the check measures and requires to be far above that tolerance; the compiled run may
  differ from the eager one by at most FACTOR times what bfloat16 autocast differs from float32 over the same steps.

``--plan`` prints each part of gpu.sh with its predicted GPU time and its timeout (estimates from SIZES and stated
assumptions: ``plan``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

# before torch, so that OpenMP's idle threads wait passively (difftransformer/threads.py)
import difftransformer  # noqa: F401

# isort: split
import torch

# Sizes of every check, on either device. Parity: (batch, heads, KV groups, T, half-head d); the second shape
# exercises d 128's tiles and a length that is no multiple of them.
SIZES = {
    "parity": [(2, 8, 4, 1024, 64), (1, 4, 2, 1000, 128)],
    "cache": dict(preset="small", context=1024, batch=2, prompt=1000, new=24),
    "hf": dict(preset="small", context=1024, batch=2, seq=1024),
    "train": dict(preset="small", seq_len=1024, batch=16, steps=40, checkpoints=4, dtype="bfloat16"),
    "memory": dict(preset="small", seq=4096, batch=4),
}
# What the rehearsal changes, for time only (2 CPU cores): the training run's batch and length (bfloat16 matrix
# products run at about 6 GFLOP/s on a CPU without bfloat16 instructions: a step of 16 x 1024 tokens takes minutes;
# the step count, checkpoints and kill points stay), and the interpreted Triton parity's shapes (the same half-head
# sizes and the GPU's tiles, at lengths off the tiles; at the full shapes the interpreter takes about 12 minutes per
# dtype).
CPU_CHANGES = {
    "train": dict(batch=2, seq_len=64),
    "memory": dict(preset="tiny", seq=32, batch=1),  # for the unit test's fake memory statistics
    "parity triton": [(1, 2, 1, 200, 64), (1, 2, 1, 130, 128)],
}
FACTOR = 2.0  # an error may be at most this many times the standard model's in the same comparison
RESUME_REL = 2.0**-20  # float32 rounding: a few units in the last place of the largest weight
CHECKS = ("parity", "cache", "hf", "train", "memory")


class Results:
    """PASS / FAIL / SKIP lines, and the failures counted."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def report(self, name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            self.failed.append(name)

    def skip(self, name: str, why: str) -> None:
        print(f"SKIP {name}: {why}", flush=True)


def sizes(check: str, cpu: bool) -> dict | list:
    """A check's sizes on this device: SIZES, with CPU_CHANGES in the rehearsal."""
    base = SIZES[check.split()[0]]
    change = CPU_CHANGES.get(check) if cpu else None
    if isinstance(base, dict):
        return {**base, **(change or {})}
    return change or base


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64."""
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    return max_error(a, b) / float(b.detach().double().abs().max().clamp_min(1e-30))


# --- kernel parity --------------------------------------------------------------------------------------------------


def _parity_inputs(shape, dtype):
    """q, k, v, lambda and an upstream gradient, rounded to ``dtype`` and held in float64 (so that the reference's
    error is none and every method's error is its own)."""
    b, h, hkv, t, d = shape
    g = torch.Generator().manual_seed(t + d)
    q, k = torch.randn(b, h, 2, t, d, generator=g), torch.randn(b, hkv, 2, t, d, generator=g)
    v, grad = torch.randn(b, hkv, t, 2 * d, generator=g), torch.randn(b, h, t, 2 * d, generator=g)
    return [x.to(dtype).double() for x in (q, k, v, grad)] + [torch.tensor(0.6, dtype=torch.float64)]


def standard_budget(q, k, v, grad, lam, dtype, device) -> dict[str, float]:
    """How much the standard model's own attention errs in ``dtype`` on these inputs, propagated to each DIFF
    quantity: SDPA on map c's queries and keys with the shared 2d-wide values, upstream gradient g for map 1 and
    -lambda g for map 2, against float64. DIFF's output is A1 - lambda A2 (budget e1 + lambda e2), its dV sums both
    maps' (e1 + e2), dQ and dK are each map's own (the larger), and dlambda = -sum(g A2) errs like a sum of the
    terms g dA2 with random signs (their root sum of squares).

    Each budget is at least the rounding any kernel makes: one rounding of the largest value in ``dtype`` plus a
    float32 sum of T terms (sqrt(T) roundings), since kernels differ in their order of summation (SDPA's choice of
    kernel depends on the head size); for dlambda, the one value rounded in ``dtype`` plus a float32 sum of all its
    terms."""
    from difftransformer.core.attention.kernels import standard_attention

    scale, lam_f, t = q.shape[-1] ** -0.5, float(lam), q.shape[3]
    errors, maps = {"out": [], "dq": [], "dk": [], "dv": []}, []
    for c, upstream in ((0, grad), (1, -lam_f * grad)):
        exact = [x.clone().requires_grad_() for x in (q[:, :, c], k[:, :, c], v)]
        ref = standard_attention(*exact, scale=scale)[0]
        ref_grads = torch.autograd.grad(ref, exact, upstream)
        low = [x.to(device, dtype).requires_grad_() for x in (q[:, :, c], k[:, :, c], v)]
        out = standard_attention(*low, scale=scale)[0]
        grads = torch.autograd.grad(out, low, upstream.to(device, dtype))
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
            errors[name].append((max_error(got, want), float(want.detach().abs().max())))
        maps.append((out.detach().double().cpu(), ref.detach()))
    low2, ref2 = maps[1]
    terms = grad * (low2 - ref2)
    budget = {
        "out": errors["out"][0][0] + abs(lam_f) * errors["out"][1][0],
        "dq": max(e for e, _ in errors["dq"]),
        "dk": max(e for e, _ in errors["dk"]),
        "dv": sum(e for e, _ in errors["dv"]),
        "dlambda": float(terms.square().sum().sqrt()),
    }
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    rounding = {n: (eps + math.sqrt(t) * eps32) * max(m for _, m in errors[n]) for n in errors}
    # dlambda is one number (rounded once in dtype) summed from B H T 2d terms
    exact_dlambda = float((grad * ref2).sum())
    rounding["dlambda"] = eps * abs(exact_dlambda) + math.sqrt(grad.numel()) * eps32 * float((grad * ref2).abs().max())
    return {name: max(value, rounding[name]) for name, value in budget.items()}


def kernel_parity(device: torch.device, cpu: bool, results: Results) -> None:
    """Every fast method (sdpa, block, triton) in float32 and bfloat16 against the float64 equations: output and the
    gradients of q, k, v and lambda, each within FACTOR times the standard model's own error (standard_budget)."""
    from difftransformer.apps.bench import diff_impls
    from difftransformer.core.attention.diff import differential_attention, method_of
    from difftransformer.devices import GPU_ONLY

    methods = [m for m in diff_impls(device.type) if m != "plain"]
    cells = [(method, shape) for method in methods for shape in sizes(f"parity {method}", cpu)]
    for shape in dict.fromkeys(shape for _, shape in cells):
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, grad, lam = _parity_inputs(shape, dtype)
            exact = [x.clone().requires_grad_() for x in (q, k, v, lam)]
            ref = differential_attention(*exact, scale=shape[-1] ** -0.5)[0]
            ref_grads = torch.autograd.grad(ref, exact, grad)
            budget = standard_budget(q, k, v, grad, lam, dtype, device)
            for method in (m for m, at in cells if at == shape):
                name = f"parity {method} {str(dtype)[6:]} T {shape[3]} d {shape[4]}"
                if method == "triton" and cpu and dtype == torch.bfloat16:
                    results.skip(name, "on a GPU only; in the rehearsal " + GPU_ONLY["the Triton kernels in bfloat16"])
                    continue
                x = [t.to(device, dtype).requires_grad_() for t in (q, k, v)] + [
                    lam.float().to(device).requires_grad_()
                ]
                out = method_of(method)(*x, scale=shape[-1] ** -0.5)
                grads = torch.autograd.grad(out, x, grad.to(device, out.dtype))
                errors = [max_error(out, ref)] + [max_error(a, b) for a, b in zip(grads, ref_grads, strict=True)]
                ratios = [e / budget[n] for e, n in zip(errors, ("out", "dq", "dk", "dv", "dlambda"), strict=True)]
                results.report(
                    name,
                    max(ratios) <= FACTOR,
                    "error / the standard model's: out, dq, dk, dv, dlambda "
                    + " ".join(f"{r:.2f}" for r in ratios)
                    + f" (<= {FACTOR:g})",
                )


# --- the KV cache and Hugging Face ------------------------------------------------------------------------------------


def _model(preset: str, attention: str, context: int, device: torch.device):
    from difftransformer.core.config import ModelConfig
    from difftransformer.core.model import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(ModelConfig.preset(preset, attention=attention, max_seq_len=context)).to(device).eval()


def _judged(results: Results, name: str, errors: dict[str, float], what: str) -> None:
    """PASS when DIFF's relative error is at most FACTOR times the standard model's (or a float32 rounding)."""
    bound = FACTOR * max(errors["standard"], torch.finfo(torch.float32).eps)
    results.report(
        name,
        errors["diff"] <= bound,
        f"relative error of {what}: DIFF {errors['diff']:.1e}, standard {errors['standard']:.1e} (DIFF <= {bound:.1e})",
    )


def kv_cache(device: torch.device, cpu: bool, results: Results) -> None:
    """Prefill then one token at a time from the KV cache gives the full forward's logits, DIFF as the standard."""
    from difftransformer.inference.cache import KVCache

    s = sizes("cache", cpu)
    errors = {}
    for attention in ("diff", "standard"):
        model = _model(s["preset"], attention, s["context"], device)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, model.config.vocab_size, (s["batch"], s["prompt"] + s["new"]), generator=g)
        tokens = tokens.to(device)
        with torch.no_grad():
            full = model(tokens)
            cache = KVCache(model, s["batch"], s["prompt"] + s["new"])
            steps = [model(tokens[:, : s["prompt"]], cache=cache)[:, -1]]
            steps += [model(tokens[:, i : i + 1], cache=cache)[:, -1] for i in range(s["prompt"], tokens.shape[1] - 1)]
        errors[attention] = relative(torch.stack(steps, 1), full[:, s["prompt"] - 1 : -1])
    _judged(results, "kv cache", errors, f"{s['new']} cached steps after {s['prompt']} tokens vs the full forward")


def hf_parity(device: torch.device, cpu: bool, results: Results) -> None:
    """Our models and Hugging Face's with the same weights give the same logits: DIFF vs DiffLlama, judged by
    standard vs Llama."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        results.skip("hf parity", "transformers is not installed")
        return
    from difftransformer.interop.hf import to_hf

    s = sizes("hf", cpu)
    errors = {}
    for attention in ("diff", "standard"):
        model = _model(s["preset"], attention, s["context"], torch.device("cpu"))
        hf = to_hf(model).to(device).eval()
        model = model.to(device)
        g = torch.Generator().manual_seed(2)
        tokens = torch.randint(0, model.config.vocab_size, (s["batch"], s["seq"]), generator=g).to(device)
        with torch.no_grad():
            errors[attention] = relative(hf(tokens).logits, model(tokens))
    _judged(results, "hf parity", errors, f"logits at {s['seq']} tokens against transformers")


# --- training -----------------------------------------------------------------------------------------------------


def _checkpoint_weights(run: Path, index: int = -1) -> dict[str, torch.Tensor]:
    from difftransformer.store.checkpoint import list_checkpoints, load_checkpoint

    return load_checkpoint(list_checkpoints(run)[index])[0]


def weights_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference of any weight tensor."""
    return max(relative(a[name], b[name]) for name in b)


def _descendants(pid: int) -> list[int]:
    """Every process ``pid`` started, and theirs (psutil: the GPU machine's image has it, and may lack pgrep)."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _killed_and_resumed(launch: list[str], flags: list[str], run: Path, steps: int, seed: int) -> tuple[bool, str]:
    """Start the run, SIGKILL it and every process it started (torchrun's workers have sessions of their own) at a
    random step after its first checkpoint, then resume it to the end; (whether the kill stopped it, what
    happened)."""
    from difftransformer.store.checkpoint import list_checkpoints
    from difftransformer.store.runs import last_logged_step

    kill_at = random.Random(seed).randint(steps // 4 + 1, max(steps // 4 + 1, steps // 2))
    proc = subprocess.Popen([*launch, *flags, "--out", str(run)])
    reached = 0
    while proc.poll() is None:
        reached = last_logged_step(run)
        if reached >= kill_at and list_checkpoints(run):
            for pid in [*_descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break
        time.sleep(0.005)
    proc.wait()
    time.sleep(0.5)  # the killed workers' last writes, if any, are over
    newest = list_checkpoints(run)[-1].name if list_checkpoints(run) else "none"
    if proc.returncode == 0 or newest.endswith(f"{steps:08d}"):
        return False, f"the run was not stopped by the kill at step {reached} (newest checkpoint {newest})"
    subprocess.run([*launch, *flags, "--resume", str(run)], check=True)
    return (
        True,
        f"killed at step {reached} (drawn from {steps // 4 + 1} to {steps // 2}; newest checkpoint {newest}), resumed",
    )


def train_flags(s: dict, data: Path, device: torch.device) -> list[str]:
    """``difftx train``'s flags for the training check's sizes: deterministic algorithms, a checkpoint every quarter
    of the steps (kept, so that a step's change can be measured), the model's context the training length."""
    every = max(1, s["steps"] // s["checkpoints"])
    return [
        "--data", str(data), "--preset", s["preset"], "--model", json.dumps({"max_seq_len": s["seq_len"]}),
        "--seq-len", str(s["seq_len"]), "--batch-size", str(s["batch"]), "--max-steps", str(s["steps"]),
        "--ckpt-interval", str(every), "--keep-last", "0", "--log-interval", "1", "--eval-interval", str(s["steps"]),
        "--eval-tokens", str(2 * s["seq_len"]), "--warmup-steps", str(max(1, s["steps"] // 10)),
        "--dtype", s["dtype"], "--deterministic", "--quiet", "--device", str(device.type),
    ]  # fmt: skip


def training(device: torch.device, cpu: bool, results: Results, out: Path) -> None:
    """difftx train: uninterrupted; killed with SIGKILL at a random step and resumed under torchrun with
    a process group of one (NCCL on a GPU, gloo in the rehearsal; with one rank no collective communicates: this checks
    that the group starts, wraps the model, saves and resumes under it), each to the uninterrupted run's weights at
    float32 rounding; compiled, within FACTOR times the difference bfloat16 autocast makes against float32."""
    from difftransformer.apps.demo import demo_data

    s = sizes("train", cpu)
    data = demo_data(out / "data")
    flags = train_flags(s, data, device) + (["--threads", "1"] if cpu else [])
    train = [sys.executable, "-m", "difftransformer", "train"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
                "difftransformer", "train", "--parallel", "ddp"]  # fmt: skip
    runs = out / "runs"
    start = time.perf_counter()
    subprocess.run([*train, *flags, "--out", str(runs / "reference")], check=True)
    print(f"     the uninterrupted run: {time.perf_counter() - start:.0f} s", flush=True)
    reference = _checkpoint_weights(runs / "reference")
    step_change = weights_error(_checkpoint_weights(runs / "reference", -2), reference)
    results.report(
        "train resolution",
        RESUME_REL * 100 <= step_change,
        f"the weights' change over the last {s['steps'] // s['checkpoints']} steps is {step_change:.1e} (relative), "
        f"which a resume that lost the optimizer state or the data order would show; the resume tolerance is "
        f"{RESUME_REL:.1e}",
    )
    # one killed run, under torchrun (a plain run's kill and resume is the same loop, which the CPU tests cover in
    # depth; the GPU's time goes to what only it runs)
    for name, launch in (("torchrun ddp, 1 process", torchrun),):
        run = runs / name.split()[0]
        killed, what = _killed_and_resumed(launch, flags, run, s["steps"], seed=len(name))
        error = weights_error(_checkpoint_weights(run), reference)
        results.report(
            f"train {name}",
            killed and error <= RESUME_REL,
            f"{what}; final weights vs uninterrupted: {error:.1e} (<= {RESUME_REL:.1e})",
        )
    subprocess.run([*train, *flags, "--compile", "--out", str(runs / "compiled")], check=True)
    fp32 = [*flags[: flags.index("--dtype")], "--dtype", "float32", *flags[flags.index("--dtype") + 2 :]]
    subprocess.run([*train, *fp32, "--out", str(runs / "float32")], check=True)
    rounding = weights_error(_checkpoint_weights(runs / "float32"), reference)
    error = weights_error(_checkpoint_weights(runs / "compiled"), reference)
    results.report(
        "train --compile",
        error <= FACTOR * rounding,
        f"final weights vs eager: {error:.1e}; eager {s['dtype']} vs float32: {rounding:.1e} (compiled <= "
        f"{FACTOR:g} x that)",
    )


# --- memory -------------------------------------------------------------------------------------------------------


def peak_memory(device: torch.device, cpu: bool, results: Results, memory=None) -> dict[str, float] | None:
    """Peak memory of one bfloat16 training step, DIFF (padded SDPA, and Triton where it runs) against the standard
    model, in GiB: measured and reported, not judged (no bound predicted for it could be checked before a GPU has run
    it). The padded SDPA method saves about 25% more activations than the standard model by construction (bench
    train's activation columns). ``memory``: the CUDA memory statistics (``torch.cuda``; a test passes a fake)."""
    memory = memory or (torch.cuda if device.type == "cuda" else None)
    if memory is None:
        results.skip("peak memory", "needs CUDA memory statistics (bench train counts saved activations instead)")
        return None
    import torch.nn.functional as F

    from difftransformer.apps.bench import diff_impls
    from difftransformer.core.config import ModelConfig
    from difftransformer.core.model import TransformerLM

    s, peaks = sizes("memory", cpu), {}
    models = [("diff-sdpa", "diff", "sdpa")] + [("diff-triton", "diff", "triton")] * (
        "triton" in diff_impls(device.type, torch.bfloat16)
    )
    for name, attention, impl in [*models, ("standard", "standard", "auto")]:
        torch.manual_seed(0)
        cfg = ModelConfig.preset(s["preset"], attention=attention, attn_impl=impl, max_seq_len=s["seq"])
        model = TransformerLM(cfg).to(device)
        x = torch.randint(0, cfg.vocab_size, (s["batch"], s["seq"] + 1), device=device)
        memory.synchronize()
        memory.reset_peak_memory_stats()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            F.cross_entropy(model(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten()).backward()
        memory.synchronize()
        peaks[name] = memory.max_memory_allocated() / 2**30
        del model, x
        memory.empty_cache()
    ratios = ", ".join(f"{k} {v / peaks['standard']:.2f} x the standard model's" for k, v in peaks.items()
                       if k != "standard")  # fmt: skip
    print(f"MEASURED peak memory of a training step ({s['preset']} preset, {s['batch']} x {s['seq']}, bf16): "
          + ", ".join(f"{k} {v:.2f} GiB" for k, v in peaks.items()) + f"; {ratios} (reported, not judged)",
          flush=True)  # fmt: skip
    return peaks


# --- the GPU time each part should take ------------------------------------------------------------------------------

# Assumptions of the estimate (no GPU has run this script yet: estimates, stated in gpu.sh's header as such): a process
# start (Python, torch, the CUDA context) costs START s, torchrun's rendezvous TORCHRUN s more, one cold compile of a
# Triton kernel (forward, dK/dV or dQ at one half-head size and dtype) TRITON s, torch.compile of the small preset's
# blocks COMPILE s, preparing the built-in corpus DATA s (15 s on one core of the CPU this was written on); a training
# step runs at RATE FLOP/s but no faster than STEP_FLOOR s (a small model's step is bound by kernel launches). Each
# part's timeout is MARGIN times its prediction.
START, TORCHRUN, TRITON, COMPILE, DATA, RATE, STEP_FLOOR = 10.0, 10.0, 3.0, 60.0, 20.0, 1e14, 0.03
MARGIN = 1.5
# gpu.sh's parts, in order: what each runs (the part's name in gpu.sh and in --plan)
PARTS = ("GPU tests", "checks", "throughput", "study slice")


def predict() -> dict[str, float]:
    """Seconds each check of this script should take on an H100 or H200, from SIZES and the assumptions above."""
    from difftransformer.apps.bench_machine import step_flops
    from difftransformer.core.config import ModelConfig

    s = SIZES["train"]
    cfg = ModelConfig.preset(s["preset"], max_seq_len=s["seq_len"])
    step = max(step_flops(cfg, s["batch"], s["seq_len"]) / RATE, STEP_FLOOR)
    runs = 4  # reference, torchrun (killed, redoing a few steps), compiled, float32
    starts = runs + 1  # and the resume
    kernels = 3  # forward, dK/dV, dQ
    return {
        "parity": len(SIZES["parity"]) * 2 * kernels * TRITON + 10,  # each shape's half-head size, in two dtypes
        "cache": 5.0,
        "hf": 10.0,
        "train": DATA + starts * START + 2 * TORCHRUN + COMPILE + runs * s["steps"] * step * 1.25,
        "memory": 10.0 + kernels * TRITON,  # the small preset's half-head size in bfloat16
    }


def plan() -> dict[str, tuple[float, int]]:
    """(predicted seconds, timeout) of each part of gpu.sh on an H100 or H200; the study slice's timeout is what it
    needs to run (gpu.sh runs it only when that much of the budget is left)."""
    parts = {
        # pytest's start and collection, the kernels of the GPU tests that are not slow (half-heads of 16 and 32,
        # float32, causal and not: about 12); the slow ones' tiles are part 2's parity at the real shapes
        "GPU tests": START + 5 + 12 * TRITON,
        "checks": START + sum(predict().values()),
        # gpu_bench.py: one start; attention (the layer and core at T 2048 and 8192, the Triton kernels compiled
        # by part 2 already), training steps of the small preset at the same lengths, decode at batch 1 and 8
        "throughput": START + 3 * TRITON + 20 + 15 + 12,
        # repro lm --scale gpu --part sweep --steps 12: 8 runs, each a start, 12 steps and 1M evaluation tokens
        "study slice": 8 * (START + 30),
    }
    return {name: (seconds, math.ceil(MARGIN * seconds)) for name, seconds in parts.items()}


def start_rehearsal() -> None:
    """The CUDA branch on the CPU, in this process and the ones it starts: the CUDA choices (devices.rehearse), no GPU
    even on a GPU machine, Triton's interpreter (set before Triton is imported) at the GPU's tiles."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["TRITON_INTERPRET"] = "1"
    from difftransformer.core.attention import triton_diff
    from difftransformer.devices import rehearse

    rehearse("cuda")
    triton_diff.INTERPRETER_TILES = None  # the GPU's tiles (TILES), not the interpreter's small ones


def branch_report(device: torch.device) -> str:
    """The methods and settings this run takes (``devices.choices``), in words; in the rehearsal also what only a GPU
    runs and what runs in its place."""
    from difftransformer.apps.bench import auto_methods, diff_impls
    from difftransformer.devices import GPU_ONLY, choices, rehearsing

    c, methods = choices(device), auto_methods(device)
    attention, decode = methods["attention"], methods["decode"]
    triton = "triton" in diff_impls(device.type)
    triton = ("interpreted, at the GPU tiles" if device.type == "cpu" else "compiled") if triton else "not run"
    lines = [
        f"branch: {c.branch} choices on {device.type} tensors: attention auto = {attention}; decode = {decode}; "
        f"Triton {triton}; "
        f"autocast {str(c.autocast).removeprefix('torch.')}; AdamW {'fused' if c.fused_adamw else 'foreach'}; "
        f"host batches {'pinned' if c.pin_batches else 'not pinned'}; process group {c.backend}"
    ]
    if rehearsing():
        lines += ["what only a GPU runs, and what the rehearsal runs in its place:"]
        lines += [f"  - {what}: {instead}" for what, instead in GPU_ONLY.items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the runs and results go (a new directory; required to run)")
    parser.add_argument("--cpu", action="store_true", help="on the CPU: the same checks, fewer training steps")
    parser.add_argument("--only", nargs="*", choices=CHECKS, default=None, help="run these checks only")
    parser.add_argument(
        "--plan", action="store_true", help="print each part of gpu.sh: name, predicted GPU seconds, timeout; and exit"
    )
    args = parser.parse_args()
    if args.plan:
        for name, (seconds, timeout) in plan().items():
            print(f"{name}\t{seconds:.0f}\t{timeout}")
        return 0
    if args.out is None:
        parser.error("--out is required")
    if args.cpu:
        start_rehearsal()
    device = torch.device("cpu" if args.cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu on a CPU", file=sys.stderr)
        return 2
    print(branch_report(device), flush=True)
    results = Results()
    checks = {
        "parity": lambda: kernel_parity(device, args.cpu, results),
        "cache": lambda: kv_cache(device, args.cpu, results),
        "hf": lambda: hf_parity(device, args.cpu, results),
        "train": lambda: training(device, args.cpu, results, args.out),
        "memory": lambda: peak_memory(device, args.cpu, results),
    }
    predicted = predict()
    for name, check in checks.items():
        if args.only is not None and name not in args.only:
            continue
        start = time.perf_counter()
        try:
            check()
        except Exception as err:  # one check's failure is a result; the others still run
            results.report(name, False, f"{type(err).__name__}: {err}")
            traceback.print_exc(limit=-3)
        print(
            f"     ({name}: {time.perf_counter() - start:.0f} s; predicted on a GPU {predicted[name]:.0f} s)",
            flush=True,
        )
    failed = results.failed
    print(f"gpu_check: {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}", flush=True)
    return min(len(failed), 100)


if __name__ == "__main__":
    sys.exit(main())
