"""vidtune.trainer.training.gpus and .devices: simulated GPUs, the device a worker Ray gave a GPU trains
on."""
from __future__ import annotations

import pytest
import torch

from vidtune.flags import ConfigError
from vidtune.trainer.cluster import devices
from vidtune.trainer.training import gpus


def test_simulated_gpus_is_a_whole_number_or_refused_naming_the_variable(monkeypatch):
    monkeypatch.delenv(gpus.SIMULATE_ENV, raising=False)
    assert gpus.simulated_gpus() == 0
    monkeypatch.setenv(gpus.SIMULATE_ENV, "4")
    assert gpus.simulated_gpus() == 4
    for bad in ("four", "-1", "1.5"):
        monkeypatch.setenv(gpus.SIMULATE_ENV, bad)
        with pytest.raises(ConfigError) as e:
            gpus.simulated_gpus()
        assert e.value.flag == gpus.SIMULATE_ENV and repr(bad) in str(e.value)


def test_the_device_is_the_gpu_ray_gave_by_its_place_in_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv(gpus.SIMULATE_ENV, raising=False)
    monkeypatch.setattr(devices, "physical_gpu_ids", lambda: ["3"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _fake_gpus(monkeypatch, {1: ("NVIDIA A10G", (8, 6))})     # a GPU the build has kernels for
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")        # Ray Train: one list for a run's workers
    assert devices.train_device() == torch.device("cuda", 1)
    monkeypatch.setenv(gpus.SIMULATE_ENV, "4")
    assert devices.train_device() == torch.device("cpu")        # simulated: placement only, CPU training
    monkeypatch.setattr(devices, "physical_gpu_ids", lambda: [])
    monkeypatch.delenv(gpus.SIMULATE_ENV)
    assert devices.train_device() == torch.device("cpu")        # no GPU from Ray


def _ray_gave_gpu_0(monkeypatch, *, cuda_available: bool) -> None:
    """A Train worker on node-a to which Ray gave physical GPU 0 (no simulation); torch sees CUDA
    or not."""
    import ray

    class Context:
        def get_node_id(self):
            return "node-a"

    monkeypatch.delenv(gpus.SIMULATE_ENV, raising=False)
    monkeypatch.setattr(devices, "physical_gpu_ids", lambda: ["0"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())


def test_a_gpu_that_torch_cannot_use_fails_with_what_to_check(monkeypatch):
    _ray_gave_gpu_0(monkeypatch, cuda_available=False)
    with pytest.raises(RuntimeError) as e:
        devices.train_device()
    message = str(e.value)
    assert "GPU 0 on node node-a" in message and "nvidia-smi" in message and gpus.SIMULATE_ENV in message


# -- GPUs the torch build has no kernels for ----------------------------------------------------

CU130_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]   # torch 2.14.1+cu130's list


def _fake_gpus(monkeypatch, devices: dict[int, tuple[str, tuple[int, int]]], archs=CU130_ARCHS) -> None:
    """torch.cuda as on a machine with `devices` ({index: (name, capability)}) under a CUDA build
    of torch with kernels for `archs`."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(archs))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: devices[i][1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: devices[i][0])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))


@pytest.mark.parametrize("capability, archs, supported", [
    ((7, 0), CU130_ARCHS, False),               # V100 under the CUDA 13 builds: "no kernel image"
    ((8, 6), CU130_ARCHS, True),                # A10G
    ((8, 9), ["sm_80", "sm_86"], True),         # L4: sm_86 machine code runs on later 8.x minors
    ((8, 0), ["sm_86"], False),                 # ... never on earlier ones
    ((9, 0), ["sm_75", "sm_80"], False),        # machine code stays within its major version
    ((9, 0), ["sm_75", "compute_80"], True),    # PTX is compiled on first use for later GPUs
    ((7, 0), ["compute_80"], False),            # ... not for earlier ones
    ((9, 0), ["sm_90a"], True),                 # arch-specific: that capability only
    ((10, 3), ["sm_100a"], False),
    ((10, 3), ["sm_100f"], True),               # family-specific: the 10.x family from 10.0
    ((12, 0), ["sm_100", "sm_90"], False),
    ((7, 0), [], True),                          # a build that lists nothing is not judged
])
def test_which_gpus_a_torch_build_has_kernels_for(capability, archs, supported):
    assert gpus.gpu_supported(capability, archs) is supported


def test_a_gpu_torch_was_not_built_for_is_refused_at_worker_start_naming_it_and_the_build(monkeypatch):
    _ray_gave_gpu_0(monkeypatch, cuda_available=True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    _fake_gpus(monkeypatch, {0: ("Tesla V100-SXM2-16GB", (7, 0))})
    with pytest.raises(RuntimeError) as e:
        devices.train_device()
    message = str(e.value)
    assert "GPU 0 on node node-a" in message
    assert "Tesla V100-SXM2-16GB (compute capability 7.0)" in message                   # the GPU
    assert f"torch {torch.__version__} (CUDA 13.0, kernels for sm_75, sm_80" in message  # the build
    assert "sm_70" in message and "no kernel image" in message


def test_unsupported_gpus_lists_only_the_gpus_without_kernels(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _fake_gpus(monkeypatch, {0: ("Tesla V100-SXM2-16GB", (7, 0)), 1: ("NVIDIA A100-SXM4-40GB", (8, 0))})
    lines = devices.unsupported_gpus()
    assert len(lines) == 1 and lines[0].startswith("GPU 0: Tesla V100-SXM2-16GB (compute capability 7.0)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.unsupported_gpus() == []                      # no CUDA here: nothing to refuse


# -- what a waiting trial holds on its GPU (the lease's record) --------------------------------

class _FakeNvml:
    """pynvml with two GPUs, each running the processes given (pid, bytes), looked up by UUID."""

    def __init__(self, processes_by_uuid: dict[str, list[tuple[int, int]]]):
        self.processes = processes_by_uuid

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.processes:
            raise RuntimeError(f"NVML: no GPU {uuid}")
        return uuid

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        from types import SimpleNamespace

        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes[handle]]


def _use_nvml(monkeypatch, fake) -> None:
    import contextlib

    monkeypatch.setattr(gpus, "nvml", lambda: contextlib.nullcontext(fake))


def test_nvml_counts_this_process_on_the_gpu_named_by_uuid_and_is_unknown_when_blind(monkeypatch):
    import os

    me = os.getpid()
    _use_nvml(monkeypatch, _FakeNvml({"GPU-aaa": [(me + 1, 9 * 2**20)], "GPU-bbb": [(me, 500 * 2**20)]}))
    assert gpus.nvml_process_memory_mb("GPU-bbb") == 500.0      # by UUID, whatever its index
    # Not listed (a container: NVML reports host PIDs): unknown, not "no memory"
    assert gpus.nvml_process_memory_mb("GPU-aaa") is None
    assert gpus.nvml_process_memory_mb("GPU-ccc") is None        # an NVML error
    _use_nvml(monkeypatch, None)                                  # no NVIDIA library
    assert gpus.nvml_process_memory_mb("GPU-bbb") is None


def test_a_waiting_worker_is_recorded_by_its_own_context_not_by_nvml_pids(monkeypatch):
    """The lease record asked when a worker takes its GPU: 0 without a CUDA context (asked
    in-process: NVML's pid list is blind in containers), NVML's count with one, and the device's
    used memory as CUDA reports it where NVML does not list the process (tests/test_hand_over.py)."""
    from types import SimpleNamespace

    from vidtune.trainer.training import device_memory, precision

    run = SimpleNamespace(device=torch.device("cuda", 0))
    contexts, nvml_mb = {"has": False}, {"mb": None}
    monkeypatch.setattr(device_memory, "has_cuda_context", lambda device: contexts["has"])
    monkeypatch.setattr(device_memory, "device_uuid", lambda device: "GPU-bbb")
    monkeypatch.setattr(device_memory, "nvml_process_memory_mb", lambda uuid: nvml_mb["mb"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000 * 2**20, 1048 * 2**20))
    nvml_mb["mb"] = 700.0                    # another process's count must not leak in: no context
    assert device_memory.process_device_mb(run) == 0.0
    contexts["has"] = True
    assert device_memory.process_device_mb(run) == 700.0
    nvml_mb["mb"] = None
    assert device_memory.process_device_mb(run) == 48.0
    # On this CPU build torch never started CUDA: no context, without making one.
    assert not precision.has_cuda_context(torch.device("cuda", 0)) and not torch.cuda.is_initialized()
