"""Part 3 of benchmarks/gpu.sh in one process (one Python and CUDA start): throughput in bfloat16, the attention layer
and core (padded SDPA, Triton, standard, Hugging Face's DiffLlama), training steps of the small preset, decode
tokens/s at batch 1 and 8 with each step's operation count; then CUDA's attention method chosen from the numbers.

Each benchmark prints its table and writes its JSON to --out, named after the device (``torch.cuda.get_device_name``,
or the CPU in the rehearsal); one that fails prints FAIL with its error and the others still run. The exit status is
the number that failed. ``--cpu`` is the rehearsal (gpu_check.start_rehearsal: the CUDA branch's choices on CPU
tensors) at CPU_SIZES, the same code at sizes two CPU cores run in seconds.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from pathlib import Path

# before torch, so that OpenMP's idle threads wait passively (difftransformer/threads.py)
import difftransformer  # noqa: F401

# isort: split
import torch

SIZES = {
    "attention": dict(seq=[2048, 8192], batch=4, dim=2048, heads=16, repeats=5),
    "train": dict(preset="small", seq=[2048, 8192], batch=4, repeats=5, matmul=None),
    "decode": dict(preset="small", context=[512, 4096], tokens=64, repeats=3, batches=[1, 8]),
}
CPU_SIZES = {
    "attention": dict(seq=[64, 130], batch=1, dim=128, heads=4, repeats=1),
    "train": dict(preset="tiny", seq=[32], batch=2, repeats=1, matmul=128),
    "decode": dict(preset="tiny", context=[32], tokens=4, repeats=1, batches=[1, 8]),
}
# Triton replaces padded SDPA as CUDA's method only when it is this much faster at every length (timing noise and
# one GPU's numbers are not worth a change of default for less)
SWITCH_BELOW = 0.9
DEVICES_FILE = "difftransformer/devices.py"


def device_tag(device: torch.device) -> str:
    """The result files' tag: the GPU's name (``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``), or ``cpu``."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-rehearsal"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def choose_method(attention: dict) -> tuple[str, str]:
    """(the attention method CUDA's ``auto`` should run, the lines that say why) from bench attention's core rows:
    Triton when it is at most SWITCH_BELOW times padded SDPA's forward+backward time at every length, else padded
    SDPA. Without a Triton column, padded SDPA."""
    rows = [r for r in attention["rows"] if r["direction"] == "core forward+backward"]
    if not rows or not all("triton" in r["seconds"] for r in rows):
        return "sdpa", "no Triton timing (Triton not installed or not run here): CUDA keeps padded SDPA"
    lines = []
    for r in rows:
        sec = r["seconds"]
        lines.append(
            f"  T {r['seq']}: core forward+backward, padded SDPA {sec['sdpa'] * 1e3:.2f} ms, Triton "
            f"{sec['triton'] * 1e3:.2f} ms, standard {sec['standard'] * 1e3:.2f} ms; Triton / SDPA "
            f"{sec['triton'] / sec['sdpa']:.2f}, SDPA / standard {sec['sdpa'] / sec['standard']:.2f}, Triton / "
            f"standard {sec['triton'] / sec['standard']:.2f}"
        )
    method = "triton" if all(r["seconds"]["triton"] <= SWITCH_BELOW * r["seconds"]["sdpa"] for r in rows) else "sdpa"
    return method, "\n".join(lines)


def method_lines(attention: dict) -> str:
    """The choice of CUDA's method, and the command that makes it the default."""
    from difftransformer.devices import CUDA_CHOICES

    method, why = choose_method(attention)
    lines = [f"CUDA's attention method (Triton if at most {SWITCH_BELOW:g} x padded SDPA's time at every length):", why]
    if method == CUDA_CHOICES.attention:
        lines.append(f"METHOD keep {method}: it is CUDA's default already (devices.CUDA_CHOICES)")
    else:
        lines.append(
            f"METHOD make {method} CUDA's default: sed -i 's/^CUDA_CHOICES = Choices(\"cuda\", "
            f'"{CUDA_CHOICES.attention}"/CUDA_CHOICES = Choices("cuda", "{method}"/\' {DEVICES_FILE}'
            f' (one run now: difftx train --model \'{{"attn_impl": "{method}"}}\' ...)'
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the JSON results go")
    parser.add_argument("--cpu", action="store_true", help="the rehearsal: the CUDA branch on the CPU, small sizes")
    args = parser.parse_args()
    if args.cpu:
        sys.path.insert(0, str(Path(__file__).parent))
        from gpu_check import start_rehearsal

        start_rehearsal()
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --cpu on a CPU", file=sys.stderr)
        return 2
    from difftransformer.apps import bench

    device = torch.device("cpu" if args.cpu else "cuda", None if args.cpu else torch.cuda.current_device())
    sizes, tag, dtype = CPU_SIZES if args.cpu else SIZES, device_tag(device), torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    failed, results = [], {}

    def run(name: str, file: str, make, show) -> None:
        start = time.perf_counter()
        try:
            result = make()
        except Exception as err:  # one benchmark's failure is a result; the others still run
            print(f"FAIL bench {name}: {type(err).__name__}: {err}", flush=True)
            traceback.print_exc(limit=-3)
            failed.append(name)
            return
        results[name] = result
        (args.out / f"{file}_{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(show(result), flush=True)
        print(f"PASS bench {name}: {time.perf_counter() - start:.0f} s, {file}_{tag}.json", flush=True)

    a, t, d = sizes["attention"], sizes["train"], sizes["decode"]
    run("attention", "attention", lambda: bench.bench_attention(a["seq"], a["dim"], a["heads"], a["batch"],
        a["repeats"], device=str(device), dtype=dtype), bench.format_attention)  # fmt: skip
    run("train", f"train-{t['preset']}", lambda: bench.bench_train(t["preset"], t["seq"], t["batch"], t["repeats"],
        str(device), dtype, t["matmul"]), bench.format_train)  # fmt: skip
    for batch in d["batches"]:
        run(f"decode batch {batch}", f"decode-{d['preset']}-batch{batch}", lambda b=batch: bench.bench_decode(
            d["context"], d["preset"], d["tokens"], d["repeats"], batch=b, device=str(device), dtype=dtype),
            bench.format_decode)  # fmt: skip
    if "attention" in results:
        print(method_lines(results["attention"]), flush=True)
    print(f"gpu_bench: {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}", flush=True)
    return min(len(failed), 100)


if __name__ == "__main__":
    sys.exit(main())
