"""`difftx repro lm --part long`: which variant a small-scale user should train, from models trained past their
first steps (at least 20 tokens per non-embedding parameter, heads at least 32 wide, context 512).

One size, the variants of ``LONG_VARIANTS``, each at its own tuned learning rate, in four stages that each continue
where an interrupted study stopped (the same command again):

1. ``init``: the attention blocks' output RMS at initialisation of the standard and DIFF models of every seed
   (``lm_blocks``), and from them the initial per-head-norm gain that gives DIFF's attention blocks the standard
   model's output RMS (``diff-norm-gain``; this library's option, not the paper's), in ``LONG_INIT``;
2. ``tune``: every variant at the plan's learning rates, ``tune_seeds`` seeds, a quarter of the budget; a variant whose
   best rate (the lowest mean loss over the seeds) is at an edge of its grid gets the next rate beyond it (a factor
   of 2), until the best is inside (or the grid holds ``MAX_RATES``);
3. ``long``: every variant at its rate (the unmatched V2 at the matched V2's), every seed, the whole budget,
   validated ``evals`` times on the same held-out windows, with the block statistics at ``diagnose_at``;
4. ``timing``: the seconds per step of every variant, one at a time and nothing else of the study running, one
   thread, interleaved repeats, in ``LONG_TIMING``.

The runs, their measurements and the report live in the same study directory as the short-budget parts (``lm``):
the same prepared corpus, ``runs/`` and ``measures/``, and one report (``lm_report.write``); the stages run
from ``lm_study.run_long``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from difftransformer.apps.repro import lm
from difftransformer.apps.repro.lm_blocks import block_stats
from difftransformer.core.attention.gqa_layout import own_layout
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM, count_parameters
from difftransformer.errors import InputError
from difftransformer.fsutil import open_plan, read_json_object, write_text_atomic
from difftransformer.store.checkpoint import list_checkpoints, load_checkpoint
from difftransformer.store.data import TokenData, WindowSampler, eval_windows
from difftransformer.store.runs import METRICS
from difftransformer.training.config import resume_config
from difftransformer.training.distributed import load_full_state
from difftransformer.training.loop import Trainer
from difftransformer.training.step import autocast_dtype, lr_at, make_optimizer, optimizer_step

LONG = lm.LONG_PLAN  # the plan
LONG_INIT = "long_init.json"  # stage 1: the initial attention RMS and the gain chosen from it
LONG_TIMING = "long_timing.json"  # stage 4
BLOCKS = "blocks.jsonl"  # in a long run's directory: the block statistics at each diagnostic step
SIZE = "X"  # the one size of the long part
MAX_RATES = 8  # a variant's learning-rate grid grows to at most this many rates
RATE_FACTOR = 2.0

# name: (attention, ModelConfig options); the plan adds the options that depend on the size or on a measurement
# (``LongScale.options``): the matched V2's feed-forward width and the gain of ``diff-norm-gain``
LONG_VARIANTS: dict[str, tuple[str, dict]] = {
    "standard": ("standard", {}),
    "diff": ("diff", {}),
    "diff-no-head-norm": ("diff", {"head_norm": False}),
    "diff_v2-matched": ("diff_v2", {}),
    "diff_v2": ("diff_v2", {}),
    "standard-head-norm": ("standard", {"head_norm": True}),
    "diff-norm-gain": ("diff", {}),
}
UNTUNED = {"diff_v2": "diff_v2-matched"}  # trained at another variant's tuned rate (shown beside it, once)
TUNED = tuple(v for v in LONG_VARIANTS if v not in UNTUNED)
DIAGNOSED = ("standard", "diff", "diff-no-head-norm", "diff-norm-gain", "standard-head-norm")


@dataclass(frozen=True)
class LongScale(lm.Scale):
    """The long part's plan: one size (``sizes[SIZE]``), ``steps`` = (the budget, the tuning runs' quarter of it)."""

    evals: int = 25  # validations during a long run
    curve_tokens: int = 1 << 15  # held-out tokens of each of them (the same windows every time)
    diagnose_at: tuple[float, ...] = (0.0, 0.005, 0.02, 0.1, 0.3, 0.6, 1.0)  # fractions of the budget: block stats
    diagnose_windows: int = 4  # of the curve's windows, the first ones
    tune_seeds: int = 2
    options: dict = field(default_factory=dict)  # variant -> ModelConfig options the plan decided
    rationale: str = ""  # why this size, for the report

    def attention(self, variant: str) -> str:
        return LONG_VARIANTS[variant][0]

    def model_options(self, variant: str) -> dict:
        return {**LONG_VARIANTS[variant][1], **self.options.get(variant, {})}

    def schedule(self, steps: int) -> dict:
        """A long run is validated ``evals`` times on ``curve_tokens``; a tuning run once, at its end."""
        if steps == self.steps[0]:
            return {"eval_interval": max(1, steps // self.evals), "eval_tokens": self.curve_tokens}
        return {"eval_interval": steps, "eval_tokens": self.curve_tokens}

    def diagnostic_steps(self) -> list[int]:
        return sorted({round(f * self.steps[0]) for f in self.diagnose_at})

    def fit(self, trainer: Trainer) -> None:
        """A long run trains in segments that end at the diagnostic steps, where the block statistics are appended
        to ``BLOCKS`` (measuring leaves the training untouched); a step already passed when a resumed run starts
        is not measured again (the report names it missing)."""
        if trainer.cfg.max_steps != self.steps[0]:
            trainer.fit()
            return
        path = trainer.run_dir / BLOCKS
        done = {row["step"] for row in _jsonl(path)}
        windows = trainer.val_windows[: self.diagnose_windows].to(trainer.world.device)
        for step in self.diagnostic_steps():
            if step < trainer.step_idx or step in done:
                continue
            if step > trainer.step_idx:
                trainer.fit(until=step)
            row = {"step": step, "layers": block_stats(trainer.model, windows)}
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
        trainer.fit()

    def extra_measures(self, run_dir: Path) -> dict:
        """A run's validation curve (step, tokens, loss) and, for a long run, its block statistics."""
        rows = {}
        for row in _jsonl(run_dir / METRICS):
            if "val_loss" in row:
                rows[row["step"]] = row  # a step trained again after a kill: its last row
        curve = [[s, r["tokens"], r["val_loss"]] for s, r in sorted(rows.items())]
        blocks = {row["step"]: row["layers"] for row in _jsonl(run_dir / BLOCKS)}
        planned = self.diagnostic_steps() if (run_dir / BLOCKS).is_file() else []
        return {
            "curve": curve,
            "blocks": [{"step": s, "layers": blocks[s]} for s in sorted(blocks)],
            "blocks_missing": [s for s in planned if s not in blocks],
        }


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written when the process was killed
            continue
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)]


PLANS = {
    # Width 64 with heads of 32 (2 standard heads, 1 differential head), 5 layers: 267k non-embedding parameters
    # (288k for the unmatched V2), so that 20 tokens per parameter for every variant (1407 steps of 8 x 512 tokens,
    # 5.76M) are one pass over the corpus's 5.7M training tokens; a sixth layer would repeat text, and width 128
    # (4 heads) would need 1.5 passes or more.
    "cpu": LongScale(
        name="cpu-long",
        sizes={SIZE: (64, 5, 2)},
        reference=SIZE,
        seq_len=512,
        batch_size=8,
        steps=(1407, 351),
        **lm.ON_CPU,
        ckpt_every=100,
        rationale="Width 64 with heads of 32 (the paper matches DIFF's half-heads to the standard model's heads) "
        "leaves 2 standard heads and 1 differential head per layer. At 20 tokens per non-embedding parameter, 5 "
        "layers (267k parameters, 288k for the unmatched V2) take one expected pass over this corpus's 5.7M "
        "training tokens (windows drawn with replacement: some text is seen twice, some never); a sixth layer "
        "would take 1.2 passes, width 128 with 4 heads 1.5 passes or more and about 3.5 times the compute per "
        "run, beyond the 10-hour budget of the 48 tuning runs and 21 long runs. What this regime cannot "
        "answer: the paper's scale (0.8B-13B parameters) and its advice of 8 or more differential heads; here "
        "DIFF has one per layer.",
    ),
    # One GPU, bf16: width 256, heads of 64 (4 standard, 2 differential), 4 layers, 3.2M non-embedding parameters
    # (3.5M for the unmatched V2), 20 tokens per parameter (2125 steps of 32 x 1024 tokens, 70M): give a corpus of
    # that size (CORPORA in benchmarks/lm_gpu.sh); the default one (about 5M tokens here) is repeated 14 times.
    "gpu": LongScale(
        name="gpu-long",
        sizes={SIZE: (256, 4, 4)},
        reference=SIZE,
        seq_len=1024,
        batch_size=32,
        steps=(2125, 531),
        eval_tokens=1 << 18,
        **lm.ON_GPU,
        ckpt_every=250,
        curve_tokens=1 << 17,
        rationale="The CPU plan at 4 times the width with heads twice as wide (4 standard heads of 64, 2 differential "
        "heads with 64-wide halves per layer) and 4 layers, at 20 tokens per non-embedding parameter; on the default "
        "corpus it repeats text 14 times, so give a corpus of 70M tokens or more.",
    ),
}


# the plan ----------------------------------------------------------------------------------------------------------
def matched_ffn_dim(plan: LongScale) -> int:
    """The feed-forward width at which DIFF V2 has the standard model's non-embedding parameters (V2's doubled
    query heads and lambda projection cost d_model * (d_model + heads) per layer; each unit of width costs
    3 * d_model per layer)."""
    d_model, n_layers, _ = plan.sizes[SIZE]
    standard = count_parameters(_config(plan, "standard"), exclude_embeddings=True)
    v2_cfg = _config(plan, "diff_v2")
    excess = count_parameters(v2_cfg, exclude_embeddings=True) - standard
    return v2_cfg.ffn_dim - round(excess / (3 * d_model * n_layers))


def _config(plan: LongScale, variant: str) -> ModelConfig:
    """The ModelConfig of ``variant`` in ``plan``, as its runs build it (``TrainConfig.model_config``; built here
    without a TrainConfig, which would refuse a plan's device that this machine lacks)."""
    overrides = lm.Run(SIZE, plan.steps[0], variant, 1e-3, 0).model_overrides(plan)
    return ModelConfig.preset("tiny", attention=plan.attention(variant), **overrides, vocab_size=plan.vocab_size)


def tuning(plan: LongScale, measures: dict[str, dict]) -> dict[str, dict]:
    """Each tuned variant's learning-rate grid as far as the measured runs have grown it: {variant: {rates,
    losses (rate -> [loss per seed] of the measured runs), best (None until every run of the grid is measured),
    at_edge, done}}."""
    return {
        v: grown_grid(plan.lrs, lambda rates, v=v: _tune_runs(plan, v, rates), measures, plan.tune_seeds, MAX_RATES)
        for v in TUNED
    }


def grown_grid(first: tuple[float, ...], runs_of, measures: dict[str, dict], seeds: int, max_rates: int) -> dict:
    """A learning-rate grid grown from the rates ``first`` as far as the measured runs allow: while the best rate
    (the lowest mean loss over the ``seeds`` runs of each rate, ``runs_of([rate])``) is at an edge, the next rate
    beyond it (a factor of ``RATE_FACTOR``), up to ``max_rates`` rates. {rates, losses (rate -> [loss per measured
    seed]), best (None until every run of the grid is measured), at_edge, done}."""
    rates = list(first)
    while True:
        losses = {}
        for lr in rates:
            found = [measures[r.name]["val"]["loss"] for r in runs_of([lr]) if r.name in measures]
            if found:
                losses[lr] = found
        complete = all(len(losses.get(lr, [])) == seeds for lr in rates)
        best = min(rates, key=lambda lr: statistics.fmean(losses[lr])) if complete else None
        edge = best is not None and best in (rates[0], rates[-1])
        if not edge or len(rates) >= max_rates:
            break
        rates = [rates[0] / RATE_FACTOR, *rates] if best == rates[0] else [*rates, rates[-1] * RATE_FACTOR]
    return {"rates": rates, "losses": losses, "best": best, "at_edge": edge, "done": best is not None}


def _tune_runs(plan: LongScale, variant: str, rates: list[float]) -> list[lm.Run]:
    return [lm.Run(SIZE, plan.steps[1], variant, lr, s) for lr in rates for s in range(plan.tune_seeds)]


def tune_runs(plan: LongScale, state: dict[str, dict]) -> list[lm.Run]:
    return [r for v, st in state.items() for r in _tune_runs(plan, v, st["rates"])]


def best_rates(state: dict[str, dict]) -> dict[str, float]:
    """Every long variant's learning rate (the untuned ones at their model's); refused until tuning is done."""
    pending = [v for v, st in state.items() if not st["done"]]
    if pending:
        raise InputError(f"the learning-rate tuning of {', '.join(pending)} is not complete")
    rates = {v: st["best"] for v, st in state.items()}
    return {v: rates[UNTUNED.get(v, v)] for v in LONG_VARIANTS}


def long_runs(plan: LongScale, rates: dict[str, float], seeds: list[int]) -> list[lm.Run]:
    return [lm.Run(SIZE, plan.steps[0], v, rates[v], s) for v in LONG_VARIANTS for s in seeds]


# stage 1: the initial attention RMS and the gain ------------------------------------------------------------------
def initial_gain(plan: LongScale, data: Path, seeds: list[int]) -> dict:
    """The attention blocks' output RMS per layer at initialisation (standard and DIFF, each seed, on the long runs'
    diagnostic windows) and the gain that matches DIFF's to the standard model's: the geometric mean over layers
    and seeds of their ratio, to 2 significant digits (the block's output is linear in the norm's weight)."""
    val = TokenData(data, "val")
    windows = eval_windows(val, plan.seq_len, plan.curve_tokens)[: plan.diagnose_windows]
    attn = {}
    for variant in ("standard", "diff"):
        attn[variant] = []
        for seed in seeds:
            torch.manual_seed(seed)  # as the Trainer builds a run's model
            model = TransformerLM(_config(plan, variant))
            attn[variant].append([layer["attn"] for layer in block_stats(model, windows)])
    logs = [
        math.log(s / d)
        for std_seed, diff_seed in zip(attn["standard"], attn["diff"], strict=True)
        for s, d in zip(std_seed, diff_seed, strict=True)
    ]
    gain = float(f"{math.exp(statistics.fmean(logs)):.2g}")
    return {"seeds": seeds, "attn_rms": attn, "gain": gain, "train_tokens": TokenData(data, "train").n_tokens}


def decided_plan(plan: LongScale, out: Path, data: Path, seeds: list[int]) -> LongScale:
    """The plan with the options it measures or derives: the gain (stage 1, measured once and kept in LONG_INIT)
    and the matched V2's feed-forward width."""
    path = out / LONG_INIT
    if path.is_file():
        init = read_json_object(path)
    else:
        init = initial_gain(plan, data, seeds)
        write_text_atomic(path, json.dumps(init, indent=1) + "\n")
    return dataclasses.replace(plan, options=options_of(plan, init))


def options_of(plan: LongScale, init: dict) -> dict:
    """The options the plan decides: the measured gain and the matched V2's feed-forward width."""
    return {
        "diff-norm-gain": {"head_norm_gain": init["gain"]},
        "diff_v2-matched": {"ffn_dim": matched_ffn_dim(plan)},
    }


def open_long(out: Path, plan: LongScale, seeds: list[int]) -> dict:
    """Create out/LONG, or check that the long part already in ``out`` is this one (a study directory of the
    short-budget parts takes the long part beside them)."""
    record = {"plan": dataclasses.asdict(plan), "seeds": seeds, "variants": list(LONG_VARIANTS)}
    return open_plan(
        out,
        LONG,
        record,
        "long part",
        lambda saved, path: (
            f"{out} holds a long part with another plan ({path}: {saved.get('plan', {}).get('name')!r}, steps "
            f"{saved.get('plan', {}).get('steps')}, seeds {saved.get('seeds')}); continue it with the same `scale`, "
            "`steps` and `seeds`, or give a new `out`"
        ),
        companions=(lm.STUDY,),
    )


# stage 4: timing ---------------------------------------------------------------------------------------------------
STATES = ("init", "trained", "flushed")  # what a variant's step is timed from (time_steps)


def time_steps(
    plan: LongScale,
    data: Path,
    trained: dict[str, Path] | None = None,
    repeats: int = 3,
    steps: int = 12,
    warmup: int = 3,
) -> dict:
    """Seconds per training step of every variant at the long runs' shape, one model at a time, ``plan.threads``
    threads: ``repeats`` rounds over the variants (interleaved, so that a change in the machine's load reaches them
    all), each the median of ``steps`` steps after ``warmup``. Each variant is timed from its initialisation
    ("init") and, where ``trained`` names its run, from that run's final weights and optimizer state at its last
    learning rate ("trained"), and again so with subnormal floats flushed to zero ("flushed",
    ``torch.set_flush_denormal``): a trained model's step can cost more than a fresh one's (on x86, arithmetic on
    subnormal floats is many times slower), which a timing at initialisation would miss; "flushed" on a CPU that
    can flush them only, and in the calling thread only (the CPU plan times at one thread). Returns, for each
    state, the medians over rounds and the rounds."""
    device = torch.device(plan.device)
    threads = torch.get_num_threads()
    if plan.threads:
        torch.set_num_threads(plan.threads)
    sampler = WindowSampler(TokenData(data, "train"), plan.seq_len, plan.batch_size, seed=0)
    load_before = os.getloadavg()
    trained = trained or {}
    flushing = device.type == "cpu" and torch.set_flush_denormal(True)  # a CPU that can (x86 with SSE3)
    torch.set_flush_denormal(False)
    timed = STATES if flushing else STATES[:2]
    states = {v: [s for s in timed if s == "init" or v in trained] for v in LONG_VARIANTS}
    rounds: dict[str, dict[str, list[float]]] = {s: {v: [] for v in LONG_VARIANTS if s in states[v]} for s in STATES}
    try:
        for _ in range(repeats):
            for variant in LONG_VARIANTS:
                for state in states[variant]:
                    model, optimizer, cfg, lr = _timed_model(plan, variant, data, trained.get(variant), state)
                    amp = autocast_dtype(cfg, device)
                    torch.set_flush_denormal(state == "flushed")
                    times = []
                    try:
                        for i in range(warmup + steps):
                            start = time.perf_counter()
                            result = optimizer_step(model, optimizer, [sampler.batch(i, 0, 1)], lr, 1.0, device, amp)
                            result.loss.item()  # the step has finished (on a GPU too)
                            times.append(time.perf_counter() - start)
                    finally:
                        torch.set_flush_denormal(False)
                    rounds[state][variant].append(statistics.median(times[warmup:]))
    finally:
        torch.set_num_threads(threads)
    medians = {s: {v: statistics.median(r) for v, r in by.items()} for s, by in rounds.items()}
    return {
        "seconds_per_step": medians["init"],
        "trained_seconds_per_step": medians["trained"],
        "flushed_seconds_per_step": medians["flushed"],
        "trained_from": {v: path.name for v, path in trained.items()},
        "rounds": rounds,
        "machine": {
            "processor": _processor(),
            "cores": os.cpu_count(),
            "threads": plan.threads,
            "device": plan.device,
            "torch": torch.__version__,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "subnormal_fix": True,  # the fused CPU kernel drops terms far below their row's largest (issue #31)
    }


def _timed_model(plan: LongScale, variant: str, data: Path, run_dir: Path | None, state: str):
    """(model, optimizer, TrainConfig, learning rate) to time: a fresh model at 1e-3, or ``run_dir``'s final
    weights and optimizer state, with the run's own config, at its last learning rate."""
    torch.manual_seed(0)
    with torch.device(plan.device):
        model = TransformerLM(_config(plan, variant))
    if state == "init":
        cfg = lm.Run(SIZE, plan.steps[0], variant, 1e-3, 0).train_config(plan, data, Path("."))
        return model, make_optimizer(model, cfg), cfg, 1e-3
    cfg = resume_config(run_dir, data=str(data))
    optimizer = make_optimizer(model, cfg)
    model_sd, optim_sd, meta = load_checkpoint(list_checkpoints(run_dir)[-1])
    with own_layout():
        load_full_state(model, optimizer, model_sd, optim_sd)
    return model, optimizer, cfg, lr_at(meta["step"], cfg)


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the stages (lm_study.run_long runs them) ------------------------------------------------------------------
def tune_stage(plan: LongScale, out: Path, data: Path, workers: int, log_to: str = "jsonl") -> None:
    tune_until_inside(plan, out, data, workers, log_to, tuning, tune_runs)


def tune_until_inside(plan, out: Path, data: Path, workers: int, log_to: str, state_of, runs_of) -> None:
    """Train the grids' runs (``runs_of(plan, state_of(plan, measures))``) until measuring them grows no grid."""
    while True:
        state = state_of(plan, lm.read_measures(out))
        todo = [r for r in runs_of(plan, state) if r.name not in lm.read_measures(out)]
        if not todo:
            return
        lm.execute(todo, plan, out, data, workers, log_to)


def long_stage(plan: LongScale, out: Path, data: Path, workers: int, seeds: list[int], log_to: str = "jsonl") -> None:
    rates = best_rates(tuning(plan, lm.read_measures(out)))
    lm.execute(long_runs(plan, rates, seeds), plan, out, data, workers, log_to)


def timing_stage(plan: LongScale, out: Path, data: Path, seeds: list[int]) -> None:
    path = out / LONG_TIMING
    if not path.is_file():
        print("timing every variant's training step, one at a time (keep the machine otherwise idle)", flush=True)
        rates, seed = best_rates(tuning(plan, lm.read_measures(out))), seeds[0]
        runs = {v: out / "runs" / lm.Run(SIZE, plan.steps[0], v, rates[v], seed).name for v in LONG_VARIANTS}
        trained = {v: run for v, run in runs.items() if list_checkpoints(run)}  # a run's seed 0, trained
        write_text_atomic(path, json.dumps(time_steps(plan, data, trained), indent=1) + "\n")
