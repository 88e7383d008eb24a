"""The device memory a Train worker holds for its run, and letting go of it once the run will
not train again: what the device lease records when a worker takes its device and when it hands
it over (`trainer.cluster.lease`, `trainer.cluster.worker`).
"""
from __future__ import annotations

import torch

from vidtune.trainer.models.registry import unwrap
from vidtune.trainer.training.gpus import nvml_process_memory_mb
from vidtune.trainer.training.precision import device_uuid, free_memory, has_cuda_context
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
    record when the worker asks for the device: 0 means it waited in host memory (no CUDA context
    there, asked in-process). With a context: NVML's count for this process (the context
    included, which torch's allocator does not count), matched by the device's UUID; where NVML
    does not list this process (a container: it reports host PIDs), the allocator's reserved
    memory, a lower bound. `held_device_mb` on the CPU."""
    if run.device.type != "cuda":
        return held_device_mb(run)
    if not has_cuda_context(run.device):
        return 0.0
    used = nvml_process_memory_mb(device_uuid(run.device))
    return used if used is not None else held_device_mb(run)
