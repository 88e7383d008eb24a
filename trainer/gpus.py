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

A torch build carries kernels for a list of GPU architectures (`torch.cuda.get_arch_list()`); on
a GPU outside it (a V100, compute capability 7.0, under torch 2.14's CUDA 13 builds) CUDA itself
works and the first kernel fails with "no kernel image is available". `unsupported_gpus` finds
such GPUs up front (`gpu_supported` is the rule); a worker refuses one when it picks its device,
and the search's node setup check (`tune.cluster.check_every_node`) on every GPU node.
"""
from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

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
    than training on the CPU for hours while the search reports GPU speeds; so does a GPU the torch
    build has no kernels for (`unsupported_gpu`), naming the GPU and the build."""
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
    device = torch.device("cuda", visible.index(gpu_ids[0]) if gpu_ids[0] in visible else 0)
    problem = unsupported_gpu(device.index)
    if problem:   # before the first kernel, which would fail with "no kernel image is available"
        raise RuntimeError(f"Ray gave this worker GPU {gpu_ids[0]} on node "
                           f"{ray.get_runtime_context().get_node_id()}: {problem}")
    return device


ARCH = re.compile(r"^(sm|compute)_(\d+)([af]?)$")   # sm_86, sm_90a, sm_100f, compute_120


def gpu_supported(capability: tuple[int, int], arch_list: Iterable[str]) -> bool:
    """Whether a torch built for `arch_list` (`torch.cuda.get_arch_list()`) has kernels for a GPU
    of compute `capability` (major, minor). `sm_XY` machine code runs on capability X.Y and
    later minors of major X (sm_80 on an A10G's 8.6, not on a V100's 7.0 or an H100's 9.0);
    `sm_XYa` only on X.Y itself; `sm_XYf` on the X family from X.Y up; `compute_XY` (PTX) is
    compiled on first use for any capability from X.Y up, later majors too. An empty list (a
    build that does not say) is taken as supported. NVIDIA's exceptions for Jetson boards
    (7.2, 8.7) are not modelled: training runs on discrete GPUs."""
    arch_list = list(arch_list)
    if not arch_list:
        return True
    major, minor = capability
    for arch in arch_list:
        m = ARCH.match(arch.strip())
        if not m:
            continue
        kind, digits, suffix = m.groups()
        code = (int(digits[:-1]), int(digits[-1]))
        if suffix == "a":
            ok = (major, minor) == code
        elif kind == "compute":
            ok = (major, minor) >= code
        else:
            ok = major == code[0] and minor >= code[1]
        if ok:
            return True
    return False


def torch_build() -> str:
    """'torch 2.14.1+cu130 (CUDA 13.0, kernels for sm_75, sm_80, ...)': what the messages name."""
    import torch  # heavy (seconds): only where a GPU is about to be used

    arch = ", ".join(torch.cuda.get_arch_list()) or "no list"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}, kernels for {arch})"


def unsupported_gpu(index: int) -> str | None:
    """Why torch cannot run on CUDA device `index` of this process (a GPU of a compute capability
    its build has no kernels for), naming the GPU and the build and what to do; None when it can
    (or when this is not a CUDA build: ROCm's architectures are named otherwise)."""
    import torch  # heavy: as in torch_build

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
    import torch  # heavy: as in torch_build

    if not torch.cuda.is_available():
        return []
    problems = ((i, unsupported_gpu(i)) for i in range(torch.cuda.device_count()))
    return [f"GPU {i}: {why}" for i, why in problems if why]



@contextlib.contextmanager
def nvml() -> Iterator[Any]:
    """NVIDIA's management library (nvidia-ml-py's `pynvml`), initialised for the block; None
    when it cannot be loaded or initialised (no driver: a CPU machine). It makes no CUDA context."""
    try:
        import pynvml  # optional at run time: a machine without NVIDIA's library

        pynvml.nvmlInit()
    except Exception:
        yield None
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def nvml_process_memory_mb(uuid: str) -> float | None:
    """GPU memory (MiB) this process uses on the GPU with this UUID ("GPU-..."), as the NVIDIA
    driver counts it (NVML: a CUDA context, the allocator's blocks, libraries' workspaces).

    Matched by UUID, not by index: NVML numbers GPUs in PCI order, CUDA (and Ray's ids) fastest
    first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, and Ray may hand out UUIDs. None when NVML cannot
    be asked, or does not list this process: in a container NVML reports host PIDs, so its list
    says nothing about this one (the caller knows from `has_cuda_context` whether there is one)."""
    with nvml() as lib:
        if lib is None:
            return None
        try:
            handle = lib.nvmlDeviceGetHandleByUUID(uuid)
            mine = [p.usedGpuMemory for p in lib.nvmlDeviceGetComputeRunningProcesses(handle)
                    if p.pid == os.getpid()]
        except Exception:   # an NVML error: unknown, not zero
            return None
    return sum(mine) / 2**20 if mine and all(mine) else None

