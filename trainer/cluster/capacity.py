"""Whether a training's workers fit where it runs: one set of rules for `vidtune train` and the
search's trials, checked on the driver before any worker is asked for.

Ray Train places each worker on one node and waits, without end and without a word, for
resources that never come (a worker wanting more GPUs or CPUs than any node has, more workers
than GPUs), and NCCL refuses two ranks of one run on one GPU. So the request is refused first,
naming the flag and value: `check_gpus_per_worker` needs only the flags (both CLIs run it before
Ray starts); `check_fits` compares the request with the nodes (`vidtune train` reads this
machine's before it starts a local Ray, `local_capacity`; on a cluster, and in a search, the
running cluster's and the nodes its autoscaler may start, `capacity_of`).
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from vidtune.flags import ConfigError
from vidtune.trainer.training.gpus import simulated_gpus

AUTOSCALER_CONFIG = Path("~/ray_bootstrap_config.yaml")   # where `ray up` leaves it on the head node
HEAD_RESOURCE = "node:__internal_head__"                   # Ray's resource that marks the head node

Node = tuple[float, float]    # (CPUs, GPUs) of one node


@dataclass(frozen=True)
class NodeType:
    """A worker node type of the autoscaler's config: its resources and how many it may start.
    `gpus` is None when the config leaves them for the cloud provider to detect."""

    name: str
    cpus: float
    gpus: float | None
    max_workers: int


@dataclass(frozen=True)
class ClusterCapacity:
    """`alive`: the (CPUs, GPUs) of each node alive now; `head`: the head's, or None when no
    node is the head (a local Ray: its one node); `node_types`: what the autoscaler may start;
    `head_memory_gb`: the head's Ray `memory` resource (what Ray lets tasks and actors use
    there: the machine's memory less the object store; None when unknown)."""

    alive: tuple[Node, ...]
    head: Node | None = None
    node_types: tuple[NodeType, ...] = field(default_factory=tuple)
    head_memory_gb: float | None = None

    @property
    def gpus_now(self) -> float:
        return sum(g for _, g in self.alive)

    @property
    def planned(self) -> tuple[Node, ...]:
        """The nodes once the autoscaler has started all it may (the head and every worker type
        x max_workers); the alive nodes when that is not more."""
        # A type whose GPUs the cloud provider detects counts as one GPU a node (a `ray up` head's
        # config has them filled in; a config given by hand may not).
        planned = ((self.head,) if self.head else ()) + tuple(
            (t.cpus, 1.0 if t.gpus is None else t.gpus)
            for t in self.node_types for _ in range(t.max_workers))
        total = lambda nodes: (sum(c for c, _ in nodes), sum(g for _, g in nodes))   # noqa: E731
        return planned if self.node_types and total(planned) > total(self.alive) else self.alive

    @property
    def may_add_gpus(self) -> bool:
        """The autoscaler can start nodes with GPUs (declared, or left for the cloud to detect)."""
        return any(t.max_workers > 0 and (t.gpus is None or t.gpus > 0) for t in self.node_types)


def read_node_types(config: Path = AUTOSCALER_CONFIG) -> tuple[NodeType, ...]:
    """The worker node types of an autoscaler cluster config (the head's type left out); () when
    there is no such file (not a `ray up` head) or it cannot be read. The cluster-wide
    `max_workers` caps the types' own, GPU types first (what a search asks for)."""
    path = config.expanduser()
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return ()
    head = doc.get("head_node_type")
    types = []
    for name, node in (doc.get("available_node_types") or {}).items():
        if name == head or not isinstance(node, dict):
            continue
        resources = node.get("resources") or {}
        # No resources at all: the cloud provider detects them (a `ray up` head's copy has them).
        gpus = float(resources.get("GPU", 0) or 0) if resources else None
        types.append(NodeType(str(name), float(resources.get("CPU", 0) or 0), gpus,
                              int(node.get("max_workers", 0) or 0)))
    cap = doc.get("max_workers")
    if cap is None:
        return tuple(types)
    left, capped = int(cap), []
    for t in sorted(types, key=lambda t: -(1.0 if t.gpus is None else t.gpus)):
        capped.append(NodeType(t.name, t.cpus, t.gpus, min(t.max_workers, left)))
        left -= capped[-1].max_workers
    return tuple(capped)


def capacity_of(nodes: Sequence[dict], config: Path | None) -> ClusterCapacity:
    """The running Ray cluster's capacity from its `nodes` (`ray.nodes()`: the caller, which has
    Ray, asks; this module stays Ray-free for the checks before Ray starts); `config`: the
    autoscaler's cluster config (None: no autoscaler)."""
    alive, head, head_memory = [], None, None
    for n in nodes:
        if not n.get("Alive"):
            continue
        res = n.get("Resources") or {}
        node = (float(res.get("CPU", 0.0)), float(res.get("GPU", 0.0)))
        alive.append(node)
        if HEAD_RESOURCE in res:
            head = node
            head_memory = float(res["memory"]) / 2**30 if res.get("memory") else None
    return ClusterCapacity(tuple(alive), head, read_node_types(config) if config is not None else (),
                           head_memory_gb=head_memory)


# A container's CPU quota, as Ray reads it when it counts a node's CPUs: cgroup v2, then v1.
CPU_QUOTA_FILES = (("/sys/fs/cgroup/cpu.max", None),
                   ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def local_cpus() -> float:
    """The CPUs a Ray started on this machine counts: the cores this process may run on, or a
    container's CPU quota when that is less (a 2-CPU container on a 64-core host has 2)."""
    cores = float(len(os.sched_getaffinity(0)))
    quota = cpu_quota()
    return min(cores, max(1.0, quota)) if quota is not None else cores


def cpu_quota() -> float | None:
    """The cgroup's CPU quota in CPUs (quota / period), None when there is none or none can be read."""
    for quota_file, period_file in CPU_QUOTA_FILES:
        try:
            text = Path(quota_file).read_text().split()
            if period_file is None:                       # v2: "max 100000" or "200000 100000"
                quota, period = text[0], text[1]
            else:                                         # v1: "-1" or "200000", period apart
                quota, period = text[0], Path(period_file).read_text().strip()
            if quota in ("max", "-1"):
                return None
            return int(quota) / int(period)
        except (OSError, ValueError, IndexError):
            continue
    return None


def local_gpus() -> float:
    """The GPUs a Ray started on this machine gets: VIDTUNE_SIMULATE_GPUS when set, else the
    CUDA devices torch sees (both, like Ray, within CUDA_VISIBLE_DEVICES)."""
    if simulated_gpus():
        return float(simulated_gpus())
    import torch  # heavy (seconds): only once the flags have been checked

    return float(torch.cuda.device_count()) if torch.cuda.is_available() else 0.0


def local_capacity() -> ClusterCapacity:
    """This machine as one node: what a local Ray started by `trainer.ray_setup.launch.init_ray` offers."""
    node = (local_cpus(), local_gpus())
    return ClusterCapacity((node,), node)


def describe_nodes(nodes: tuple[Node, ...]) -> str:
    """'2 x (8 CPU, 1 GPU), 1 x (4 CPU)' for a list of nodes."""
    counts: dict[Node, int] = {}
    for node in nodes:
        counts[node] = counts.get(node, 0) + 1
    return ", ".join(f"{n} x ({c:g} CPU{f', {g:g} GPU' if g else ''})" for (c, g), n in counts.items())


@dataclass(frozen=True)
class WorkerRequest:
    """What one training (a `vidtune train` run, a search's trial) asks Ray for, and the flags
    that set it, for the messages."""

    workers: int
    cpus_per_worker: float
    gpus_per_worker: float                 # 0: training on CPUs
    extra_cpus: float = 0.0                # beside the workers: a search trial's driver
    workers_flag: str = "--workers"
    cpus_flag: str = "--cpus-per-worker"
    gpus_flag: str = "--gpus-per-worker"   # the flag the GPUs came from (or --workers, when defaulted)
    what: str = "the run"


def check_gpus_per_worker(per_worker: float | None, workers: int, *, flag: str, workers_flag: str,
                          whole: str) -> None:
    """A worker trains on a share of one GPU or on whole GPUs. With more than one worker, a share
    would put two ranks of one run on one GPU (NCCL: "Duplicate GPU detected"), and Ray refuses
    a share above 1 that is not whole. `whole`: the flag and value that give each worker a whole
    GPU, for the message. ConfigError naming `flag`; None and 0 (no GPU) pass."""
    if not per_worker:
        return
    if workers > 1 and per_worker < 1:
        raise ConfigError(flag, f"{per_worker:g} GPU per worker with {workers_flag} {workers} puts two ranks "
                          f"of one training on one GPU, which NCCL refuses; give each worker a whole GPU "
                          f"({whole}) or use one worker")
    if per_worker > 1 and not float(per_worker).is_integer():
        raise ConfigError(flag, f"{per_worker:g} GPUs per worker: a worker takes a share of one GPU or whole "
                          "GPUs; pass a whole number, or a share below 1")


def check_fits(request: WorkerRequest, nodes: Sequence[Node], *, where: str, more: str) -> None:
    """`request` fits on `nodes`: its GPUs and CPUs in all, and each worker on one node. Otherwise
    ConfigError naming the flag and value at fault; `where` names the nodes ("this machine",
    "the Ray cluster") and `more` is the other way out ("add GPU nodes")."""
    r = request
    cpus, gpus = sum(c for c, _ in nodes), sum(g for _, g in nodes)
    asked = r.workers * r.gpus_per_worker
    if asked > gpus + 1e-9:
        raise ConfigError(r.gpus_flag, f"{r.what} asks for {asked:g} GPU(s) ({r.workers_flag} {r.workers} x "
                          f"{r.gpus_per_worker:g} per worker) but {where} has {gpus:g}; lower {r.gpus_flag} "
                          f"or {more}")
    cpu_asked = r.workers * r.cpus_per_worker
    if cpu_asked + r.extra_cpus > cpus + 1e-9:
        driver = f" plus {r.extra_cpus:g} for its driver" if r.extra_cpus else ""
        raise ConfigError(f"{r.workers_flag}/{r.cpus_flag}", f"{r.what} asks for {cpu_asked:g} CPUs ("
                          f"{r.workers_flag} {r.workers} x {r.cpus_flag} {r.cpus_per_worker:g}){driver} but "
                          f"{where} has {cpus:g}; lower them")
    # Each worker is one process on one node: the totals can fit while no node holds a worker.
    gpw = r.gpus_per_worker
    on_cpus = [math.floor((c + 1e-9) / r.cpus_per_worker) for c, _ in nodes]
    on_gpus = [math.floor((g + 1e-9) / gpw) if gpw else math.inf for _, g in nodes]
    by_node = sum(min(c, g) for c, g in zip(on_cpus, on_gpus, strict=True))
    if by_node < r.workers:
        flag, value = ((r.gpus_flag, gpw) if sum(on_gpus) < r.workers else (r.cpus_flag, r.cpus_per_worker))
        need = f"{r.cpus_per_worker:g} CPUs" + (f" and {gpw:g} GPU(s)" if gpw else "")
        raise ConfigError(flag, f"{by_node} of the {r.workers} worker(s) fit: each needs {need} on one node, "
                          f"and {where} has {describe_nodes(tuple(nodes))}; lower {flag} {value:g}")
