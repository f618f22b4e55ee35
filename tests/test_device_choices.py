"""The device's decisions in one place (devices.choices), the GPU rehearsal that takes the CUDA branch's on CPU tensors
(DIFFTX_REHEARSE=cuda), and each thing only a GPU runs (devices.GPU_ONLY) exercised with a fake."""

from __future__ import annotations

import pytest
import torch

from difftransformer import devices
from difftransformer.core.attention import cpu_kernel, kernels
from difftransformer.devices import (
    CPU_CHOICES,
    CUDA_CHOICES,
    OTHER_CHOICES,
    REHEARSAL_CHOICES,
    choices,
    host_batch,
    rehearse,
)
from difftransformer.training import distributed
from difftransformer.training.config import TrainConfig
from difftransformer.training.step import autocast_dtype, optimizer_flags, to_device

CUDA = torch.device("cuda", 0)


@pytest.fixture
def rehearsal():
    """The CUDA branch's choices on CPU tensors for one test (and the environment its children would inherit)."""
    rehearse("cuda")
    try:
        yield
    finally:
        rehearse(None)


def test_each_device_takes_its_branch_and_the_rehearsal_the_cuda_one(rehearsal):
    assert choices(CUDA) is CUDA_CHOICES
    assert choices(torch.device("cpu")) is REHEARSAL_CHOICES
    assert choices(torch.device("meta")) is OTHER_CHOICES  # only CPU tensors rehearse
    rehearse(None)
    assert choices(torch.device("cpu")) is CPU_CHOICES
    # the rehearsal is the CUDA branch in every choice but the one only a GPU runs (NCCL)
    differing = {
        f for f in CUDA_CHOICES.__dataclass_fields__ if getattr(CUDA_CHOICES, f) != getattr(REHEARSAL_CHOICES, f)
    }
    assert differing == {"backend"} and REHEARSAL_CHOICES.backend == "gloo"


def test_an_unknown_rehearsal_is_refused():
    with pytest.raises(ValueError, match="DIFFTX_REHEARSE must be 'cuda' or unset"):
        rehearse("rocm")


def test_the_rehearsal_runs_the_cuda_methods_on_cpu_tensors(rehearsal, monkeypatch):
    """auto: padded SDPA for a forward with gradient (not the block kernel), the PyTorch decode path for a decode
    step (not the fused decode kernel); without the rehearsal the CPU's own methods."""
    ran = []
    for name in ("_diff_attention_sdpa", "_block", "_diff_decode_torch"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _n=name, _f=real, **k: ran.append(_n) or _f(*a, **k))
    monkeypatch.setattr(cpu_kernel, "fused_decode", lambda *a, **k: ran.append("fused_decode") or None)
    q, k, v = torch.randn(1, 2, 2, 256, 64), torch.randn(1, 2, 2, 256, 64), torch.randn(1, 2, 256, 128)
    lam = torch.tensor(0.5)
    kernels.diff_attention(q, k, v, lam, scale=0.125)
    with torch.no_grad():
        kernels.diff_attention(q[:, :, :, -1:], k, v, lam, scale=0.125)
    assert ran == ["_diff_attention_sdpa", "_diff_decode_torch"]
    rehearse(None)
    ran.clear()
    kernels.diff_attention(q, k, v, lam, scale=0.125)
    assert ran == ["_block"]


def test_training_settings_follow_the_branch(rehearsal):
    auto = TrainConfig(data="d", out="o", dtype="auto")
    assert autocast_dtype(auto, torch.device("cpu")) == torch.bfloat16  # as on a GPU
    assert optimizer_flags(torch.device("cpu")) == {"fused": True}
    rehearse(None)
    assert autocast_dtype(auto, torch.device("cpu")) is None


class _Batch:
    """Stands for a batch on ``device``: records what to_device asks of it, and refuses to be pinned unless on the
    host, as PyTorch refuses to pin a CUDA tensor."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.calls, self._base = device, [], None

    def pin_memory(self):
        if self.device.type != "cpu":
            raise RuntimeError(f"cannot pin '{self.device.type}' memory")
        self.calls.append(("pin_memory",))
        return self

    def to(self, device, non_blocking=False):
        self.calls.append(("to", device, non_blocking))
        return self


def test_a_host_batch_goes_to_a_gpu_pinned_and_a_device_batch_is_left_as_it_is():
    """Pinning a host batch for a CUDA copy (GPU_ONLY), with a fake: the host batch is pinned and copied without
    waiting; a batch already on the GPU (bench train made one, and PyTorch refused to pin it) is not pinned."""
    host = _Batch(torch.device("cpu"))
    to_device(host, CUDA)
    assert host.calls == [("pin_memory",), ("to", CUDA, True)]
    on_gpu = _Batch(CUDA)
    to_device(on_gpu, CUDA)
    assert on_gpu.calls == [("to", CUDA, False)]


def test_the_rehearsals_pin_refuses_what_was_not_made_on_the_host(rehearsal):
    made_here = torch.arange(6).view(2, 3)  # as a benchmark that built its batch "on the device" would
    with pytest.raises(RuntimeError, match="not made on the host"):
        to_device(made_here, torch.device("cpu"))
    batch = host_batch(torch.arange(6).view(2, 3))
    assert torch.equal(to_device(batch[:, :-1], torch.device("cpu")), batch[:, :-1])  # a view of a host batch
    rehearse(None)
    assert to_device(made_here, torch.device("cpu")) is made_here  # the CPU branch pins nothing


def test_bench_train_runs_the_cuda_branch_on_the_cpu(rehearsal):
    """bench train as a GPU runs it (host batches pinned, bfloat16 autocast, padded SDPA): on the main branch of
    2026-12-06 it built its batch on the device and pinned it, which crashes on a GPU and fails here."""
    from difftransformer.apps.bench import bench_train

    result = bench_train("tiny", [16], batch=1, repeats=1, dtype=torch.bfloat16, matmul=128)
    # no Triton column: in bfloat16 the interpreter's results are meaningless (GPU_ONLY)
    assert {"diff", "standard"} <= set(result["rows"][0]["seconds"]) and "diff-triton" not in result["rows"][0][
        "seconds"
    ]


def test_the_process_group_is_nccl_on_a_gpu_and_gloo_in_the_rehearsal(rehearsal, monkeypatch):
    """NCCL (GPU_ONLY), with a fake process group: init_world asks for the device's backend."""
    asked = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed, "_attempt_store", lambda wait: None)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: bool(asked))
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **k: asked.append(backend))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 0)
    distributed.init_world("cpu")
    monkeypatch.setattr(distributed, "resolve_device", lambda device: CUDA)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    asked_before = list(asked)
    asked.clear()
    distributed.init_world("cuda")
    assert asked_before == ["gloo"] and asked == ["nccl"]


# the test that covers each thing only a GPU runs (GPU_ONLY), with a fake where one can stand in
COVERED = {
    "pinning a host batch for a CUDA copy": "test_device_choices.py::test_a_host_batch_goes_to_a_gpu_pinned_and_a_"
    "device_batch_is_left_as_it_is",
    "NCCL": "test_device_choices.py::test_the_process_group_is_nccl_on_a_gpu_and_gloo_in_the_rehearsal",
    "CUDA memory statistics": "test_device_choices.py::test_peak_memory_reads_the_cuda_statistics_once_per_model",
    "TF32 matrix products": "test_gpu_defaults.py::test_tf32_for_float32_runs_on_ampere_and_newer_only",
    "the Triton kernels compiled for the GPU": "test_triton_compile.py::test_every_kernel_compiles_without_spills_"
    "within_shared_memory",
    "the Triton kernels in bfloat16": "test_triton_compile.py::test_every_kernel_compiles_without_spills_within_"
    "shared_memory",  # compiled for the GPU in bfloat16 too; their numbers: the GPU's parity check only
    "bfloat16 support of the GPU": "test_device_choices.py::test_training_settings_follow_the_branch",
}


def test_every_gpu_only_item_has_a_stand_in_and_a_test():
    from pathlib import Path

    assert set(COVERED) == set(devices.GPU_ONLY)
    assert all(instead for instead in devices.GPU_ONLY.values())
    for what, test in COVERED.items():
        file, name = test.split("::")
        assert f"def {name}(" in (Path(__file__).parent / file).read_text(), (what, test)


def test_peak_memory_reads_the_cuda_statistics_once_per_model(rehearsal, capsys):
    """CUDA memory statistics (GPU_ONLY), with a fake: gpu_check's peak-memory check resets the peak before each
    model's step and reads it after, and reports the ratios to the standard model without judging them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_check

    class FakeMemory:
        def __init__(self) -> None:
            self.calls, self.peak = [], 0

        def synchronize(self):
            self.calls.append("synchronize")

        def reset_peak_memory_stats(self):
            self.calls.append("reset")

        def max_memory_allocated(self):
            self.peak += 2**30
            return self.peak

        def empty_cache(self):
            self.calls.append("empty")

    memory, results = FakeMemory(), gpu_check.Results()
    peaks = gpu_check.peak_memory(torch.device("cpu"), True, results, memory)
    assert peaks == {"diff-sdpa": 1.0, "standard": 2.0} and not results.failed  # no Triton in bf16 in the rehearsal
    assert memory.calls == ["synchronize", "reset", "synchronize", "empty"] * 2
    assert "diff-sdpa 0.50 x the standard model's (reported, not judged)" in capsys.readouterr().out
