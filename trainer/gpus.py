"""Which GPUs a Train worker was given, the device it trains on, and simulated GPUs.

Ray hands each worker GPU ids (`get_accelerator_ids()["GPU"]`): the GPUs' physical indices on
their node, the entries of the node's `CUDA_VISIBLE_DEVICES` (Ray Train then sets one
`CUDA_VISIBLE_DEVICES` for all of a run's workers on a node, so a torch device index is a
position in that shared list, not an id). Leases and the `gpu_ids` recorded per trial use the
physical ids.

`VIDTUNE_SIMULATE_GPUS=N` gives a Ray that vidtune starts N GPUs that do not exist (Ray places
on declared resources, not on hardware): placement, leases and the recorded GPU ids are what
they would be on N real GPUs, while each worker trains on the CPU. It is for the tests and for
trying cluster behaviour without GPUs; a worker given a GPU without it must find CUDA, or fail.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vidtune.flags import ConfigError

if TYPE_CHECKING:
    import torch

# ray and torch are imported where they are used: trainer.launch (every CLI's --help) reads
# simulated_gpus() and must not pay seconds for them.

SIMULATE_ENV = "VIDTUNE_SIMULATE_GPUS"


def simulated_gpus() -> int:
    """N from VIDTUNE_SIMULATE_GPUS (0 when unset or empty). ConfigError naming the variable when
    it is not a whole number >= 0."""
    raw = os.environ.get(SIMULATE_ENV, "").strip()
    if not raw:
        return 0
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ConfigError(SIMULATE_ENV, f"{raw!r} is not a number of GPUs to simulate; pass a whole number "
                          "(e.g. 4), or unset it to use the real GPUs")
    return n


def physical_gpu_ids() -> list[str]:
    """The physical ids (on this worker's node) of the GPUs Ray gave this worker; [] for none."""
    import ray  # heavy at start: trainer.launch, imported by every CLI's --help, imports this module

    ids = ray.get_runtime_context().get_accelerator_ids().get("GPU") or []
    return [str(i) for i in ids]


def train_device() -> torch.device:
    """The torch device this Train worker trains on.

    No GPU from Ray: the CPU. A GPU from Ray: that GPU (the position of its id in
    `CUDA_VISIBLE_DEVICES`); under VIDTUNE_SIMULATE_GPUS, the CPU. Works in a Train worker and
    in a plain Ray task. A GPU from Ray that torch cannot use raises RuntimeError saying what to check, rather
    than training on the CPU for hours while the search reports GPU speeds."""
    import ray  # heavy at start (see physical_gpu_ids)
    import torch  # heavy at start: as ray

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
    return torch.device("cuda", visible.index(gpu_ids[0]) if gpu_ids[0] in visible else 0)
