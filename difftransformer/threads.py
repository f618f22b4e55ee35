"""How difftransformer sets up CPU threads: OpenMP's idle threads wait passively instead of spinning.

torch runs its parallel work on OpenMP's threads. By default (GNU OpenMP) a thread that has finished its share spins
a while (300,000 turns) before it sleeps, waiting for the next parallel region. When another program keeps a core
busy, a spinning thread takes time that a working thread of the same process needed, and every region waits for the
slowest: the demo's training step at 2 threads on 2 cores, one of them busy, took 2.02x the best setting's time. A
passive thread sleeps at once: the same step took 1.07x, and idle it kept its speed
(benchmarks/results/load-tiny_cpu-epyc-2core_2026-12-05/README.md, which also gives the cost: a batch-1 decode step
of the tiny model, idle, 1.19x slower at 2 threads).

The policy is read once, when OpenMP's runtime loads with torch, so it must be set before ``import torch``. Importing
``difftransformer`` does it (:func:`wait_passively`, which the command line's start-up runs through the same import)
unless the environment chose; a program that imported torch first is told once how to get it.
"""

from __future__ import annotations

import os
import sys
import warnings

WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN = "GOMP_SPINCOUNT"  # GNU OpenMP's own: how long an idle thread spins before it sleeps


def wait_passively() -> None:
    """Make OpenMP's idle threads sleep (``OMP_WAIT_POLICY=PASSIVE``) unless the environment chose how they wait
    (that variable, or GNU OpenMP's ``GOMP_SPINCOUNT``); only while torch is not yet imported (later it has no
    effect: then a warning says so once, with the fix, where torch runs on more than one OpenMP thread). Child
    processes (torchrun's workers, a study's) inherit it."""
    if WAIT_POLICY in os.environ or SPIN in os.environ:
        return
    if "torch" not in sys.modules:
        os.environ[WAIT_POLICY] = "PASSIVE"
        return
    torch = sys.modules["torch"]
    if getattr(getattr(torch, "_C", None), "has_openmp", False) and torch.get_num_threads() > 1:
        warnings.warn(
            "torch was imported before difftransformer, so OpenMP's idle threads spin (its default): while another "
            "program keeps a core busy, CPU work can run several times slower (docs/guide/speed.md). Import "
            "difftransformer before torch, or set OMP_WAIT_POLICY=PASSIVE in the environment.",
            SpinningThreadsWarning,
            stacklevel=3,
        )


class SpinningThreadsWarning(RuntimeWarning):
    """torch loaded OpenMP with idle threads that spin, before difftransformer could ask them to wait passively."""


def describe(threads: int) -> str:
    """'2 threads (OpenMP waits passively)', as the summary lines print it."""
    policy = os.environ.get(WAIT_POLICY, "").strip().upper()
    wait = {"PASSIVE": "waits passively", "ACTIVE": "spins"}.get(policy, "spins a while, its default")
    return f"{threads} thread{'s' if threads != 1 else ''} (OpenMP {wait}; --threads N sets the count)"
