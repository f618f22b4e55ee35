"""The GPU acceptance checks that benchmarks/gpu.sh runs: kernel parity against float64, the KV cache against the full
forward, Hugging Face DiffLlama parity, training killed with SIGKILL and resumed (plainly, under torchrun with a
real process group, and compiled), and peak memory. Each check prints one line, PASS, FAIL or SKIP with the reason
and its numbers; the exit status is 1 when any failed.

``--dry-run`` runs the same checks on the CPU with tiny sizes (the parts that need CUDA say SKIP), so that the script
cannot rot between the rare sessions lent a GPU: make test runs it (tests/test_gpu_script.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

FAILED: list[str] = []


def report(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def skip(name: str, why: str) -> None:
    print(f"SKIP {name}: {why}", flush=True)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def kernel_parity(device: str, dry: bool) -> None:
    """Every fast method (sdpa, triton, block) in float32 and bfloat16 against the float64 materialised method:
    output and the gradients of q, k, v and lambda."""
    from difftransformer.apps.bench import diff_impls
    from difftransformer.core.attention.diff import differential_attention, method_of

    b, h, hkv, t, d = (1, 4, 2, 48, 16) if dry else (2, 8, 4, 1024, 64)
    g = torch.Generator().manual_seed(0)
    shapes = ((b, h, 2, t, d), (b, hkv, 2, t, d), (b, hkv, t, 2 * d))
    q, k, v = (torch.randn(*shape, generator=g) for shape in shapes)
    lam, grad = torch.tensor(0.6), torch.randn(b, h, t, 2 * d, generator=g)
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        # the reference: float64 on the same inputs rounded to dtype, so that the error is the method's own
        rounded = [x.to(dtype).double().requires_grad_() for x in (q, k, v)] + [lam.double().requires_grad_()]
        ref = differential_attention(*rounded, scale=d**-0.5)[0]
        ref_grads = torch.autograd.grad(ref, rounded, grad.double())
        for impl in (i for i in diff_impls(device) if i != "plain"):
            if impl == "block" and dtype == torch.bfloat16 and device == "cpu":
                continue  # the CPU block kernel is float32/float64 only
            x = [t_.to(device, dtype).requires_grad_() for t_ in (q, k, v)] + [lam.to(device).requires_grad_()]
            try:
                out = method_of(impl)(*x, scale=d**-0.5)
                grads = torch.autograd.grad(out, x, grad.to(device, out.dtype))
            except Exception as err:  # a method that fails is a result too
                report(f"parity {impl} {str(dtype)[6:]}", False, f"{type(err).__name__}: {err}")
                continue
            errors = [relative(out, ref)] + [relative(gr, rg) for gr, rg in zip(grads, ref_grads, strict=True)]
            report(
                f"parity {impl} {str(dtype)[6:]}",
                max(errors) <= tolerance,
                "relative error out/dq/dk/dv/dlambda " + " ".join(f"{e:.1e}" for e in errors) + f" (<= {tolerance})",
            )


def kv_cache(device: str, dry: bool) -> None:
    """Decoding one token at a time from the KV cache gives the full forward's logits."""
    from difftransformer.core.config import ModelConfig
    from difftransformer.core.model import TransformerLM
    from difftransformer.inference.cache import KVCache

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny" if dry else "small")).to(device).eval()
    prompt, new = (12, 6) if dry else (500, 24)
    tokens = torch.randint(0, model.config.vocab_size, (2, prompt + new), device=device)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model, 2, prompt + new)
        steps = [model(tokens[:, :prompt], cache=cache)[:, -1]]
        steps += [model(tokens[:, i : i + 1], cache=cache)[:, -1] for i in range(prompt, prompt + new - 1)]
    error = relative(torch.stack(steps, 1), full[:, prompt - 1 : prompt + new - 1])
    report("kv cache", error <= 1e-4, f"relative error of {new} cached steps against the full forward {error:.1e}")


def hf_parity(device: str, dry: bool) -> None:
    """Our model and Hugging Face's DiffLlama with the same weights give the same logits."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        skip("hf parity", "transformers is not installed")
        return
    from difftransformer.core.config import ModelConfig
    from difftransformer.core.model import TransformerLM
    from difftransformer.interop.hf import to_hf

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny" if dry else "small")).eval()
    hf = to_hf(model).to(device).eval()
    model = model.to(device)
    tokens = torch.randint(0, model.config.vocab_size, (2, 64 if dry else 1024), device=device)
    with torch.no_grad():
        error = relative(hf(tokens).logits, model(tokens))
    report("hf parity", error <= 1e-3, f"relative logit error against DiffLlama {error:.1e}")


def _final_weights(run: Path) -> dict:
    from difftransformer.store.checkpoint import list_checkpoints, load_checkpoint

    return load_checkpoint(list_checkpoints(run)[-1])[0]


def _weights_error(run: Path, reference: Path) -> float:
    a, b = _final_weights(run), _final_weights(reference)
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

    kill_at = random.Random(seed).randint(steps // 4 + 2, steps // 2)
    proc = subprocess.Popen([*launch, *flags, "--out", str(run)])
    reached = 0
    while proc.poll() is None:
        rows = (run / METRICS).read_text().splitlines() if (run / METRICS).is_file() else []
        reached = json.loads(rows[-1])["step"] if rows else 0
        if reached >= kill_at:
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


def training(device: str, dry: bool, out: Path) -> None:
    """difftx train for a few dozen steps: uninterrupted; killed with SIGKILL at a random step and resumed, plainly
    and under torchrun with a process group of one (NCCL on a GPU: the collectives run for real); compiled. Each
    one's final weights against the uninterrupted run's."""
    from difftransformer.apps.demo import demo_data

    data = demo_data(out / "data")
    steps = 16 if dry else 50
    flags = ["--data", str(data), "--max-steps", str(steps), "--ckpt-interval", str(steps // 4), "--log-interval",
             "1", "--eval-interval", str(steps), "--warmup-steps", "4", "--quiet", "--device", device]  # fmt: skip
    flags += (["--preset", "tiny", "--seq-len", "32", "--batch-size", "2", "--threads", "1", "--eval-tokens", "512"]
              if dry else
              ["--preset", "small", "--seq-len", "1024", "--batch-size", "16", "--dtype", "bfloat16"])  # fmt: skip
    train = [sys.executable, "-m", "difftransformer", "train"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
                "difftransformer", "train", "--parallel", "ddp"]  # fmt: skip
    reference = out / "runs" / "reference"
    start = time.perf_counter()
    subprocess.run([*train, *flags, "--out", str(reference)], check=True)
    print(f"     the uninterrupted run: {time.perf_counter() - start:.0f} s", flush=True)
    # bitwise on the CPU; on a GPU bfloat16 kernels (atomics in backward) need not repeat bit for bit
    tolerance = 0.0 if device == "cpu" else 2e-2
    for name, launch in (("plain", train), ("torchrun ddp, 1 process", torchrun)):
        run = out / "runs" / name.split()[0]
        killed, what = _killed_and_resumed(launch, flags, run, steps, seed=len(name))
        error = _weights_error(run, reference)
        report(f"train {name}", killed and error <= tolerance, f"{what}; final weights vs uninterrupted: {error:.1e}")
    compiled = out / "runs" / "compiled"
    subprocess.run([*train, *flags, "--compile", "--out", str(compiled)], check=True)
    error = _weights_error(compiled, reference)
    report("train --compile", error <= 5e-2, f"final weights vs eager: relative {error:.1e} (<= 5e-2)")


def peak_memory(device: str, dry: bool) -> None:
    """Peak memory of one bfloat16 training step, DIFF (sdpa, triton) against the standard model."""
    if device != "cuda":
        skip("peak memory", "needs CUDA")
        return
    import torch.nn.functional as F

    from difftransformer.core.config import ModelConfig
    from difftransformer.core.model import TransformerLM

    t, batch, peaks = 4096, 4, {}
    for name, attention, impl in (("diff-sdpa", "diff", "sdpa"), ("diff-triton", "diff", "triton"),
                                  ("standard", "standard", "auto")):  # fmt: skip
        torch.manual_seed(0)
        try:
            cfg = ModelConfig.preset("small", attention=attention, attn_impl=impl, max_seq_len=t)
            model = TransformerLM(cfg).cuda()
        except Exception as err:
            report(f"peak memory {name}", False, f"{type(err).__name__}: {err}")
            continue
        x = torch.randint(0, cfg.vocab_size, (batch, t + 1), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            F.cross_entropy(model(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten()).backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        del model, x
        torch.cuda.empty_cache()
    print(f"     peak memory of a training step (small preset, {batch} x {t}, bf16): "
          + ", ".join(f"{k} {v:.2f} GiB" for k, v in peaks.items()), flush=True)  # fmt: skip
    if "standard" in peaks:
        for name in (k for k in peaks if k != "standard"):
            ratio = peaks[name] / peaks["standard"]
            report(f"peak memory {name}", ratio <= 1.25, f"{ratio:.2f} x the standard model's")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the runs and results go")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny sizes; CUDA-only parts skipped")
    parser.add_argument("--only", nargs="*", default=None, help="run these checks only")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    checks = {
        "parity": lambda: kernel_parity(device, args.dry_run),
        "cache": lambda: kv_cache(device, args.dry_run),
        "hf": lambda: hf_parity(device, args.dry_run),
        "train": lambda: training(device, args.dry_run, args.out),
        "memory": lambda: peak_memory(device, args.dry_run),
    }
    for name, check in checks.items():
        if args.only is None or name in args.only:
            start = time.perf_counter()
            check()
            print(f"     ({name}: {time.perf_counter() - start:.0f} s)", flush=True)
    print(f"gpu_check: {len(FAILED)} failed{': ' + ', '.join(FAILED) if FAILED else ''}", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
