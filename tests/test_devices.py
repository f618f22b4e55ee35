"""Devices decided once (difftransformer/devices.py): a name becomes a torch.device with its index, `cuda` is the GPU
of torchrun's LOCAL_RANK, and the process group is joined on it. No GPU here: torch.cuda's queries are replaced by a
machine with four GPUs."""

import pytest
import torch
import torch.distributed as dist

from difftransformer.devices import device_problem, resolve_device
from difftransformer.errors import InputError
from difftransformer.training import distributed


@pytest.fixture
def four_gpus(monkeypatch):
    """torch.cuda as on a machine with 4 GPUs; set_device calls recorded in the returned list."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", torch.device(device))))
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_names_become_devices_with_an_index(four_gpus, monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:3") == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda", 2)) == torch.device("cuda", 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_device("cuda") == resolve_device("auto") == torch.device("cuda", 2)  # torchrun's process 2


def test_names_this_machine_cannot_use_are_refused(four_gpus, monkeypatch):
    with pytest.raises(InputError, match=r"`device` is 'cuda:4', but this machine has 4 GPU\(s\)"):
        resolve_device("cuda:4")
    with pytest.raises(InputError, match="must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps', got 'gpu'"):
        resolve_device("gpu")
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(InputError, match="LOCAL_RANK 5, but this machine has 4 GPU"):
        resolve_device("cuda")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes on this machine would share GPU 3
    assert "which would all use that one GPU; give cuda" in device_problem("cuda:3")


def test_without_a_gpu_cuda_is_refused_and_auto_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(InputError, match="no CUDA GPU is available here"):
        resolve_device("cuda")


@pytest.mark.parametrize("name, expected", [("cuda:1", 1), ("cuda", 2), ("auto", 2)])
def test_the_process_group_is_joined_on_the_processs_gpu(four_gpus, monkeypatch, name, expected):
    """Under torchrun, the GPU becomes current before the group is set up, with NCCL (a `cuda:N` name once took
    gloo and no set_device: a string compared with 'cuda')."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: four_gpus.append(("group", backend)))
    world = distributed.init_world(name)
    assert world.device == torch.device("cuda", expected)
    assert four_gpus == [("set_device", torch.device("cuda", expected)), ("group", "nccl")]


def test_a_cpu_world_joins_with_gloo(monkeypatch):
    calls = []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(backend))
    assert distributed.init_world("cpu").device == torch.device("cpu") and calls == ["gloo"]
