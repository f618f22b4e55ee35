"""benchmarks/gpu.sh, the one-shot GPU acceptance run, in its --cpu mode: the same checks at the same sizes on the CPU
(benchmarks/gpu_check.py --cpu), so that what fails there is found here and the day a GPU is lent its only unknown is
the device."""

import functools
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
@pytest.mark.gpu_image
def test_the_rehearsal_runs_the_cuda_branch_and_passes(tmp_path):
    """gpu.sh --cpu runs the CUDA branch's code on the CPU (its log names the methods: padded SDPA, the PyTorch decode
    path, Triton interpreted) and every check and benchmark that the CPU can run passes; what needs a GPU says SKIP
    with its reason. The throughput part runs bench train as a GPU does: on the main branch of 2026-12-06 it built its
    batch on the device and pinned it (a crash on CUDA), which the rehearsal's pin refuses."""
    proc, log = _gpu_sh(tmp_path)
    assert proc.returncode == 0, log[-4000:]
    lines = log.splitlines()
    assert any(line.startswith("branch: cuda choices on cpu tensors: attention auto = padded SDPA; decode = the "
                               "PyTorch decode path; Triton interpreted, at the GPU tiles; autocast bfloat16")
               for line in lines), log[:3000]  # fmt: skip
    passed = {line.split(":")[0].removeprefix("PASS ") for line in lines if line.startswith("PASS ")}
    parity = {f"parity sdpa {dtype} T {t} d {d}" for dtype in ("float32", "bfloat16")
              for t, d in ((1024, 64), (1000, 128))}  # fmt: skip
    parity |= {"parity triton float32 T 200 d 64", "parity triton float32 T 130 d 128"}
    training = {"train resolution", "train torchrun ddp, 1 process", "train --compile"}
    benches = {"bench attention", "bench train", "bench decode batch 1", "bench decode batch 8"}
    assert passed == parity | {"kv cache", "hf parity"} | training | benches, log[-4000:]
    assert not [line for line in lines if line.startswith("FAIL")]
    skipped = {line.split(":")[0] for line in lines if line.startswith("SKIP ")}
    assert skipped == {"SKIP parity triton bfloat16 T 200 d 64", "SKIP parity triton bfloat16 T 130 d 128",
                       "SKIP peak memory", "SKIP GPU tests", "SKIP study slice"}  # fmt: skip
    assert "gpu_check: 0 failed" in lines and "gpu_bench: 0 failed" in lines
    assert lines[-1].startswith("gpu.sh: passed in ")
    assert re.search(r"\(checks: \d+ s of its 1107 s\)", log)  # each part's time, against its timeout
    assert "METHOD keep sdpa: it is CUDA's default already (devices.CUDA_CHOICES)" in lines
    results = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert results == ["attention_cpu-rehearsal.json", "decode-tiny-batch1_cpu-rehearsal.json",
                       "decode-tiny-batch8_cpu-rehearsal.json", "gpu.log", "train-tiny_cpu-rehearsal.json"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.gpu_image
def test_the_script_runs_again_at_once_and_keeps_its_budget(tmp_path):
    """A fresh work directory per invocation (the last script refused its own earlier run directory); a part that no
    longer fits in the budget is skipped with a line saying so and the command that runs it alone."""
    first, _ = _gpu_sh(tmp_path, checks="cache")
    second, log = _gpu_sh(tmp_path, checks="cache")
    assert first.returncode == second.returncode == 0, log[-3000:]
    assert len(list((tmp_path / "work").iterdir())) == 2
    _, tight = _gpu_sh(tmp_path, "--budget", "100", checks="cache")  # 369 s x 3 of part 2 do not fit in 300
    assert re.search(r"^SKIP checks: \d+ s gone, its 1107 s timeout would pass the 300 s budget; alone: .*"
                     r"benchmarks/gpu_check.py --out .* --cpu --only cache$", tight, re.M), tight  # fmt: skip


@functools.cache  # one process for the tests that read it
def _plan() -> dict[str, tuple[int, int]]:
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--plan"], cwd=ROOT, capture_output=True,
                          text=True, check=True)  # fmt: skip
    return {name: (int(p), int(t)) for name, p, t in (line.split("\t") for line in proc.stdout.splitlines())}


@pytest.mark.slow
def test_the_header_states_each_parts_prediction_and_timeout():
    """gpu.sh's header states what gpu_check.py --plan estimates (the script reads its timeouts from there)."""
    text = (ROOT / "benchmarks" / "gpu.sh").read_text().replace("\n#   ", " ").replace("\n#      ", " ")
    plan = _plan()
    assert list(plan) == ["GPU tests", "checks", "throughput", "study slice"]
    for number, (predicted, timeout) in enumerate(plan.values(), 1):
        assert f"{number}. ({predicted} s, timeout {timeout} s)" in text, (number, predicted, timeout)


def test_the_timeouts_have_margin_and_fit_in_the_budget():
    """Each timeout is at least 1.5 times its prediction; parts 1 to 3 fit in the default budget with room for the
    header, and the budget in the run tool's 600 s; the study slice does not fit after them (it says SKIP)."""
    text = (ROOT / "benchmarks" / "gpu.sh").read_text()
    budget = int(re.search(r"^BUDGET=(\d+)$", text, re.M).group(1))
    plan = _plan()
    assert all(timeout >= 1.5 * predicted for predicted, timeout in plan.values())
    first_three = sum(timeout for name, (_, timeout) in plan.items() if name != "study slice")
    assert f"Parts 1 to 3 sum to {first_three} s of timeouts" in text.replace("\n# ", " ")
    assert first_three < budget <= 570 and first_three + plan["study slice"][1] > budget
    assert f"at most its {budget} s budget" in (ROOT / "docs" / "guide" / "speed.md").read_text()  # quoted there


def test_the_method_is_chosen_from_the_numbers():
    """Triton becomes CUDA's method only when at most 0.9 x padded SDPA's time at every length, and the line says
    the command that makes it the default."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_bench

    def rows(*triton_sdpa_standard):
        return {"rows": [{"seq": t, "direction": "core forward+backward",
                          "seconds": {"triton": a, "sdpa": b, "standard": c}}
                         for t, (a, b, c) in zip((2048, 8192), triton_sdpa_standard, strict=True)]}  # fmt: skip

    assert gpu_bench.choose_method(rows((0.8, 1.0, 0.5), (0.85, 1.0, 0.5)))[0] == "triton"
    assert gpu_bench.choose_method(rows((0.8, 1.0, 0.5), (0.95, 1.0, 0.5)))[0] == "sdpa"  # not faster at 8192
    assert gpu_bench.choose_method({"rows": [{"seq": 2048, "direction": "core forward+backward",
                                              "seconds": {"sdpa": 1.0, "standard": 0.5}}]})[0] == "sdpa"  # fmt: skip
    line = gpu_bench.method_lines(rows((0.5, 1.0, 0.5), (0.5, 1.0, 0.5))).splitlines()[-1]
    assert line.startswith("METHOD make triton CUDA's default: sed -i ") and "difftransformer/devices.py" in line
    # the command changes the line it names
    command = line.split(": ", 1)[1].split(" (one run now")[0]
    pattern = re.search(r"'s/(.*?)/(.*?)/'", command).group(1).replace("^", "")
    assert pattern in (ROOT / "difftransformer" / "devices.py").read_text()


def test_result_files_are_named_after_the_device():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_bench
    import torch

    assert gpu_bench.device_tag(torch.device("cpu")) == "cpu-rehearsal"


def test_the_gpu_image_environment_pins_the_images_versions():
    """make test-gpu-image builds its environment from tests/gpu_image/requirements.txt: the GPU machine's versions
    (torch 2.11, Triton 3.6, transformers 5.17), and nothing its image lacks (ninja, lm-eval, W&B, mkdocs)."""
    lines = (ROOT / "tests" / "gpu_image" / "requirements.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))
    assert (pins["torch"], pins["triton"], pins["transformers"]) == ("2.11.0", "3.6.0", "5.17.0")
    assert not {"ninja", "lm-eval", "lm_eval", "wandb", "mkdocs"} & set(pins)
    assert {"safetensors", "tokenizers", "PyYAML", "tensorboard", "psutil", "pytest", "hypothesis"} <= set(pins)
