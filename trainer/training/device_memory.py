"""The device memory a Train worker holds for its run, and letting go of it once the run will
not train again: what the device lease records when a worker takes its device and when it hands
it over (`trainer.cluster.lease`, `trainer.cluster.worker`).

What a worker can let go of before it hands over: its tensors and torch's cached blocks
(`free_device`), and the process group (`release_process_group`: NCCL's communicator, hundreds
of MB of GPU buffers per GPU, GBs with NVLink SHARP on H100 SXM, which `empty_cache` cannot
reach). What stays until the process exits: the CUDA context, cuDNN's and cuBLAS's handles,
torchvision's nvJPEG decoder (one per process, with no call to free it) and compiled kernels.
So the hand-over records what the device holds for the process (`process_device_mb`: NVML's
count, or the device's used memory), not what torch's allocator holds (0 once emptied).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from vidtune.trainer.models.registry import unwrap
from vidtune.trainer.training.gpus import nvml_process_memory_mb
from vidtune.trainer.training.precision import device_uuid, free_memory, has_cuda_context, synchronize
from vidtune.trainer.training.run import Run


def free_device(run: Run) -> None:
    """Let go of everything the run holds on its device, for a run that will not train again:
    the optimiser's state and the gradients, the parameters' and buffers' storage (each left an
    empty tensor of its dtype, on its device), DDP's wrapper with its gradient buckets, and the
    caching allocator's cached blocks (`free_memory`). The checkpoint is written before."""
    run.optimizer.state.clear()
    run.optimizer.zero_grad(set_to_none=True)
    # The plain model, out of every wrapper: DDP holds gradient buckets as large as the weights,
    # and under --compile DDP sits inside torch.compile's wrapper, not at the top.
    run.model = unwrap(run.model)
    with torch.no_grad():
        for tensor in (*run.model.parameters(), *run.model.buffers()):
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    free_memory(run.device)


def release_process_group(device: torch.device) -> None:
    """Destroy torch.distributed's process group (`dist.destroy_process_group`) and return what it
    held on `device`: NCCL's communicator and its buffers (DDP's gradient all-reduce made them).
    Call it on every rank after the run's last collective (Ray Train's own shutdown skips a group
    already destroyed). Queued GPU work (NCCL kernels included) is waited for first: a
    communicator destroyed under a running kernel can hang. A no-op without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    synchronize(device)
    dist.destroy_process_group()
    free_memory(device)


def held_device_mb(run: Run) -> float:
    """The device memory (MiB) this worker holds for its run. On a GPU, what torch's caching
    allocator reserves there (what another process cannot have), 0 before this process made a
    CUDA context (asking would make one); on the CPU (simulated GPUs included), the bytes of the
    model's parameters, buffers and gradients and of the optimiser's state."""
    if run.device.type == "cuda":
        return torch.cuda.memory_reserved(run.device) / 2**20 if torch.cuda.is_initialized() else 0.0
    params = list(run.model.parameters())
    tensors = [*params, *run.model.buffers(), *(p.grad for p in params if p.grad is not None),
               *(v for state in run.optimizer.state.values() for v in state.values() if torch.is_tensor(v))]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == run.device.type) / 2**20


def process_device_mb(run: Run) -> float:
    """The GPU memory this process has on its device as the driver sees it, for the lease's
    record when the worker asks for the device and when it hands it over: 0 means no CUDA
    context there (asked in-process: a worker waiting in host memory). With a context: NVML's
    count for this process (the context, the allocator's blocks, NCCL, cuDNN/cuBLAS, nvJPEG),
    matched by the device's UUID; where NVML does not list this process (a container: it reports
    host PIDs) or cannot be loaded, the device's used memory as CUDA reports it
    (`torch.cuda.mem_get_info`: this context included, so never 0 while it lives; other
    processes on that GPU too, so an upper bound). `held_device_mb` on the CPU."""
    if run.device.type != "cuda":
        return held_device_mb(run)
    if not has_cuda_context(run.device):
        return 0.0
    used = nvml_process_memory_mb(device_uuid(run.device))
    if used is not None:
        return used
    free, total = torch.cuda.mem_get_info(run.device)   # this process has its context: none made
    return (total - free) / 2**20
