"""How a step scales with CPU threads: the same work timed at 1 and at N threads, interleaved in one run."""

from __future__ import annotations

from functools import partial

import torch

from difftransformer.apps.bench import (
    _Calls,
    _core_diff,
    _core_inputs,
    _core_standard,
    _result,
    median_times,
    trainer_optimizer,
    trainer_step,
)
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.devices import host_batch


def _at(threads: int, fn) -> None:
    torch.set_num_threads(threads)
    fn()


def bench_threads(
    threads: int = 2,
    seqs: list[int] | None = None,
    batches: list[int] | None = None,
    preset: str = "small",
    core_seq: int = 4096,
    repeats: int = 3,
) -> dict:
    """Seconds of each piece of work at 1 and at ``threads`` threads: the attention core forward + backward (batch 1,
    T = ``core_seq``, width 512 in 8 standard heads as ``bench attention``: our DIFF's fused block kernel and the
    standard model's SDPA) and a training step (forward, backward, AdamW) of the ``preset`` DIFF and standard
    models at each batch and T. Repeats alternate the thread counts so that drifting load hits both alike."""
    seqs, batches = seqs or [1024, 4096], batches or [1, 4]
    counts = (1, threads)
    before = torch.get_num_threads()
    rows = []
    n_calls = (2 + 2 * len(seqs) * len(batches)) * len(counts) * (1 + repeats)
    try:
        with _Calls.tracking("threads", n_calls):
            core = _core_inputs(1, 8, 64, core_seq, "cpu", torch.float32)
            work = {
                "standard": partial(_core_standard, *core["standard"]),
                "diff": partial(_core_diff, "block", *core["diff"]),
            }
            rows.append(_row("attention core forward+backward", 1, core_seq, work, counts, repeats))
            for batch in batches:
                for t in seqs:
                    rows.append(_row("training step", batch, t, _steps(preset, batch, t), counts, repeats))
    finally:
        torch.set_num_threads(before)
    shapes = {"preset": preset, "core": {"batch": 1, "dim": 512, "standard_heads": 8, "diff_heads": 4}}
    return _result("threads", {**shapes, "threads": list(counts)}, repeats, rows)


def _steps(preset: str, batch: int, t: int) -> dict:
    """A training step of the DIFF and the standard model (as bench train builds them) on one random batch."""
    fns = {}
    x = None
    for attention in ("diff", "standard"):
        torch.manual_seed(0)
        model = TransformerLM(ModelConfig.preset(preset, attention=attention, max_seq_len=t))
        x = host_batch(torch.randint(0, model.config.vocab_size, (batch, t + 1))) if x is None else x  # t tokens in
        fns[attention] = partial(trainer_step, model, trainer_optimizer(model), x)
    return fns


def _row(what: str, batch: int, t: int, work: dict, counts: tuple[int, int], repeats: int) -> dict:
    fns = {f"{name}@{n}": partial(_at, n, fn) for name, fn in work.items() for n in counts}
    seconds = median_times(fns, repeats)
    return {
        "what": what,
        "batch": batch,
        "seq": t,
        "seconds": {name: {str(n): seconds[f"{name}@{n}"] for n in counts} for name in work},
    }


def format_threads(result: dict) -> str:
    one, many = (str(n) for n in result["shapes"]["threads"])
    lines = [
        result_title(result),
        f"the same work at {one} and {many} threads, interleaved; medians of {result['repeats']} repeats after a "
        f"warm-up. core = bench attention's core (batch 1, width 512: DIFF 4 heads with the fused block kernel, "
        f"standard 8 heads with SDPA); training step = preset {result['shapes']['preset']}, forward + backward + "
        f"AdamW",
        "",
        f"| work | batch | T | DIFF {one}t ms | DIFF {many}t ms | DIFF {many}t/{one}t | standard {one}t ms | "
        f"standard {many}t ms | standard {many}t/{one}t |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        d, s = row["seconds"]["diff"], row["seconds"]["standard"]
        lines.append(
            f"| {row['what']} | {row['batch']} | {row['seq']} | {d[one] * 1e3:.0f} | {d[many] * 1e3:.0f} | "
            f"{d[many] / d[one]:.2f} | {s[one] * 1e3:.0f} | {s[many] * 1e3:.0f} | {s[many] / s[one]:.2f} |"
        )
    return "\n".join(lines)


def result_title(result: dict) -> str:
    m = result["machine"]
    return f"threads benchmark: {m['cpu']}, torch {m['torch']}, float32"
