"""`difftx bench load`: a training step and a decode step at 1 and N threads, with OpenMP's idle threads waiting as
its default has them (GNU OpenMP: spinning a while, then sleeping) or passively, on an idle machine and while
another process keeps one core busy.

OpenMP's wait policy is read once, when its runtime loads (with torch), so every setting runs in a process of its
own; the settings and both conditions alternate within each round, so drifting load hits all alike."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

from difftransformer.devices import host_batch
from difftransformer.threads import SPIN, WAIT_POLICY

# (label, threads, the OpenMP environment: nothing set is OpenMP's default); "N" stands for the --threads compared
# with 1. These processes import torch first, so that the environment alone decides. The default of the command line
# and of the library is N threads, passive, set by importing difftransformer before torch (difftransformer/threads.py):
# LIBRARY runs that way, as a user's program does. Spinning 1000 times before sleeping (GNU OpenMP only) is the
# alternative the default was chosen against
SETTINGS = (
    ("1 thread, OpenMP's default", 1, {}),
    ("N threads, OpenMP's default", "N", {}),
    ("1 thread, passive", 1, {WAIT_POLICY: "PASSIVE"}),
    ("N threads, passive", "N", {WAIT_POLICY: "PASSIVE"}),
    ("N threads, spin 1000", "N", {SPIN: "1000"}),
)
LIBRARY = ("N threads, importing difftransformer first", "N", None)  # nothing set; the library sets the policy
SETTINGS = (*SETTINGS, LIBRARY)
CONDITIONS = ("idle", "one core busy")
WORKS = ("training step", "decode step")
# the competing process: a bounded busy loop (it ends by itself should this process be killed)
BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def bench_load(
    threads: int = 2,
    preset: str = "tiny",
    seq: int = 256,
    batch: int = 16,
    repeats: int = 5,
    rounds: int = 2,
    attention: str = "diff",
) -> dict:
    """Median seconds of each work under each setting and condition: per round, each (condition, setting) process
    times ``repeats`` steps after a warm-up; the median over every timed step of every round is reported. The
    training step is the demo's (preset tiny, batch 16 x 256 tokens by default: forward, backward, AdamW as
    ``difftx train`` takes it); the decode step is one token at batch 1 after a prompt of ``seq`` tokens (each
    timed value the mean of 8)."""
    from difftransformer.apps.bench import _Calls, _result

    times: dict[tuple[str, str, str], list[float]] = {}
    seen: dict[str, dict] = {}  # what each setting's process ran with, as torch and OpenMP report it
    spec = {"preset": preset, "seq": seq, "batch": batch, "attention": attention, "repeats": repeats}
    with _Calls.tracking("load", rounds * len(CONDITIONS) * len(SETTINGS)):
        for r in range(rounds):
            for condition in CONDITIONS:
                for label, n, openmp in SETTINGS:
                    n = threads if n == "N" else n
                    seconds = _in_process({**spec, "threads": n}, openmp, busy=condition != "idle")
                    seen[label] = seconds.pop("seen")
                    for work in WORKS:
                        times.setdefault((condition, label, work), []).extend(seconds[work])
                    _Calls.tick(f"round {r + 1}: {condition}, {_named(label, threads)}")
    rows = [
        {
            "condition": condition,
            "setting": _named(label, threads),
            "threads": threads if n == "N" else n,
            "openmp": openmp,
            "seen": seen[label],
            "work": work,
            "seconds": statistics.median(times[(condition, label, work)]),
            "all_seconds": times[(condition, label, work)],
        }
        for condition in CONDITIONS
        for label, n, openmp in SETTINGS
        for work in WORKS
    ]
    shapes = {**spec, "threads": [1, threads], "rounds": rounds, "cpus": sorted(os.sched_getaffinity(0))}
    return _result("load", shapes, repeats, rows)


def _named(label: str, threads: int) -> str:
    return label.replace("N threads", f"{threads} threads")


def _in_process(spec: dict, openmp: dict[str, str] | None, busy: bool) -> dict[str, list[float]]:
    """Run ``_time_steps(spec)`` in a fresh interpreter with the OpenMP environment ``openmp`` (the rest of it unset;
    torch imported first), or with None as a program that imports difftransformer first, beside a busy process if
    ``busy``; its step times."""
    env = {k: v for k, v in os.environ.items() if k not in (WAIT_POLICY, SPIN)}
    env |= {"OMP_NUM_THREADS": str(spec["threads"]), "OMP_DISPLAY_ENV": "VERBOSE"} | (openmp or {})  # OpenMP says it
    code = f"from difftransformer.apps.bench_load import _time_steps; _time_steps({json.dumps(spec)!r})"
    if openmp is not None:  # torch loads OpenMP first: importing difftransformer then changes nothing (and says so)
        code = f"import warnings, torch; warnings.simplefilter('ignore'); {code}"
    competitor = None
    if busy:
        competitor = subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=600)])
        time.sleep(0.2)  # running before the measured process starts
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    if done.returncode != 0:
        raise RuntimeError(f"bench load: a measuring process failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr)  # GNU OpenMP's report; absent under another runtime
    result["seen"]["spin_count"] = int(spin.group(1)) if spin else None
    return result


def _time_steps(spec_json: str) -> None:
    """In the measuring process: print the seconds of ``repeats`` training steps and decode steps, as JSON."""
    import torch

    from difftransformer.apps.bench import _decode_seconds, trainer_optimizer, trainer_step
    from difftransformer.core.config import ModelConfig
    from difftransformer.core.model import TransformerLM

    spec = json.loads(spec_json)
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    config = ModelConfig.preset(spec["preset"], attention=spec["attention"], max_seq_len=spec["seq"] + 16)
    model = TransformerLM(config)
    optimizer = trainer_optimizer(model)
    x = host_batch(torch.randint(0, config.vocab_size, (spec["batch"], spec["seq"] + 1)))
    out: dict[str, list[float]] = {"training step": [], "decode step": []}
    for i in range(spec["repeats"] + 1):
        start = time.perf_counter()
        trainer_step(model, optimizer, x)
        if i:  # the first step warms up
            out["training step"].append(time.perf_counter() - start)
    model.eval()
    for _ in range(spec["repeats"]):  # each the mean of 8 decode steps (bench decode's loop)
        out["decode step"] += _decode_seconds(model, spec["seq"], 8)
    print(json.dumps({**out, "seen": {"threads": torch.get_num_threads()}}))


def verdict(result: dict) -> list[str]:
    """The issue's two questions, answered from the rows: the loaded case at the default (n threads, passive)
    against the best loaded setting, and the idle case at the default against the old default (n threads,
    OpenMP's default wait)."""
    n = result["shapes"]["threads"][1]
    default, old, library = f"{n} threads, passive", f"{n} threads, OpenMP's default", _named(LIBRARY[0], n)
    lines = []
    for work in WORKS:
        s = {(r["condition"], r["setting"]): r["seconds"] for r in result["rows"] if r["work"] == work}
        loaded = {k[1]: v for k, v in s.items() if k[0] == "one core busy"}
        best = min(loaded, key=loaded.get)
        lines.append(
            f"{work}: one core busy, the default ({default}) takes {loaded[default] / loaded[best]:.2f}x the best "
            f"setting ({best}); the old default took {loaded[old] / loaded[best]:.2f}x. Idle, the default "
            f"takes {s[('idle', default)] / s[('idle', old)]:.2f}x the old default ({old})"
        )
        if library in loaded:  # results from before #56 have no such row
            busy, idle = loaded[library] / loaded[best], s[("idle", library)] / s[("idle", old)]
            lines[-1] += (
                f". A program that imports difftransformer before torch (nothing set): one core busy, {busy:.2f}x "
                f"the best setting; idle, {idle:.2f}x the old default"
            )
    return lines


def format_load(result: dict) -> str:
    sh, m = result["shapes"], result["machine"]
    lines = [
        f"load benchmark: {m['cpu']}, torch {m['torch']}, {result['dtype']}, threads as each setting names",
        f"preset {sh['preset']} ({sh['attention']}); training step: batch {sh['batch']} x {sh['seq']} tokens, "
        f"forward + backward + AdamW; decode step: one token at batch 1 after {sh['seq']}; CPUs {sh['cpus']}. "
        f"Each setting in its own process (OMP_NUM_THREADS; {WAIT_POLICY} and {SPIN} unset unless named; torch "
        "imported first, except in the one that imports difftransformer first), "
        f"{sh['rounds']} rounds alternating settings and conditions; medians over every timed step. 'one core busy': "
        "a Python busy loop runs beside.",
        "",
        "| condition | setting | training step ms | decode step ms |",
        "|---|---|---|---|",
    ]
    by = {(r["condition"], r["setting"], r["work"]): r["seconds"] for r in result["rows"]}
    for condition in CONDITIONS:
        for label in dict.fromkeys(r["setting"] for r in result["rows"]):
            train, decode = by[(condition, label, WORKS[0])], by[(condition, label, WORKS[1])]
            lines.append(f"| {condition} | {label} | {train * 1e3:.0f} | {decode * 1e3:.1f} |")
    return "\n".join([*lines, "", *verdict(result)])
