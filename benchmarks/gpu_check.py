"""The GPU acceptance checks that benchmarks/gpu.sh runs: kernel parity against float64, the KV cache against the full
forward, Hugging Face DiffLlama parity, training killed with SIGKILL and resumed (plainly, under torchrun with a
real process group, and compiled), and peak memory. Each check prints one line, PASS, FAIL or SKIP with the reason
and its numbers; one check that fails (or raises) prints FAIL with its error and the others still run. The exit
status is the number of failed checks (at most 100).

One configuration, two devices: every check takes its sizes from SIZES. ``--cpu`` runs the same checks with the same
model configurations, sequence lengths and code paths on the CPU, changing only the device, the number of training
steps and the training batch (CPU_CHANGES); what needs CUDA says SKIP with its reason. make test runs it that way
(tests/test_gpu_script.py), so the GPU run's only unknown is the device itself.

Tolerances come from an error model, not constants:
- a fast method in bfloat16 or float32 may err at most FACTOR times what the standard model's own attention (SDPA)
  errs in that dtype on the same inputs (each map's queries and keys with the shared values), propagated to DIFF's
  output, q, k, v and lambda gradients;
- the cache and Hugging Face checks: DIFF's error at most FACTOR times the standard model's in the same comparison;
- training runs with deterministic algorithms, so a killed and resumed run must repeat the uninterrupted one at
  float32 rounding (RESUME_REL); a resume that lost the optimizer state or the data order moves the weights by about
  a step's change, which the check measures and requires to be far above that tolerance; the compiled run may
  differ from the eager one by at most FACTOR times what bfloat16 autocast differs from float32 over the same steps.

``--predict`` prints the GPU time each check is expected to take (an estimate from SIZES, see ``predict``).
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
# What the CPU run changes, for time only: training steps and batch.
CPU_CHANGES = {"train": dict(batch=1, steps=4)}
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


def sizes(check: str, cpu: bool) -> dict:
    """A check's sizes on this device: SIZES, with CPU_CHANGES on the CPU."""
    base = SIZES[check]
    return {**base, **(CPU_CHANGES.get(check, {}) if cpu else {})} if isinstance(base, dict) else base


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

    methods = [m for m in diff_impls(device.type) if m != "plain"]
    if cpu:
        results.skip("parity triton", "needs CUDA (tests/test_triton.py runs these tiles in Triton's interpreter)")
    for shape in SIZES["parity"]:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, grad, lam = _parity_inputs(shape, dtype)
            exact = [x.clone().requires_grad_() for x in (q, k, v, lam)]
            ref = differential_attention(*exact, scale=shape[-1] ** -0.5)[0]
            ref_grads = torch.autograd.grad(ref, exact, grad)
            budget = standard_budget(q, k, v, grad, lam, dtype, device)
            for method in methods:
                name = f"parity {method} {str(dtype)[6:]} T {shape[3]} d {shape[4]}"
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
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for c in map(int, children) for d in (c, *_descendants(c))]


def _killed_and_resumed(launch: list[str], flags: list[str], run: Path, steps: int, seed: int) -> tuple[bool, str]:
    """Start the run, SIGKILL it and every process it started (torchrun's workers have sessions of their own) at a
    random step after its first checkpoint, then resume it to the end; (whether the kill stopped it, what
    happened)."""
    from difftransformer.store.checkpoint import list_checkpoints
    from difftransformer.store.runs import METRICS

    kill_at = random.Random(seed).randint(steps // 4 + 1, max(steps // 4 + 1, steps // 2))
    proc = subprocess.Popen([*launch, *flags, "--out", str(run)])
    reached = 0
    while proc.poll() is None:
        rows = (run / METRICS).read_text().splitlines() if (run / METRICS).is_file() else []
        reached = json.loads(rows[-1])["step"] if rows else 0
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
    return True, f"killed at step {reached} (newest checkpoint {newest}), resumed"


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
    """difftx train: uninterrupted; killed with SIGKILL at a random step and resumed, plainly and under torchrun with
    a process group of one (NCCL on a GPU: the collectives run for real), each to the uninterrupted run's weights at
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
    for name, launch in (("plain", train), ("torchrun ddp, 1 process", torchrun)):
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


def peak_memory(device: torch.device, cpu: bool, results: Results) -> None:
    """Peak memory of one bfloat16 training step, DIFF (sdpa, triton) against the standard model."""
    if device.type != "cuda":
        results.skip("peak memory", "needs CUDA (torch.cuda.max_memory_allocated)")
        return
    import torch.nn.functional as F

    from difftransformer.core.config import ModelConfig
    from difftransformer.core.model import TransformerLM

    s, peaks = sizes("memory", cpu), {}
    for name, attention, impl in (("diff-sdpa", "diff", "sdpa"), ("diff-triton", "diff", "triton"),
                                  ("standard", "standard", "auto")):  # fmt: skip
        torch.manual_seed(0)
        cfg = ModelConfig.preset(s["preset"], attention=attention, attn_impl=impl, max_seq_len=s["seq"])
        model = TransformerLM(cfg).to(device)
        x = torch.randint(0, cfg.vocab_size, (s["batch"], s["seq"] + 1), device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            F.cross_entropy(model(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten()).backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        del model, x
        torch.cuda.empty_cache()
    print(f"     peak memory of a training step ({s['preset']} preset, {s['batch']} x {s['seq']}, bf16): "
          + ", ".join(f"{k} {v:.2f} GiB" for k, v in peaks.items()), flush=True)  # fmt: skip
    for name in (k for k in peaks if k != "standard"):
        ratio = peaks[name] / peaks["standard"]
        results.report(f"peak memory {name}", ratio <= 1.25, f"{ratio:.2f} x the standard model's (<= 1.25)")


# --- the GPU time each check should take ----------------------------------------------------------------------------

# Assumptions of the estimate: a process start (Python, torch, CUDA, the data) costs START s, torchrun adds TORCHRUN
# s, torch.compile of the blocks COMPILE s; a training step runs at RATE FLOP/s but no faster than STEP_FLOOR s (a
# small model's step is bound by kernel launches).
START, TORCHRUN, COMPILE, RATE, STEP_FLOOR = 15.0, 10.0, 60.0, 1e14, 0.03


def predict() -> dict[str, float]:
    """Seconds each check should take on an H100 or H200, from SIZES and the assumptions above: an estimate, stated
    in gpu.sh's header as one."""
    from difftransformer.apps.bench_machine import step_flops
    from difftransformer.core.config import ModelConfig

    s = SIZES["train"]
    cfg = ModelConfig.preset(s["preset"], max_seq_len=s["seq_len"])
    step = max(step_flops(cfg, s["batch"], s["seq_len"]) / RATE, STEP_FLOOR)
    runs = 5  # reference, plain, torchrun, compiled, float32; the killed ones redo a few steps
    starts = runs + 2  # and the two resumes
    return {
        "parity": START + 10,
        "cache": 5.0,
        "hf": 10.0,
        "train": starts * START + 2 * TORCHRUN + COMPILE + runs * s["steps"] * step * 1.25,
        "memory": 10.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the runs and results go (a new directory; required to run)")
    parser.add_argument("--cpu", action="store_true", help="on the CPU: the same checks, fewer training steps")
    parser.add_argument("--only", nargs="*", choices=CHECKS, default=None, help="run these checks only")
    parser.add_argument("--predict", action="store_true", help="print each check's predicted GPU seconds and exit")
    args = parser.parse_args()
    if args.predict:
        predicted = predict()
        print(" ".join(f"{k} {v:.0f}" for k, v in predicted.items()) + f" total {sum(predicted.values()):.0f}")
        return 0
    if args.out is None:
        parser.error("--out is required")
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # children too: the same code on the CPU, even on a GPU machine
    device = torch.device("cpu" if args.cpu else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu on a CPU", file=sys.stderr)
        return 2
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
