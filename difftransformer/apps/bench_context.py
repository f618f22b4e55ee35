"""Long context: how the time and peak memory of a prefill and of a training step grow with T, and the largest T
that fits, for our DIFF, our standard model and Hugging Face DiffLlama (its SDPA attention) on the same weights.

Each measurement runs in a child process of its own (``python -m difftransformer.apps.bench_context``), so its
peak resident memory is its own (the child's high-water mark, ``ru_maxrss``) and a T that does not fit ends that
child, not the study: the child's data segment is capped at the memory budget (RLIMIT_DATA), so an allocation
beyond it fails with torch's "not enough memory" instead of pushing the machine into swap or the OOM killer.
Before a child runs, its time and memory are predicted from the two shorter T of the same series (their growth
ratio, at least 2x per doubling): a T predicted over the budget or over ``max_seconds`` is recorded as skipped
with the prediction, not run. Every measurement is written to the store (JSON) as it finishes, and a rerun with the
same store skips what it holds: a study interrupted or split across sessions resumes where it stopped.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from difftransformer.apps.bench import _Logits, _result, trainer_optimizer, trainer_step
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.devices import host_batch
from difftransformer.errors import InputError
from difftransformer.fsutil import read_json_object, write_json
from difftransformer.inference.cache import KVCache
from difftransformer.schema import NUMBER, check

MODELS = ("diff", "standard", "hf-diffllama")
KINDS = ("prefill", "train")
DEFAULT_SEQS = [1024 * 2**i for i in range(7)]  # 1K .. 64K

# the store (schema.py's notation): bench.py's record, one row per (kind, model, T) measured, failed or skipped
_ROW = {
    "kind": str,
    "model": str,
    "seq": int,
    "fits": (bool, None),
    "seconds?": [NUMBER],
    "repeats?": int,
    "peak_rss?": int,
    "rss_before?": int,
    "skipped?": str,
    "error?": str,
}
_MEASURED = {**_ROW, "seconds": [NUMBER], "repeats": int, "peak_rss": int}
STORE_SCHEMA = {
    "benchmark": str,
    "machine": {"cpu": str, "cuda": (str, None), "torch": str, "threads": int, "python": str},
    "device": str,
    "dtype": str,
    "methods?": {"branch": str, "attention": str, "decode": str},  # what auto ran (a study started before: none)
    "shapes": {"preset": str, "batch": int},
    "repeats": int,
    "rows": [_ROW],
    "budget_bytes?": int,
}


def default_budget_bytes() -> int:
    """80% of the memory available now (MemAvailable), the rest left to the machine."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(0.8 * int(line.split()[1]) * 1024)
    except OSError:
        pass
    return 8 << 30


def bench_context(
    store: str | Path,
    preset: str = "tiny",
    seqs: list[int] | None = None,
    kinds: tuple[str, ...] = KINDS,
    models: tuple[str, ...] = MODELS,
    batch: int = 1,
    repeats: int = 2,
    budget_bytes: int | None = None,
    max_seconds: float = 1800.0,
    threads: int = 1,
) -> dict:
    """Run (or resume) the sweep into ``store`` and return its record. Each (kind, model, T) is measured once: a
    child process that builds the model, warms it up on 256 tokens and times ``repeats`` runs at T. A skip is a
    prediction, not a measurement: a rerun decides it again (with a larger ``max_seconds`` or budget, it runs)."""
    seqs = sorted(seqs or DEFAULT_SEQS)
    if importlib.util.find_spec("transformers") is None:  # optional: HF DiffLlama is left out, and the table says so
        models = tuple(n for n in models if n != "hf-diffllama")
    budget = budget_bytes or default_budget_bytes()
    store = Path(store)
    result = _open_store(store, preset, batch)
    result["rows"] = [e for e in result["rows"] if "skipped" not in e]
    if result["rows"]:  # the documented continuation: said, with what is kept
        print(f"bench context: continuing the study in {store} ({len(result['rows'])} measurements kept)",
              file=sys.stderr, flush=True)  # fmt: skip
    for kind in kinds:
        for model in models:
            series = [e for e in result["rows"] if e["kind"] == kind and e["model"] == model]
            for t in seqs:
                if any(e["seq"] == t for e in series):
                    continue  # measured in an earlier run of this study
                entry = _skip_reason(series, t, budget, max_seconds) or _measure(
                    dict(kind=kind, model=model, preset=preset, seq=t, batch=batch, repeats=repeats, threads=threads),
                    budget,
                )
                entry = {"kind": kind, "model": model, "seq": t, **entry}
                series.append(entry)
                result["rows"].append(entry)
                result["budget_bytes"] = budget
                write_json(store, result, indent=1)
                print(_entry_line(entry), file=sys.stderr, flush=True)
    return result


def _open_store(store: Path, preset: str, batch: int) -> dict:
    if store.exists():
        result = read_json_object(store)
        if result.get("benchmark") == "context":  # another benchmark's record is refused below, as not this study
            fix = "choose another --json path to start a new study"
            check(result, STORE_SCHEMA, str(store), fix)
            for row in result["rows"]:
                if "seconds" in row or "peak_rss" in row:  # a measurement: its numbers are all there
                    where = f"{store} (its row {row['kind']} {row['model']} T={row['seq']})"
                    if not check(row, _MEASURED, where, fix)["seconds"]:
                        raise InputError(f"{where} is damaged: seconds is empty; {fix}")
        if result.get("benchmark") != "context" or result.get("shapes") != {"preset": preset, "batch": batch}:
            raise InputError(
                f"{store} holds another study ({result.get('benchmark')}, {result.get('shapes')}), not the context "
                f"benchmark of preset {preset} at batch {batch}: choose another --json path to start this one"
            )
        return result
    return _result("context", {"preset": preset, "batch": batch}, 0, [])


def _skip_reason(series: list[dict], t: int, budget: int, max_seconds: float) -> dict | None:
    """None when T should run; else the entry saying why it is not run: a shorter T did not fit, or the growth of
    the two longest shorter T measured (time and memory as T^alpha, alpha at least 1) predicts more memory than
    the budget or more time than max_seconds."""
    done = sorted((e for e in series if e["seq"] < t), key=lambda e: e["seq"])
    failed = [e["seq"] for e in done if e["fits"] is False]  # out of memory, measured or predicted (None: time)
    if failed:
        return {"fits": False, "skipped": f"a shorter T ({failed[0]}) did not fit"}
    measured = [e for e in done if "seconds" in e]
    if not measured:
        return None
    last = measured[-1]
    alpha_t = alpha_m = 1.0  # growth exponents: at least linear in T
    if len(measured) >= 2:
        prev, span = measured[-2], math.log(last["seq"] / measured[-2]["seq"])
        alpha_t = max(1.0, math.log(min(last["seconds"]) / min(prev["seconds"])) / span)
        alpha_m = max(1.0, math.log(last["peak_rss"] / prev["peak_rss"]) / span)
    ahead = t / last["seq"]
    memory = last["peak_rss"] * ahead**alpha_m
    seconds = min(last["seconds"]) * ahead**alpha_t * last["repeats"]
    if memory > budget:
        return {"fits": False, "skipped": f"predicted peak {memory / 2**30:.1f} GiB > budget {budget / 2**30:.1f} GiB"}
    if seconds > max_seconds:
        return {"fits": None, "skipped": f"predicted {seconds:.0f} s > --max-seconds {max_seconds:.0f}"}
    return None


def _measure(job: dict, budget: int) -> dict:
    cmd = [sys.executable, "-m", "difftransformer.apps.bench_context", json.dumps(job), str(budget)]
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"])}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])  # measured, or out of memory within the budget
    if done.returncode < 0:  # a signal: the kernel's OOM killer (SIGKILL) when the budget was above what is free
        return {"fits": False, "error": f"the measuring process was killed by signal {-done.returncode}"}
    raise RuntimeError(f"bench context: measuring {job} failed:\n{done.stderr.strip()[-2000:]}")


def _entry_line(e: dict) -> str:
    what = f"context {e['kind']} {e['model']} T={e['seq']}"
    if "seconds" in e:
        return f"{what}: {min(e['seconds']):.2f} s, peak {e['peak_rss'] / 2**30:.2f} GiB"
    return f"{what}: {e.get('skipped') or e.get('error')}"


# ---- the child: one measurement ---------------------------------------------------------------------------------


def _child(job: dict, budget: int) -> dict:
    """Build the model, warm it up (256 tokens at most), time ``repeats`` runs at T; peak RSS is this process's
    high-water mark. Out of memory is a result (the T does not fit); any other error ends the child with it."""
    resource.setrlimit(resource.RLIMIT_DATA, (budget, budget))
    torch.set_num_threads(job["threads"])
    seconds = []
    try:  # the model, its warm-up and the runs: any of them can meet the cap
        model = _build(job["model"], job["preset"], job["seq"])
        run = _prefill if job["kind"] == "prefill" else _train(model)
        run(model, min(256, job["seq"]), job["batch"])  # warm-up: the kernel loaded, the allocator primed
        gc.collect()
        before = _rss_now()
        for _ in range(job["repeats"]):
            start = time.perf_counter()
            run(model, job["seq"], job["batch"])
            seconds.append(time.perf_counter() - start)
    except (RuntimeError, MemoryError) as err:
        if "memory" not in str(err).lower():
            raise
        return {"fits": False, "error": f"out of memory within the {budget / 2**30:.1f} GiB budget"}
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, _rss_now())
    return {"fits": True, "seconds": seconds, "repeats": job["repeats"], "peak_rss": peak, "rss_before": before}


def _build(name: str, preset: str, t: int):
    torch.manual_seed(0)
    attention = "standard" if name == "standard" else "diff"
    model = TransformerLM(ModelConfig.preset(preset, attention=attention, max_seq_len=t + 1))
    if name == "hf-diffllama":
        from difftransformer.interop.hf import to_hf

        model = to_hf(model)
        model.config._attn_implementation = "sdpa"
    return model


def _prefill(model, t: int, batch: int) -> None:
    """A prompt of t tokens through the model, filling its cache (ours: a KVCache of t slots; HF: its own)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, t))
    model.eval()
    with torch.no_grad():
        if isinstance(model, TransformerLM):
            model(ids, cache=KVCache(model, batch, t))
        else:  # transformers: its own cache
            model(ids, use_cache=True)


def _train(model):
    """A training step as the trainer takes it (float32, its AdamW), on ``batch`` rows of t tokens."""
    lm = model if isinstance(model, TransformerLM) else _Logits(model)  # transformers: logits out, as ours
    optimizer, vocab = trainer_optimizer(lm), model.config.vocab_size

    def step(_, t: int, batch: int) -> None:
        lm.train()
        trainer_step(lm, optimizer, host_batch(torch.randint(0, vocab, (batch, t + 1))))  # t tokens in, t targets

    return step


def _rss_now() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


# ---- the report --------------------------------------------------------------------------------------------------


def format_context(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"context benchmark: {m['cpu']}, torch {m['torch']}, float32, preset {result['shapes']['preset']}, batch "
        f"{result['shapes']['batch']}; each cell one child process: seconds of each repeat (min-max), peak RSS of the "
        f"process (model, optimizer and the step's buffers); budget {result.get('budget_bytes', 0) / 2**30:.1f} GiB",
    ]
    for kind in KINDS:
        rows = [e for e in result["rows"] if e["kind"] == kind]
        if not rows:
            continue
        models = [n for n in MODELS if any(e["model"] == n for e in rows)]
        lines += ["", f"{kind}:", "", "| T | " + " | ".join(f"{n} s | {n} GiB" for n in models) + " |"]
        lines.append("|---|" + "---|---|" * len(models))
        for t in sorted({e["seq"] for e in rows}):
            cells = []
            for n in models:
                e = next((e for e in rows if e["model"] == n and e["seq"] == t), None)
                cells.append(_cells(e))
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        largest = {n: max((e["seq"] for e in rows if e["model"] == n and e["fits"]), default=None) for n in models}
        lines += ["", "largest T that ran: " + ", ".join(f"{n} {t}" for n, t in largest.items())]
    return "\n".join(lines)


def _cells(e: dict | None) -> str:
    if e is None:
        return "- | -"
    if "seconds" in e:
        lo, hi = min(e["seconds"]), max(e["seconds"])
        return f"{lo:.2f}-{hi:.2f} | {e['peak_rss'] / 2**30:.2f}"
    return f"{'skipped' if 'skipped' in e else 'did not fit'} | -"


def figure(result: dict, path: str | Path) -> None:
    """Log-log: seconds and peak RSS against T, one line per (kind, model)."""
    from difftransformer.apps.figures import finish, pyplot

    plt = pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, style in zip(KINDS, ("-", "--"), strict=True):
        for n in MODELS:
            pts = sorted((e["seq"], min(e["seconds"]), e["peak_rss"]) for e in result["rows"]
                         if e["kind"] == kind and e["model"] == n and "seconds" in e)  # fmt: skip
            if pts:
                ts, secs, mem = zip(*pts, strict=True)
                ax_t.plot(ts, secs, style, marker="o", label=f"{n} {kind}")
                ax_m.plot(ts, [x / 2**30 for x in mem], style, marker="o", label=f"{n} {kind}")
    for ax, what in ((ax_t, "seconds"), (ax_m, "peak RSS, GiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    s, m = result["shapes"], result["machine"]  # the machine that measured, not the one that draws
    threads = f"{m['threads']} thread{'' if m['threads'] == 1 else 's'}"
    finish(fig, Path(path), f"Long context, preset {s['preset']}, batch {s['batch']}, {m['cpu']}, {threads}")


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]), int(sys.argv[2]))))
