"""What the Ray cluster offers a search, now and once its autoscaler has started every node it
may, and how many trials run at once there.

A search on a cluster started from `cluster.yaml` begins with a CPU head and few or no GPU
nodes: sized by what is alive at that moment it would run one trial at a time, and Ray's
autoscaler, which starts a node only for a request that waits, would never start the others.
So the trials at once count the nodes the autoscaler can start too (its node types' resources
x `max_workers`, from the cluster config `ray up` leaves on the head), and the trials that do
not fit yet wait for them. The capacity model (`ClusterCapacity`, the node types) and the rule
that a trial's workers fit (`check_fits`) are `vidtune.trainer.cluster.capacity`'s, shared with `vidtune
train`; they are imported here under their old names.
"""
from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from vidtune import __version__
from vidtune.flags import ConfigError
from vidtune.trainer.cluster.capacity import (  # noqa: F401 (some re-exported for tune.runner and tests)
    AUTOSCALER_CONFIG,
    ClusterCapacity,
    Node,
    NodeType,
    WorkerRequest,
    capacity_of,
    check_fits,
    describe_nodes,
    read_node_types,
)
from vidtune.trainer.cluster.cpu_share import CPU_WORKER_CPUS, cpus_per_gpu, gpu_worker_cpus, workers_per_gpu
from vidtune.trainer.cluster.devices import unsupported_gpus
from vidtune.trainer.training.gpus import simulated_gpus
from vidtune.tune.config.options import SearchOptions, gpus_per_trial, with_defaults_for_hardware
from vidtune.tune.running.trial import DRIVER_CPUS, TrialResources

# What each trial alive keeps on the search driver's node, measured with Ray 2.60 (Train V2): its
# Tune trial driver (~500 MB, 0.1 CPU: Ray places it beside the search's driver until that node is
# half busy) and Ray Train's controller (~410 MB), which Train puts on its driver's node.
TRIAL_ON_HEAD_GB = 0.92
# What else lives in the head's Ray `memory` (the memory Ray found free when it started, less its
# object store): Ray's services (GCS, raylet, dashboard, autoscaler: ~1 GB), the search's own
# driver process (~1 GB with Tune, Optuna and the MLflow client) and an MLflow tracking server
# (cluster.yaml starts one there).
HEAD_RESERVE_GB = 2.5


def read_capacity(config: Path | None) -> ClusterCapacity:
    """The running Ray cluster's capacity (`trainer.cluster.capacity.capacity_of` its nodes); `config`:
    the autoscaler's cluster config (None: no autoscaler)."""
    return capacity_of(ray.nodes(), config)


def trials_the_head_holds(head_memory_gb: float | None) -> int | None:
    """Trials alive at once whose drivers and Train controllers the head's memory holds beside
    the search's driver (`head_memory_gb`: its Ray `memory` resource); None when unknown."""
    if not head_memory_gb:
        return None
    return max(1, math.floor((head_memory_gb - HEAD_RESERVE_GB) / TRIAL_ON_HEAD_GB))


def worker_slots(nodes: tuple[Node, ...], resources: TrialResources) -> int:
    """Trial workers that fit on `nodes` at once, each on one node (CPUs, and GPUs by role:
    a lead and a follower per GPU when trials overlap)."""
    total = 0
    for cpus, gpus in nodes:
        slots = math.floor((cpus + 1e-9) / resources.cpus_per_worker)
        if resources.use_gpu:
            per_gpu = 2 if resources.overlaps else 1 / resources.gpus_per_worker
            slots = min(slots, math.floor(gpus * per_gpu + 1e-9))
        total += slots
    return total


@dataclass(frozen=True)
class Fit:
    """What `fit_to_cluster` decided. `lead_slots`: GPUs a lead trial may have to itself
    (`trainer.cluster.lease.LeaseBook.take_role`; 0 when trials take no roles: CPU, several workers)."""

    opts: SearchOptions
    concurrency: int
    local_gpu: bool
    lead_slots: int = 0
    waits_for_nodes: bool = False
    gpus: float = 0.0            # GPUs the trials train on (counting the nodes still to start); 0 on CPUs
    note: str | None = None      # a line for the console: why fewer trials run at once than fit


def fit_to_cluster(opts: SearchOptions, capacity: ClusterCapacity) -> Fit:
    """Fill the hardware defaults (from the node types when no GPU node is alive yet), refuse
    trials the cluster can never hold (ConfigError naming the flag), and decide how many trials
    run at once, counting the nodes the autoscaler can start.

    Trials at once: on GPUs, with one-worker trials, two per GPU: a lead training and a follower
    starting up behind it (see `tune.running.trial.TrialResources` and `trainer.cluster.lease`); on CPU-only
    nodes one per node, where the starting trial would compete for the cores the training uses
    all of: measured on 2 cores (BENCHMARKS.md), trainings that overlapped a start took up to 2x
    longer and the search as a whole gained nothing. Unless `--cpu-threads` leaves a node's
    training some cores short of all: then, as on a GPU, the next trial starts on the free
    cores behind it."""
    nodes = capacity.planned
    cpus, gpus = sum(c for c, _ in nodes), sum(g for _, g in nodes)
    opts = with_cpus_per_worker(with_defaults_for_hardware(opts, cluster_gpus=gpus), nodes)
    r = opts.resources
    gpt = gpus_per_trial(opts)
    cpu_per_trial = r.workers_per_trial * _cpus_per_worker(opts)
    check_fits(trial_request(opts), nodes, where="the Ray cluster", more="add GPU nodes")
    resources = trial_resources(opts)
    # One GPU on this machine: said as "local GPU mode" (one trial trains on the GPU at a time, the
    # next starting beside it, as on every GPU; --gpus-per-trial 0.5 packs two).
    local_gpu = r.address is None and math.isclose(gpus, 1.0)
    fit = math.floor((cpus + 1e-9) / (cpu_per_trial + DRIVER_CPUS))
    if gpt > 0:
        fit = min(fit, worker_slots(nodes, resources) // r.workers_per_trial)
        slots = math.floor((gpus + 1e-9) * resources.trainings_per_gpu / r.workers_per_trial)
        per_slot = 2 if resources.overlaps else 1
    else:
        cpu_nodes = sum(1 for c, _ in nodes if c > 0)
        slots = cpu_nodes
        per_slot = 2 if leaves_cores_free(opts, cpus / max(1, cpu_nodes)) else 1
    concurrency = r.max_concurrent_trials or max(1, min(fit, per_slot * max(1, slots), opts.num_samples))
    concurrency, note = _within_the_head(concurrency, capacity.head_memory_gb,
                                         explicit=bool(r.max_concurrent_trials))
    lead_slots = math.floor(gpus + 1e-9) if resources.takes_roles else 0
    waits = gpt > 0 and capacity.gpus_now + 1e-9 < gpt
    return Fit(opts, concurrency, local_gpu, lead_slots, waits, gpus if gpt > 0 else 0.0, note)


def with_cpus_per_worker(opts: SearchOptions, nodes: tuple[Node, ...]) -> SearchOptions:
    """--cpus-per-worker when not given (GPUs per worker already filled in): a CPU-only trial's
    0.9, or for GPU trials the share of the CPUs that go with one GPU on `nodes`
    (`trainer.cluster.cpu_share.gpu_worker_cpus`), so that a GPU worker's loaders keep it fed."""
    r = opts.resources
    if r.cpus_per_worker is not None:
        return opts
    per_gpu = cpus_per_gpu(nodes) if (r.gpus_per_worker or 0) > 0 else None
    cpus = CPU_WORKER_CPUS if per_gpu is None else gpu_worker_cpus(
        per_gpu, workers_per_gpu(r.workers_per_trial, r.gpus_per_worker or 0.0), DRIVER_CPUS)
    return replace(opts, resources=replace(r, cpus_per_worker=cpus))


def _cpus_per_worker(opts: SearchOptions) -> float:
    """--cpus-per-worker, given or filled in (`with_cpus_per_worker`; a CPU trial's if neither)."""
    return opts.resources.cpus_per_worker or CPU_WORKER_CPUS


def _within_the_head(concurrency: int, head_memory_gb: float | None, *,
                     explicit: bool) -> tuple[int, str | None]:
    """The trials at once the head's memory holds (`trials_the_head_holds`), and a line saying
    why when that is fewer than the GPUs would run: at the README's scale (6 GPU nodes, a lead
    and a follower each) 12 trials keep ~11 GB on a 16 GB head, which then kills the search. An
    explicit --max-concurrent-trials is kept, with a warning."""
    held = trials_the_head_holds(head_memory_gb)
    if held is None or concurrency <= held:
        return concurrency, None
    each = (f"each trial keeps ~{TRIAL_ON_HEAD_GB:g} GB there (its Tune trial driver and Ray Train's "
            "controller)")
    if explicit:
        return concurrency, (f"warning: --max-concurrent-trials {concurrency} is more than the head node's "
                             f"{head_memory_gb:.1f} GB for Ray's tasks holds ({held}): {each}; the head may "
                             "run out of memory")
    return held, (f"{held} trials at a time, not {concurrency}: the head node's {head_memory_gb:.1f} GB for "
                  f"Ray's tasks holds {held} beside the search's driver; {each}. A head with more memory "
                  "(cluster.yaml's head_cpu InstanceType) runs more")


def trial_request(opts: SearchOptions) -> WorkerRequest:
    """What one trial asks Ray for (hardware defaults filled in), as `trainer.cluster.capacity.check_fits`
    reads it: the same rules as `vidtune train`'s, with the trial's driver beside its workers."""
    r = opts.resources
    gpus_flag = "--gpus-per-trial" if r.gpus_per_trial is not None else "--gpus-per-worker"
    return WorkerRequest(r.workers_per_trial, _cpus_per_worker(opts), r.gpus_per_worker or 0.0,
                         extra_cpus=DRIVER_CPUS, workers_flag="--workers-per-trial", gpus_flag=gpus_flag,
                         what="a trial")


def trial_resources(opts: SearchOptions) -> TrialResources:
    """What each trial asks Ray for (hardware defaults already filled in)."""
    r = opts.resources
    return TrialResources(r.workers_per_trial, _cpus_per_worker(opts), r.gpus_per_worker or 0.0)


def waiting_line(capacity: ClusterCapacity) -> str:
    """One line for a search that starts before the GPU nodes it needs have joined."""
    types = ", ".join(f"{t.name} up to {t.max_workers} x "
                      f"{'? (detected)' if t.gpus is None else f'{t.gpus:g}'} GPU"
                      for t in capacity.node_types if t.max_workers > 0 and (t.gpus is None or t.gpus > 0))
    return (f"the Ray cluster has {capacity.gpus_now:g} GPU(s) now: the trials wait for the autoscaler "
            f"to start GPU nodes ({types})")


def leaves_cores_free(opts: SearchOptions, node_cpus: float) -> bool:
    """A training on a CPU-only node of `node_cpus` cores leaves some of them idle: its workers'
    torch threads (`--cpu-threads` x `--workers-per-trial`) are fewer than the cores."""
    threads = opts.train.cpu_threads
    return threads is not None and threads * opts.resources.workers_per_trial < node_cpus


def node_view(marker: str | None, weights: str | None, gpus: bool = False) -> dict[str, object]:
    """What one node sees of the driver's paths and code: its address, whether the `marker` file
    (in --storage) exists there, whether --weights is a file there, and the vidtune version it
    imports (this function is unpickled there by reference, so the node must import vidtune to
    run it at all); with `gpus`, its GPUs that the node's torch has no kernels for
    (`trainer.cluster.devices.unsupported_gpus`). Run on each node."""
    view: dict[str, object] = {"node": ray.util.get_node_ip_address(),
                               "storage": marker is None or Path(marker).exists(),
                               "weights": weights is None or Path(weights).is_file(),
                               "vidtune": __version__}
    if gpus:   # imports torch (seconds): GPU nodes only
        view["unsupported_gpus"] = unsupported_gpus()
    return view


def views_of_every_node(marker: str | None, weights: str | None) -> list[dict[str, object]]:
    """`node_view` from every alive node of the Ray cluster (a zero-CPU task pinned to each),
    which also reads the GPUs of each node that has real ones; [] on a one-node Ray without
    them. A node whose task fails (most often: vidtune is not installed there, so the function
    cannot be unpickled) is {"node": its address, "error": the reason}."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    # Simulated GPUs (trainer.training.gpus) train on the CPU: no GPU of theirs to check.
    gpu_nodes = set() if simulated_gpus() else {
        n["NodeID"] for n in alive if float((n.get("Resources") or {}).get("GPU", 0.0)) > 0}
    if len(alive) < 2 and not gpu_nodes:   # one CPU machine: nothing to compare, and no task to start
        return []
    # A task with no GPU sees all of its node's GPUs (Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone
    # for it); max_calls=1: its process exits after, so the CUDA runtime it started goes with it.
    task = ray.remote(num_cpus=0, max_retries=0, max_calls=1)(node_view)
    views = []
    for node in alive:
        ref = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
                           ).remote(marker, weights, node["NodeID"] in gpu_nodes)
        try:
            views.append(ray.get(ref, timeout=120))
        except ray.exceptions.RayError as e:
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            views.append({"node": node.get("NodeManagerAddress", node["NodeID"]), "error": reason[:300]})
    return views


NodeViews = Callable[[str | None, str | None], list[dict[str, object]]]


def check_every_node(storage: str, weights: str | None, *, views: NodeViews = views_of_every_node) -> None:
    """On a cluster of more than one node, every node must run the driver's vidtune (trials
    import the package installed on the node they run on), see the same --storage folder (each
    trial's checkpoints are written by the node it trains on and read back by the driver) and
    the --weights file at the same path; and on any node, one machine included, every GPU must
    be one its torch has kernels for (`trainer.cluster.devices.unsupported_gpus`). Otherwise ConfigError,
    naming the flag (--address for the code and the GPUs), the node and the fix. Checked on the
    nodes alive now; nodes the autoscaler starts later run the same setup, and their GPUs are
    refused by the trial's workers as they start (`trainer.cluster.devices.train_device`). `views`: how the
    nodes' views are gathered (`views_of_every_node`)."""
    local_storage = "://" not in storage
    weights_file = weights if weights and weights not in ("none", "kinetics") else None
    marker = Path(storage).expanduser() / f".vidtune-node-check-{uuid.uuid4().hex}" if local_storage else None
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    try:
        seen = views(str(marker) if marker else None,
                     str(Path(weights_file).expanduser()) if weights_file else None)
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)
    unusable = [f"node {v['node']}, {line}" for v in seen for line in v.get("unsupported_gpus") or ()]
    if unusable:   # on one machine too: its trials would fail at their first kernel
        flag = "--address" if len(seen) > 1 else "--gpus-per-worker"
        way_out = (" (or leave that node out of the cluster)" if len(seen) > 1 else
                   " (or pass --gpus-per-worker 0 to train on the CPU)")
        raise ConfigError(flag, "; ".join(unusable) + way_out)
    if len(seen) < 2:
        return
    code = [f"{v['node']} ({v['error']})" if "error" in v else f"{v['node']} (vidtune {v['vidtune']})"
            for v in seen if "error" in v or v.get("vidtune") != __version__]
    if code:
        raise ConfigError("--address", f"node(s) {', '.join(code)} of the Ray cluster cannot run this "
                          f"search's code (vidtune {__version__} here): install the same vidtune on every "
                          "node (cluster.yaml's setup_commands run `pip install -e .` in the copied clone; "
                          "`ray up` again after a change)")
    blind = [v["node"] for v in seen if not v["storage"]]
    if blind:
        raise ConfigError("--storage", f"{storage} is a folder of this machine only: node(s) "
                          f"{', '.join(map(str, blind))} of the Ray cluster do not see it, and trials there "
                          "would keep their checkpoints on their own disks; pass an s3:// URI or a folder "
                          "shared by every node (NFS/EFS, same path)")
    missing = [v["node"] for v in seen if not v["weights"]]
    if missing:
        raise ConfigError("--weights", f"{weights} is not a file on node(s) {', '.join(map(str, missing))}; "
                          "the weights file must exist at the same path on every node (copy it there in the "
                          "cluster's setup_commands, or put it on shared storage)")
