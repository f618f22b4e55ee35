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
from difftransformer.cache import KVCache
from difftransformer.config import ModelConfig
from difftransformer.model import TransformerLM


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


def _decode_seconds(model: TransformerLM, context: int, tokens: int) -> list[float]:
    """Seconds of each one-token decode step after a prefill of ``context`` random tokens (batch 1)."""
    cache = KVCache(context + tokens + 1)
    token = torch.randint(0, model.config.vocab_size, (1, 1))
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (1, context)), cache=cache)
        model(token, cache=cache)  # warm-up step
        times = []
        for _ in range(tokens):
            start = time.perf_counter()
            model(token, cache=cache)
            times.append(time.perf_counter() - start)
    return times


def bench_decode(contexts: list[int], preset: str = "small", tokens: int = 32, repeats: int = 3) -> dict:
    """Decode tokens/s with a KV cache, DIFF vs standard built from the same preset (batch 1)."""
    models = {}
    for attention in ("diff", "standard"):
        torch.manual_seed(0)
        cfg = ModelConfig.preset(preset, attention=attention, max_seq_len=max(contexts) + tokens + 1)
        models[attention] = TransformerLM(cfg).eval()
    rows = []
    for context in contexts:
        samples: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(repeats):  # interleaved, so that machine load hits both alike
            for name, model in models.items():
                samples[name] += _decode_seconds(model, context, tokens)
        rows.append({"context": context, "tokens_per_s": {n: 1 / statistics.median(t) for n, t in samples.items()}})
    cfg = models["diff"].config
    return {
        "benchmark": "decode",
        "machine": machine(),
        "dtype": "float32",
        "shapes": dict(
            preset=preset,
            batch=1,
            d_model=cfg.d_model,
            n_layers=cfg.n_layers,
            standard_heads=cfg.n_heads,
            diff_heads=cfg.n_heads // 2,
            head_dim=cfg.head_dim,
            new_tokens=tokens,
        ),
        "repeats": repeats,
        "rows": rows,
    }


def format_decode(result: dict) -> str:
    m, s = result["machine"], result["shapes"]
    lines = [
        f"decode benchmark: {m['cpu']}, torch {m['torch']}, {m['threads']} thread(s), {result['dtype']}",
        f"preset {s['preset']} (d_model {s['d_model']}, {s['n_layers']} layers, DIFF {s['diff_heads']} heads vs "
        f"standard {s['standard_heads']} of size {s['head_dim']}), batch 1, median over "
        f"{result['repeats']} x {s['new_tokens']} one-token steps after a prefill",
        "",
        "| context | standard tokens/s | DIFF tokens/s | DIFF / standard |",
        "|---|---|---|---|",
    ]
    for row in result["rows"]:
        t = row["tokens_per_s"]
        lines.append(f"| {row['context']} | {t['standard']:.1f} | {t['diff']:.1f} | {t['diff'] / t['standard']:.2f} |")
    return "\n".join(lines)


def write_json(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
