"""The CPUs of a training worker: how many a search's GPU trial asks Ray for by default, and how
a worker spends the ones it holds (DataLoader processes and torch threads).

A GPU worker's CPUs decode and batch the clips that keep its GPU busy; its own process mostly
launches kernels. Sized like a CPU-only trial's (0.9 CPU: a core less the trial driver's 0.1),
it got 1 torch thread and 2 loader processes, which leave a large GPU waiting for data. So:

- **The search's default `--cpus-per-worker` for GPU trials** (`gpu_worker_cpus`) is the share
  of its node's CPUs that goes with one GPU (the fewest CPUs per GPU among the GPU nodes, those
  the autoscaler may start included), split among the trial workers Ray places on one GPU at
  once (2 for one-worker trials on whole GPUs: one trains, the next starts behind it; k for
  `--gpus-per-trial 1/k`), less each one's trial driver, rounded down to half a CPU, never less
  than a CPU-only trial's 0.9. 8 CPUs a GPU (`g5.2xlarge`, deploy/kuberay's GPU pods): 3.5.
  CPU-only trials keep 0.9.
- **A worker's split** (`cpu_plan`): on the CPU, as before, a torch thread per CPU it holds and
  loaders on all but one (at least 2: `trainer.training.run.loader_workers`). On a GPU, 1 torch
  thread (2 from 6 CPUs) and loaders on the rest, at least `GPU_MIN_LOADERS` where its GPU's
  share of the node has the cores: the trial starting behind it on the same GPU only waits
  (`trainer.cluster.lease`) while this one trains, so its reserved CPUs are idle then.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from vidtune.trainer.training.run import MIN_LOADER_WORKERS, loader_workers

CPU_WORKER_CPUS = 0.9    # a CPU-only trial's worker: a core less its trial driver's 0.1
GPU_MIN_LOADERS = 4      # loader processes a GPU worker gets, where its GPU's CPUs hold them


def cpus_per_gpu(nodes: Iterable[tuple[float, float]]) -> float | None:
    """The fewest CPUs per GPU among `nodes` ((CPUs, GPUs) each) that have GPUs; None without any."""
    shares = [cpus / gpus for cpus, gpus in nodes if gpus > 0]
    return min(shares) if shares else None


def workers_per_gpu(workers_per_trial: int, gpus_per_worker: float) -> int:
    """Trial workers Ray places on one GPU at once: 2 for one-worker trials on a whole GPU (a lead
    training, a follower starting behind it: `tune.running.trial.TrialResources.overlaps`), k when
    packed k to a GPU (`--gpus-per-trial 1/k`), else 1 (workers of several-GPU trials)."""
    if workers_per_trial == 1 and gpus_per_worker == 1:
        return 2
    if 0 < gpus_per_worker < 1:
        return max(1, int(1 / gpus_per_worker + 1e-9))
    return 1


def gpu_worker_cpus(node_cpus_per_gpu: float, sharing: int, driver_cpus: float) -> float:
    """The default `--cpus-per-worker` of a GPU trial: `node_cpus_per_gpu` split among the
    `sharing` workers on one GPU, less each one's trial driver (`driver_cpus`), rounded down to
    half a CPU, at least `CPU_WORKER_CPUS`. 8 CPUs a GPU, 2 sharing: 3.5; 16: 7.5; 4: 1.5."""
    share = node_cpus_per_gpu / max(1, sharing) - driver_cpus
    return max(CPU_WORKER_CPUS, math.floor(share * 2 + 1e-9) / 2)


@dataclass(frozen=True)
class CpuPlan:
    """How a training worker spends its CPUs: `threads` for torch, `loaders` DataLoader processes."""

    threads: int
    loaders: int


def cpu_plan(cpus: float, *, on_gpu: bool, node_cpus_per_gpu: float | None = None,
             threads: int | None = None, loaders: int | None = None) -> CpuPlan:
    """The split of a worker holding `cpus` CPUs (Ray's grant): `threads` (--cpu-threads) and
    `loaders` (--loader-workers) when given. On the CPU: a thread per whole CPU (at least 1),
    loaders on all but one (`trainer.training.run.loader_workers`). On a GPU: 1 thread (2 from 6
    CPUs), loaders on the rest, at least `GPU_MIN_LOADERS` where `node_cpus_per_gpu` (its node's
    CPUs per GPU) has them beside the threads, and at least `MIN_LOADER_WORKERS`."""
    whole = int(cpus + 1e-9)
    if not on_gpu:
        return CpuPlan(threads or max(1, whole), loader_workers(loaders, cpus))
    threads = threads or (2 if whole >= 6 else 1)
    if loaders is None:
        room = int((node_cpus_per_gpu or cpus) + 1e-9) - threads   # the cores that go with its GPU
        loaders = max(MIN_LOADER_WORKERS, whole - threads, min(GPU_MIN_LOADERS, room))
    return CpuPlan(threads, loaders)
