"""benchmarks/gpu.sh, the one-shot GPU acceptance run, in its --cpu mode: the same checks at the same sizes on the CPU
(benchmarks/gpu_check.py --cpu), so that what fails there is found here and the day a GPU is lent its only unknown is
the device."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _gpu_sh(tmp_path, *args, checks: str | None = None, timeout: int = 1500) -> tuple[subprocess.CompletedProcess, str]:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK_ROOT": str(tmp_path / "work"), "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    env.pop("GPU_CHECKS", None)
    if checks:
        env["GPU_CHECKS"] = checks
    proc = subprocess.run(
        ["bash", "benchmarks/gpu.sh", "--cpu", *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    return proc, (tmp_path / "out" / "gpu.log").read_text()


@pytest.mark.slow
def test_every_check_passes_on_the_cpu_at_the_gpu_sizes(tmp_path):
    """The checks at their real sizes (small preset at T 1024, parity at T 1000 and 1024 with d 64 and 128): every one
    that does not need CUDA passes (the previous script's dry run took other sizes and branches, and 3 of its 5
    checks failed at the real ones)."""
    proc, log = _gpu_sh(tmp_path)
    assert proc.returncode == 0, log[-4000:]
    lines = log.splitlines()
    passed = {line.split(":")[0].removeprefix("PASS ") for line in lines if line.startswith("PASS ")}
    parity = {f"parity {m} {dtype} T {t} d {d}" for m in ("sdpa", "block") for dtype in ("float32", "bfloat16")
              for t, d in ((1024, 64), (1000, 128))}  # fmt: skip
    training = {"train resolution", "train plain", "train torchrun ddp, 1 process", "train --compile"}
    assert passed == parity | {"kv cache", "hf parity"} | training, log[-4000:]
    assert not [line for line in lines if line.startswith("FAIL")]
    skipped = {line.split(":")[0] for line in lines if line.startswith("SKIP ")}
    assert skipped == {"SKIP parity triton", "SKIP peak memory", "SKIP GPU tests", "SKIP throughput",
                       "SKIP the study slice"}  # fmt: skip
    assert "gpu_check: 0 failed" in lines and lines[-1].startswith("gpu.sh: passed in ")
    assert re.search(r"\(checks: \d+ s of its 840 s\)", log)  # each part's time, against its timeout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu.log"]  # runs stay in the work directory


@pytest.mark.slow
def test_the_script_runs_again_at_once_and_keeps_its_budget(tmp_path):
    """A fresh work directory per invocation (the last script refused its own earlier run directory); a part that no
    longer fits in the budget is skipped with a line saying so."""
    first, _ = _gpu_sh(tmp_path, checks="cache")
    second, log = _gpu_sh(tmp_path, checks="cache")
    assert first.returncode == second.returncode == 0, log[-3000:]
    assert len(list((tmp_path / "work").iterdir())) == 2
    _, tight = _gpu_sh(tmp_path, "--budget", "100", checks="cache")  # 280 s x 3 of part 2 do not fit in 300
    assert re.search(r"^SKIP checks: \d+ s gone, its 840 s would pass the 300 s budget$", tight, re.M), tight


def test_the_headers_prediction_is_the_checks_estimate():
    """gpu.sh's header states as a prediction what gpu_check.py --predict estimates from its sizes."""
    text = (ROOT / "benchmarks" / "gpu.sh").read_text()
    claimed = re.search(
        r"its checks about (\d+) s \(`python benchmarks/gpu_check.py --predict`", text.replace("\n# ", " ")
    )
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--predict"], cwd=ROOT, capture_output=True,
                          text=True, check=True)  # fmt: skip
    total = int(proc.stdout.split("total ")[1])
    assert claimed and int(claimed.group(1)) == total


def test_the_part_timeouts_fit_in_the_default_budget():
    text = (ROOT / "benchmarks" / "gpu.sh").read_text()
    timeouts = [int(n) for n in re.findall(r'^\s+part "[^"]+" (\d+) ', text, re.M)]
    budget = int(re.search(r"^BUDGET=(\d+)$", text, re.M).group(1))
    assert len(timeouts) == 5 and sum(timeouts) == 530 < budget  # GPU tests, checks, three benchmarks
