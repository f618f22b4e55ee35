"""Benchmarks that print ratios measured side by side in one run (medians over interleaved repeats after warm-up)."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from difftransformer.attention import MultiheadAttention, MultiheadDiffAttn


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def median_times(fns: dict[str, Callable[[], None]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function; repeats are interleaved so drifting machine load hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_attention(
    seqs: list[int], dim: int = 512, heads: int = 8, batch: int = 1, repeats: int = 5, plain_max_seq: int = 4096
) -> dict:
    """One attention layer of width ``dim``: DIFF (heads/2 differential heads) by impl vs standard (heads heads)."""
    torch.manual_seed(0)
    layers = {impl: MultiheadDiffAttn(dim, heads // 2, 0, impl=impl) for impl in ("sdpa", "block", "plain")}
    layers["standard"] = MultiheadAttention(dim, heads, 0)
    rows = []
    for t in seqs:
        x = torch.randn(batch, t, dim)
        xg = x.clone().requires_grad_()
        names = [n for n in layers if n != "plain" or t <= plain_max_seq]
        with torch.no_grad():
            fwd = median_times({n: partial(layers[n], x) for n in names}, repeats)
        fb = median_times({n: partial(_forward_backward, layers[n], xg) for n in names}, repeats)
        for direction, res in (("forward", fwd), ("forward+backward", fb)):
            rows.append({"seq": t, "direction": direction, "seconds": res})
    return {
        "benchmark": "attention",
        "machine": machine(),
        "dtype": "float32",
        "shapes": {
            "batch": batch,
            "dim": dim,
            "standard_heads": heads,
            "diff_heads": heads // 2,
            "head_dim": dim // heads,
        },
        "repeats": repeats,
        "rows": rows,
    }


def _forward_backward(module: torch.nn.Module, x: torch.Tensor) -> None:
    module(x).sum().backward()


def format_attention(result: dict) -> str:
    m, s = result["machine"], result["shapes"]
    lines = [
        f"attention layer benchmark: {m['cpu']}, torch {m['torch']}, {m['threads']} thread(s), {result['dtype']}",
        f"batch {s['batch']}, width {s['dim']}: DIFF {s['diff_heads']} heads vs standard {s['standard_heads']} heads "
        f"of size {s['head_dim']}; medians of {result['repeats']} interleaved repeats after warm-up",
        "",
        "| T | direction | standard ms | DIFF sdpa ms | DIFF block ms | DIFF plain ms "
        "| sdpa/std | block/std | plain/std |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    impls = ("standard", "sdpa", "block", "plain")
    for row in result["rows"]:
        sec = row["seconds"]
        ms = [f"{sec[n] * 1e3:.1f}" if n in sec else "-" for n in impls]
        ratios = [f"{sec[n] / sec['standard']:.2f}" if n in sec else "-" for n in impls[1:]]
        lines.append(f"| {row['seq']} | {row['direction']} | " + " | ".join(ms + ratios) + " |")
    return "\n".join(lines)


def write_json(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
