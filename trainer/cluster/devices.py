"""Which GPUs a Train worker was given and the device it trains on; GPUs a torch build cannot run on.

Ray hands each worker GPU ids (`get_accelerator_ids()["GPU"]`): the GPUs' physical indices on
their node, the entries of the node's `CUDA_VISIBLE_DEVICES` (Ray Train then sets one
`CUDA_VISIBLE_DEVICES` for all of a run's workers on a node, so a torch device index is a
position in that shared list, not an id). Leases and the `gpu_ids` recorded per trial use the
physical ids.

On a GPU outside the build's kernel list (a V100, compute capability 7.0, under torch 2.14's
CUDA 13 builds) CUDA itself works and the first kernel fails with "no kernel image is
available". `unsupported_gpus` finds such GPUs up front (`trainer.training.gpus.gpu_supported` is the
rule); a worker refuses one when it picks its device, and the search's node setup check
(`tune.running.cluster.check_every_node`) on every GPU node.

The light half (simulated GPUs, the architecture rule, NVML) is `trainer.training.gpus`, which the CLIs'
--help imports; this module imports torch and Ray.
"""
from __future__ import annotations

import os

import ray
import torch

from vidtune.trainer.cluster.lease import physical_gpu_ids
from vidtune.trainer.training.gpus import SIMULATE_ENV, gpu_supported, simulated_gpus


def train_device() -> torch.device:
    """The torch device this Train worker trains on.

    No GPU from Ray: the CPU. A GPU from Ray: that GPU (the position of its id in
    `CUDA_VISIBLE_DEVICES`); under VIDTUNE_SIMULATE_GPUS, the CPU. Works in a Train worker and
    in a plain Ray task. A GPU from Ray that torch cannot use raises RuntimeError saying what to check, rather
    than training on the CPU for hours while the search reports GPU speeds; so does a GPU the torch
    build has no kernels for (`unsupported_gpu`), naming the GPU and the build."""
    gpu_ids = physical_gpu_ids()
    if not gpu_ids or simulated_gpus():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        node = ray.get_runtime_context().get_node_id()
        raise RuntimeError(
            f"Ray gave this worker GPU {','.join(gpu_ids)} on node {node}, but torch {torch.__version__} "
            f"(CUDA {torch.version.cuda or 'none: a CPU-only build'}) cannot use CUDA there. Check "
            "`nvidia-smi` on that node (the NVIDIA driver must support this CUDA version) and that a "
            f"CUDA build of torch is installed; to try the search without GPUs set {SIMULATE_ENV}=N instead")
    # Ray's rule (ray.train.torch.get_device, which only a Train worker may call): the position
    # of this worker's first GPU in CUDA_VISIBLE_DEVICES, which Ray Train shares among a run's
    # workers on a node and a plain Ray task has to itself.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    device = torch.device("cuda", visible.index(gpu_ids[0]) if gpu_ids[0] in visible else 0)
    problem = unsupported_gpu(device.index)
    if problem:   # before the first kernel, which would fail with "no kernel image is available"
        raise RuntimeError(f"Ray gave this worker GPU {gpu_ids[0]} on node "
                           f"{ray.get_runtime_context().get_node_id()}: {problem}")
    return device


def torch_build() -> str:
    """'torch 2.14.1+cu130 (CUDA 13.0, kernels for sm_75, sm_80, ...)': what the messages name."""
    arch = ", ".join(torch.cuda.get_arch_list()) or "no list"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}, kernels for {arch})"


def unsupported_gpu(index: int) -> str | None:
    """Why torch cannot run on CUDA device `index` of this process (a GPU of a compute capability
    its build has no kernels for), naming the GPU and the build and what to do; None when it can
    (or when this is not a CUDA build: ROCm's architectures are named otherwise)."""
    if not torch.version.cuda:
        return None
    capability = torch.cuda.get_device_capability(index)
    if gpu_supported(capability, torch.cuda.get_arch_list()):
        return None
    name = torch.cuda.get_device_name(index)
    wanted = f"sm_{capability[0]}{capability[1]}"
    return (f"{name} (compute capability {capability[0]}.{capability[1]}) is not a GPU {torch_build()} "
            f"was built for, and its first kernel would fail with \"no kernel image is available\"; install "
            f"a torch build whose torch.cuda.get_arch_list() covers {wanted} (an older CUDA build, e.g. from "
            "https://download.pytorch.org/whl/cu126), or train on other GPUs")


def unsupported_gpus() -> list[str]:
    """`unsupported_gpu` for each CUDA device this process sees, as 'GPU i: why'; [] when torch
    supports them all or sees none. Reading a capability starts CUDA's runtime in this process
    (no tensor is made): run it in a process that exits afterwards, not in a search's driver."""
    if not torch.cuda.is_available():
        return []
    problems = ((i, unsupported_gpu(i)) for i in range(torch.cuda.device_count()))
    return [f"GPU {i}: {why}" for i, why in problems if why]
