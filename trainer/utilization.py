"""How busy the device was during an epoch, so a slow trial shows why (a GPU at 30% waits on
something; a CPU run at 50% of its cores is not using them all).

- On a CUDA device: the GPU's utilisation as NVML reports it (`torch.cuda.utilization`, which
  needs the `nvidia-ml-py` package), sampled once a second in a thread and averaged.
- On the CPU: this process's CPU time over the epoch (all its threads; the DataLoader's worker
  processes are not included) as a share of the cores it may use.

Either way a percentage, 0..100, or NaN when the device does not report it.
"""
from __future__ import annotations

import math
import os
import threading
import time

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
