"""A trial's hand-over of its GPUs: every rank lets go of the process group (NCCL's communicator)
after the run's last collective, and the lease records what the device still holds for each
process as NVML counts it, once every rank has handed back. NVML and CUDA's queries are fakes
here (a CPU machine); the process group, the hand-over and the lease's bookkeeping are real."""
from __future__ import annotations

import asyncio
import contextlib
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from vidtune.trainer.cluster import worker
from vidtune.trainer.cluster.lease import LeaseBook
from vidtune.trainer.training import device_memory, gpus

NCCL_MB, CONTEXT_MB = 2048, 700   # NCCL's communicator (NVLS on H100 SXM: GBs); a context, cuDNN, nvJPEG


class NvmlWhileTheGroupLives:
    """pynvml for one GPU (GPU-bbb) running this process: its context and libraries, plus NCCL's
    buffers for as long as torch.distributed's process group exists."""

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != "GPU-bbb":
            raise RuntimeError(f"NVML: no GPU {uuid}")
        return uuid

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        used = CONTEXT_MB + (NCCL_MB if dist.is_initialized() else 0)
        return [SimpleNamespace(pid=os.getpid(), usedGpuMemory=used * 2**20)]


class Slot:
    """The worker's side of the lease, recording what it is told."""

    def __init__(self):
        self.told: list[tuple] = []

    def hand_back(self, rank, ranks, device_mb=None):
        self.told.append(("hand_back", rank, ranks, device_mb))

    def release(self, device_mb=None):
        self.told.append(("release", device_mb))


def test_the_hand_over_destroys_the_process_group_and_records_nvmls_count(monkeypatch, tmp_path):
    """After the last epoch: weights and optimiser state freed, the group destroyed (NCCL's 2 GB
    with it), and the lease told the 700 MB NVML still counts for this process on the GPU named
    by its UUID. torch's allocator reads 0 once emptied: it was what the lease recorded before."""
    monkeypatch.setattr(gpus, "nvml", lambda: contextlib.nullcontext(NvmlWhileTheGroupLives()))
    monkeypatch.setattr(device_memory, "has_cuda_context", lambda device: True)
    monkeypatch.setattr(device_memory, "device_uuid", lambda device: "GPU-bbb")
    monkeypatch.setattr(device_memory, "free_memory", lambda device: None)   # CUDA calls: no GPU here
    monkeypatch.setattr(device_memory, "synchronize", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    model = nn.Linear(16, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    run = SimpleNamespace(model=model, optimizer=optimizer, device=torch.device("cuda", 0), rank=0, world=1)
    slot = Slot()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        worker._hand_over(SimpleNamespace(run=run, slot=slot))
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert slot.told == [("hand_back", 0, 1, float(CONTEXT_MB))]
    assert not optimizer.state and model.weight.numel() == 0


def test_the_fallback_reads_the_devices_used_memory_never_0_for_a_live_context(monkeypatch):
    """Where NVML does not list this process (a container) or cannot be loaded, the record is
    the device's used memory as CUDA reports it: the context counts, where the emptied allocator
    reads 0."""
    run = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(gpus, "nvml", lambda: contextlib.nullcontext(None))      # no NVIDIA library
    monkeypatch.setattr(device_memory, "has_cuda_context", lambda device: True)
    monkeypatch.setattr(device_memory, "device_uuid", lambda device: "GPU-bbb")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: ((80 * 1024 - 612) * 2**20, 80 * 2**30))   # (free, total)
    assert device_memory.process_device_mb(run) == 612.0
    monkeypatch.setattr(device_memory, "has_cuda_context", lambda device: False)  # waiting: no context
    assert device_memory.process_device_mb(run) == 0.0


def test_releasing_the_process_group_without_one_does_nothing():
    assert not dist.is_initialized()
    device_memory.release_process_group(torch.device("cpu"))


def test_the_lease_lets_the_devices_go_once_every_rank_handed_back():
    """Each rank hands back on its own (no collective: the group is gone): the devices stay the
    trial's until the last rank has, and the record says the most any rank held, and each one's."""
    async def scenario():
        book = LeaseBook(clock=iter(range(100)).__next__)
        await book.acquire("t", ["n/gpu:0", "n/gpu:1"], device_mb=0.0)
        follower = asyncio.create_task(book.acquire("next", ["n/gpu:1"], device_mb=0.0))
        await asyncio.sleep(0)
        assert await book.hand_back("t", rank=1, ranks=2, device_mb=2700.0) is False
        await asyncio.sleep(0)
        assert not follower.done() and book.held["t"]          # rank 0 still holds its GPU
        assert await book.hand_back("t", rank=0, ranks=2, device_mb=650.0) is True
        await asyncio.wait_for(follower, 1)
        release = [e for e in book.record if e["event"] == "release"]
        assert [(e["owner"], e["device_mb"], e["ranks_mb"]) for e in release] == [
            ("t", 2700.0, [650.0, 2700.0])]
        assert book.snapshot()["holders"] == {"n/gpu:1": ["next"]}

    asyncio.run(scenario())


@pytest.mark.parametrize("said, recorded", [([None, None], None), ([None, 5.0], 5.0)])
def test_a_rank_that_could_not_say_counts_as_unknown(said, recorded):
    async def scenario():
        book = LeaseBook()
        await book.acquire("t", ["n/gpu:0", "n/gpu:1"])
        for rank, mb in enumerate(said):
            await book.hand_back("t", rank=rank, ranks=2, device_mb=mb)
        assert book.record[-1]["event"] == "release" and book.record[-1]["device_mb"] == recorded

    asyncio.run(scenario())
