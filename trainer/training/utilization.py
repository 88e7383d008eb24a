"""How busy the device was during an epoch, so a slow trial shows why (a GPU at 30% waits on
something; a CPU run at 50% of its cores is not using them all).

- On a CUDA device: the GPU's utilisation as NVML reports it (`torch.cuda.utilization`, which
  needs the `nvidia-ml-py` package), sampled once a second in a thread and averaged.
- On the CPU: this process's CPU time over the epoch (all its threads; the DataLoader's worker
  processes are not included) as a share of the cores it may use.

Either way a percentage, 0..100, or NaN when the device does not report it.

`OtherCpuLoad` says what else ran meanwhile: the cores that processes other than this one and its
descendants (the DataLoader's workers) kept busy on this machine during the epoch. A training's
clips/s depends on them (another trial starting beside it, a neighbour's job). Read with psutil;
NaN where it cannot read them.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass

import psutil
import torch

SAMPLE_EVERY_S = 1.0


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class DeviceUtilization:
    """`start()` at the epoch's start, `stop() -> percent` at its end."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cpu0 = self._wall0 = 0.0

    def start(self) -> None:
        self._samples, self._cpu0, self._wall0 = [], time.process_time(), time.perf_counter()
        if self.device.type == "cuda" and self._gpu_percent() is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True, name="vidtune-gpu-util")
            self._thread.start()

    def stop(self) -> float:
        if self.device.type == "cuda":
            if self._thread is not None:
                self._stop.set()
                self._thread.join(timeout=5)
                self._thread = None
            return sum(self._samples) / len(self._samples) if self._samples else math.nan
        wall = time.perf_counter() - self._wall0
        if wall <= 0:
            return math.nan
        return min(100.0, 100.0 * (time.process_time() - self._cpu0) / (wall * _cores()))

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            value = self._gpu_percent()
            if value is not None:
                self._samples.append(value)

    def _gpu_percent(self) -> float | None:
        try:
            return float(torch.cuda.utilization(self.device))
        except Exception:   # no nvidia-ml-py, or NVML cannot read this device
            return None


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (user, nice, system, irq, softirq, steal; the
    fields a platform lacks count 0). Guest time is left out: Linux counts it in user and nice."""
    times = psutil.cpu_times()
    return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def _cpu_s(process: psutil.Process) -> float:
    """The user + system CPU seconds of `process` and of the children it has reaped."""
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def process_tree_cpu(pid: int | None = None) -> dict[tuple[int, float], float]:
    """{(pid, start time): CPU seconds} of process `pid` (default this one) and of every live
    descendant (children of children too), each with the children it has reaped. Keyed by start
    time as well, so a reused pid is another process."""
    root = psutil.Process(pid)
    out = {(root.pid, root.create_time()): _cpu_s(root)}
    for child in root.children(recursive=True):
        try:
            out[(child.pid, child.create_time())] = _cpu_s(child)
        except psutil.Error:        # it ended between the listing and the read
            continue
    return out


def tree_cpu_since(before: dict[tuple[int, float], float], now: dict[tuple[int, float], float]) -> float:
    """CPU seconds the process tree used between two `process_tree_cpu` readings: each live
    process's growth, all of a new one's. A process that ended in between is left out (its time
    is gone with it, unless a process of the tree reaped it: then it is in that one's growth), so
    a descendant that exits never makes the sum negative."""
    return sum(cpu - before.get(key, 0.0) for key, cpu in now.items())


@dataclass(frozen=True)
class CpuWindow:
    """One process tree's view of an epoch: the machine's busy CPU seconds, its own (with its
    children's) and the wall seconds, all over the epoch."""

    busy_s: float
    own_s: float
    wall_s: float


class OtherCpuLoad:
    """`start()` at the epoch's start, `stop() -> CpuWindow | None` at its end (None when the
    CPU times cannot be read). Sampled at the two ends only, so it costs nothing during the epoch."""

    def __init__(self) -> None:
        self._start: tuple[float, dict[tuple[int, float], float], float] | None = None

    def start(self) -> None:
        try:
            self._start = (machine_busy_s(), process_tree_cpu(), time.perf_counter())
        except (OSError, psutil.Error):
            self._start = None

    def stop(self) -> CpuWindow | None:
        if self._start is None:
            return None
        busy0, own0, wall0 = self._start
        try:
            return CpuWindow(machine_busy_s() - busy0, tree_cpu_since(own0, process_tree_cpu()),
                             time.perf_counter() - wall0)
        except (OSError, psutil.Error):
            return None


def other_cores(windows: dict[str, list[CpuWindow | None]]) -> float:
    """Cores that other processes kept busy during the epoch on the busiest machine: per node
    (key: node id; values: the windows of the run's workers there), the machine's busy time less
    all of those workers' own, per wall second. NaN when no node could measure; 0 = nothing
    else ran."""
    per_node = []
    for views in windows.values():
        seen = [w for w in views if w is not None and w.wall_s > 0]
        if not seen or len(seen) < len(views):
            continue
        busy = sum(w.busy_s for w in seen) / len(seen)      # each worker saw the same machine
        wall = sum(w.wall_s for w in seen) / len(seen)
        per_node.append(max(0.0, busy - sum(w.own_s for w in seen)) / wall)
    return max(per_node, default=math.nan)
