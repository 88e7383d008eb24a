"""Light GPU facts a command reads before it pays for torch or Ray: simulated GPUs, which GPU
architectures a torch build has kernels for, and NVIDIA's management library (NVML).

`VIDTUNE_SIMULATE_GPUS=N` gives a Ray that vidtune starts N GPUs that do not exist (Ray places
on declared resources, not on hardware): placement, leases and the recorded GPU ids are what
they would be on N real GPUs, while each worker trains on the CPU. It is for the tests and for
trying cluster behaviour without GPUs; a worker given a GPU without it must find CUDA, or fail.

A torch build carries kernels for a list of GPU architectures (`torch.cuda.get_arch_list()`);
`gpu_supported` is the rule for whether a GPU of a compute capability is on it
(`trainer.cluster.devices` applies it to the GPUs a process sees).

Every CLI's --help imports this module (through trainer.ray_setup.launch): it imports neither torch nor Ray.
"""
from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any

from vidtune.flags import ConfigError

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


def nvml_device_used_mb(uuid: str) -> float | None:
    """GPU memory (MiB) in use on the GPU with this UUID, by every process (NVML's memory info:
    the device's view, which containers do not hide); None when NVML cannot be asked."""
    with nvml() as lib:
        if lib is None:
            return None
        try:
            return lib.nvmlDeviceGetMemoryInfo(lib.nvmlDeviceGetHandleByUUID(uuid)).used / 2**20
        except Exception:   # an NVML error: unknown, not zero
            return None
