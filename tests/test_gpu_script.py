"""benchmarks/gpu.sh, the one-shot GPU acceptance run, in its --dry-run mode: the same script on the CPU with tiny
sizes, so that it works the day a GPU is lent (a broken line would otherwise be found only then)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_gpu_script_runs_dry_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.run(
        ["bash", "benchmarks/gpu.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    log = (tmp_path / "out" / "gpu.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    lines = log.splitlines()
    passed = {line.split(":")[0] for line in lines if line.startswith("PASS ")}
    assert {"PASS parity sdpa float32", "PASS parity block float32", "PASS parity sdpa bfloat16", "PASS kv cache",
            "PASS hf parity", "PASS train plain", "PASS train torchrun ddp, 1 process",
            "PASS train --compile"} <= passed, log[-4000:]  # fmt: skip
    assert not [line for line in lines if line.startswith("FAIL")]
    assert "SKIP peak memory: needs CUDA" in lines and "SKIP throughput: needs CUDA" in log
    assert "gpu_check: 0 failed" in lines and lines[-1].startswith("gpu.sh: passed in ")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu.log"]  # runs stay in WORK
