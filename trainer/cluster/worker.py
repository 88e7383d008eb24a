"""The Ray Train per-worker function: wires a Ray-free run (`trainer.training.run`) to Ray Train: the
worker's rank, DDP, the device lease, checkpoints and the per-epoch reports.

The run itself (data, model, optimizer, one epoch) is `trainer.training.run`'s; the training step lives in
`trainer.training.loop`, precision decisions in `trainer.training.precision`, metric reduction in
`trainer.training.metrics`.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from vidtune.datasets.index import VideoIndex, build_index
from vidtune.trainer.cluster.checkpoint_upload import CheckpointUploads
from vidtune.trainer.cluster.cpu_share import CpuPlan, cpu_plan, cpus_per_gpu
from vidtune.trainer.cluster.devices import train_device
from vidtune.trainer.cluster.lease import (
    LEASE_CONFIG_KEY,
    LeaseSettings,
    TrainingSlot,
    device_keys,
    physical_gpu_ids,
)
from vidtune.trainer.cluster.node_setup import NODE_SETUP_CONFIG_KEY, NodeSetup, prepare_for_run
from vidtune.trainer.cluster.torch_trainer import quiet_report_lines
from vidtune.trainer.training.checkpointing import saved_epoch
from vidtune.trainer.training.config import INDEX_CONFIG_KEY, TrainConfig
from vidtune.trainer.training.device_memory import free_device, process_device_mb, release_process_group
from vidtune.trainer.training.history import write_history
from vidtune.trainer.training.metrics import (
    EpochStats,
    all_reduce_floats,
    peak_allocated_mb,
    peak_memory_mb,
    reduce_epoch,
    steady_state,
)
from vidtune.trainer.training.precision import free_memory
from vidtune.trainer.training.report_keys import REPORT_KEYS, SETTING_KEYS, Key, in_report_order
from vidtune.trainer.training.resume import first_whole_checkpoint, resume_candidates
from vidtune.trainer.training.run import (
    DIVERGED,
    TRAINED,
    Run,
    any_rank,
    build_run,
    current_lr,
    data_counts,
    place_model,
    run_epoch,
    save_run_checkpoint,
    unless_out_of_memory,
)
from vidtune.trainer.training.settings import merge_settings, worker_settings
from vidtune.trainer.training.utilization import CpuWindow, DeviceUtilization, OtherCpuLoad, other_cores

# What each epoch's report holds, in order: every per-epoch key of `trainer.training.report_keys` (each
# declared there with its role in MLflow and its meaning): reduce_epoch's metrics plus what the
# worker adds. oom / diverged: 1 on the run's one report without a result (`_report_worst_case`).
METRIC_KEYS = REPORT_KEYS


@dataclass
class _Worker:
    """What one Ray Train worker holds during training: the run, and what Ray adds to it."""

    run: Run
    slot: TrainingSlot
    where: dict[str, str] = field(default_factory=dict)    # node_id, node_ip, gpu_ids (`_where_it_runs`)
    counts_seen: tuple[int, int, int, int] = (0, 0, 0, 0)  # `data_counts` at the end of the last epoch
    speed_by_epoch: dict[int, float] = field(default_factory=dict)   # clips_per_s per epoch, for steady_state
    resumed_from_epoch: int = 0                      # the checkpoint's epoch this run started after
    damaged_checkpoints: int = 0                     # damaged checkpoints skipped at this run's start
    checkpoint_suffix: str = ""                      # after a fallback: keeps new folder names unique
    history: dict[int, dict] = field(default_factory=dict)   # every epoch's report so far
    # (trainer.training.history)
    device_util_pct: float = math.nan                # this rank's device utilisation in the last epoch
    cpu_window: CpuWindow | None = None              # this rank's OtherCpuLoad view of the last epoch
    settings: dict[str, str] = field(default_factory=lambda: dict.fromkeys(SETTING_KEYS, ""))  # all ranks'
    uploads: CheckpointUploads = field(default_factory=CheckpointUploads)   # rank 0's, on their way


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point. `config` is `TrainConfig.to_dict()`.

    Reports once per epoch (`METRIC_KEYS`, all-reduced so rank 0's dict covers every worker)
    with a checkpoint from rank 0; resumes after the epoch of `ray.train.get_checkpoint()`.
    Out of memory (building the model, moving it to its device, or in an epoch) and divergence
    (a non-finite training loss or weights) end the run with one `oom=1` / `diverged=1` report
    and a normal return (`_report_no_result`).

    `config[INDEX_CONFIG_KEY]`, when set, is the driver's `datasets.index.VideoIndex` (the videos
    it checked); without it the worker builds the index itself (from the index cache).

    The data, model and optimiser are built on the CPU; the model (and with it, as it trains, the
    optimiser's state) goes to its device only once the run holds it. In a search
    (`config["device_lease"]` set) the run waits for its devices (`trainer.cluster.lease`) in between,
    while another trial may be training there with nearly all of the GPU's memory, and gives them
    back as soon as its last epoch is scored and written to a local folder and its device memory
    is freed (`_report`), before the checkpoint goes to the storage and Train's teardown.
    """
    quiet_report_lines()
    config = dict(config)
    lease = LeaseSettings.from_dict(config.pop(LEASE_CONFIG_KEY, None))
    index = config.pop(INDEX_CONFIG_KEY, None)
    node_setup = NodeSetup.from_dict(config.pop(NODE_SETUP_CONFIG_KEY, None))
    cfg = TrainConfig.from_dict(config)
    started, started_ts = time.perf_counter(), time.time()
    w = unless_out_of_memory(_setup, cfg, TrainingSlot(lease), index, node_setup)
    if any_rank(w is None):   # agreed before any other collective, so no rank waits for a lost one
        _report_setup_oom(cfg, time.perf_counter() - started, _epoch_window(started_ts, time.time()))
        return
    run = w.run
    try:
        w.where = _where_it_runs()
        start_epoch, state = _read_checkpoint(w)
        if w.slot.settings is not None:   # the same on every rank: the key gather is a collective
            w.slot.acquire(_all_device_keys(run), device_mb=process_device_mb(run))
        if run.device.type == "cuda":   # its context, now that the device is this run's (LeasedTorchConfig)
            torch.cuda.set_device(run.device)
        started, started_ts = time.perf_counter(), time.time()
        if any_rank(unless_out_of_memory(run.model.to, run.device) is None):
            _report_no_result(w, start_epoch, time.perf_counter() - started,
                              _epoch_window(started_ts, time.time()))
            return
        place_model(run, state, wrap=lambda model: _prepare_ddp(model, run))
        _use_device_threads(w)
        w.settings = merge_settings(_all_gather(worker_settings(run.device, run.policy, run.model)))
        utilization, other_load = DeviceUtilization(run.device), OtherCpuLoad()
        for epoch in range(start_epoch, cfg.epochs + 1):
            started, started_ts = time.perf_counter(), time.time()
            utilization.start()
            other_load.start()
            result = run_epoch(run, epoch)
            w.device_util_pct, w.cpu_window = utilization.stop(), other_load.stop()
            window = _epoch_window(started_ts, time.time())
            if result.outcome != TRAINED:
                _report_no_result(w, epoch, time.perf_counter() - started, window,
                                  diverged=result.outcome == DIVERGED, stats=result.stats)
                return
            metrics = _epoch_metrics(w, epoch, reduce_epoch(result.stats, result.eval_out), window=window,
                                     first=epoch == start_epoch)
            _report(w, epoch, metrics, last=epoch == cfg.epochs)
    finally:
        if w.slot.held:   # an error ended the run: free what this rank can
            try:
                free_device(run)
            except Exception:   # the error that got here matters more
                pass
            # No release: the devices are the trial's, and its other ranks may still hold memory
            # there, waiting in a collective for this one until it times out. The search ends the
            # trial's lease once every worker has exited (`trainer.cluster.lease.LeaseBook.end`); a worker
            # group Train restarts on the same devices gets them back at once (a regrant).


def _setup(cfg: TrainConfig, slot: TrainingSlot, index: VideoIndex | None,
           node_setup: NodeSetup | None = None) -> _Worker:
    """The worker's run (`trainer.training.run.build_run`), with the model and optimiser on the CPU,
    on a node that has what the search prepared at its start (`node_setup`: a node that joined
    later gets it now, `trainer.cluster.node_setup`). Runs no collective: a rank that runs out of
    memory here must not leave the others waiting."""
    ctx = ray.train.get_context()
    device = train_device()
    plan = _use_allocated_cpus(cfg, on_gpu=device.type == "cuda")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, loader_workers=plan.loaders))
    if index is None:
        index = build_index(cfg.data)  # probes once per dataset; later calls read the cache
    if node_setup is not None:
        for line in prepare_for_run(node_setup, cfg, index, on_gpu=device.type == "cuda"):
            print(f"vidtune: node {ray.util.get_node_ip_address()}: {line}", flush=True)
    run = build_run(cfg, index, device=device, rank=ctx.get_world_rank(), world=ctx.get_world_size())
    return _Worker(run=run, slot=slot)


def _prepare_ddp(model: nn.Module, run: Run) -> nn.Module:
    """Ray's DDP wrapping (a collective: rank 0's weights are broadcast)."""
    # Frozen-backbone epochs leave backbone parameters without gradients; DDP must then look
    # for unused parameters (a graph walk per step), so it does only when freezing is asked for.
    ddp_kwargs = {"find_unused_parameters": True} if run.cfg.freeze_backbone_epochs > 0 else None
    return ray.train.torch.prepare_model(model, move_to_device=run.device,
                                         parallel_strategy_kwargs=ddp_kwargs)


def _use_allocated_cpus(cfg: TrainConfig, *, on_gpu: bool) -> CpuPlan:
    """Split the CPUs Ray granted this worker between torch threads (set here) and DataLoader
    processes (`trainer.cluster.cpu_share.cpu_plan`; `--cpu-threads` and `--loader-workers` win);
    on a GPU, with its node's CPUs per GPU."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    plan = cpu_plan(cpus, on_gpu=on_gpu, node_cpus_per_gpu=_node_cpus_per_gpu() if on_gpu else None,
                    threads=cfg.cpu_threads, loaders=cfg.data.loader_workers)
    torch.set_num_threads(plan.threads)
    return plan


def _node_cpus_per_gpu() -> float | None:
    """This worker's node's CPUs per GPU, as Ray counts them (None without GPUs)."""
    node = ray.get_runtime_context().get_node_id()
    resources = next((n.get("Resources") or {} for n in ray.nodes() if n.get("NodeID") == node), {})
    return cpus_per_gpu([(float(resources.get("CPU", 0.0)), float(resources.get("GPU", 0.0)))])


def _use_device_threads(w: _Worker) -> None:
    """Training on the CPU under the lease: the node's CPU is this trial's alone while it trains
    (other trials there only start up or wait), so its workers on this node share all its cores
    rather than the sliver Ray reserved for each (which lets the next trial start meanwhile).
    `--cpu-threads` overrides this (set once, by `_use_allocated_cpus`)."""
    if not w.slot.held or w.run.device.type != "cpu" or w.run.cfg.cpu_threads:
        return
    node = ray.get_runtime_context().get_node_id()
    cpus = next((n["Resources"].get("CPU", 1.0) for n in ray.nodes() if n.get("NodeID") == node), 1.0)
    local_workers = max(1, ray.train.get_context().get_local_world_size())
    torch.set_num_threads(max(1, int(cpus) // local_workers))


def _all_gather(mine: Any) -> list[Any]:
    """`mine` from every rank, in rank order (a collective when distributed; else `[mine]`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    return views


def _all_device_keys(run: Run) -> list[str]:
    """The lease keys of every rank's device (a collective when distributed)."""
    return sorted({key for rank_keys in _all_gather(device_keys(run.device)) for key in rank_keys})


def _epoch_window(start_ts: float, end_ts: float) -> tuple[float, float]:
    """The epoch's (earliest start, latest end) over all workers, unix seconds."""
    neg_start, end = all_reduce_floats([-start_ts, end_ts], dist.ReduceOp.MAX)
    return -neg_start, end


def _where_it_runs() -> dict[str, str]:
    """Where the run trains (a collective when distributed): `node_id`, rank 0's Ray node;
    `node_ip`, the IPs of the nodes its workers are on; `gpu_ids`, the physical ids of the GPUs
    Ray gave its workers (`trainer.cluster.devices`), sorted and without repeats, each prefixed with its
    node's IP when the workers span nodes (ids are per node); "" on the CPU. Comma-separated."""
    views = _all_gather((ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                         physical_gpu_ids()))
    ips = sorted({ip for _, ip, _ in views})
    gpus = {f"{ip}:{gpu}" if len(ips) > 1 else gpu for _, ip, ids in views for gpu in ids}
    return {Key.NODE_ID: views[0][0], Key.NODE_IP: ",".join(ips),
            Key.GPU_IDS: ",".join(sorted(gpus, key=lambda g: (len(g), g)))}  # shorter first: "2", "10"


def _read_checkpoint(w: _Worker) -> tuple[int, dict[str, Any] | None]:
    """(first epoch to run, the checkpoint's state to restore) for the checkpoint Ray hands back
    on a rerun (its latest); (1, None) without one. Read (onto the CPU) before the run holds its
    device; `_prepare_model` restores it once the model is there.

    A checkpoint is used only once `checkpoint_problem` finds it whole: a damaged latest one
    gives way to the newest whole one of the run's other checkpoints
    (`trainer.training.resume.resume_candidates`), and
    without any the run starts again from epoch 1; either is said in one line (to the search's
    log) and in the first epoch's `damaged_checkpoints`."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 1, None
    found, damaged = first_whole_checkpoint(resume_candidates(checkpoint))
    w.damaged_checkpoints = len(damaged)
    if damaged:
        # Ray still lists the damaged folder as its latest: new folders must not reuse its name,
        # or Ray deleting that entry later would delete the new checkpoint.
        w.checkpoint_suffix = f"-{int(time.time())}"
    if found is None:
        if w.run.rank == 0:
            print(f"vidtune: no whole checkpoint to resume from ({'; '.join(damaged)}); "
                  f"this trial starts again from epoch 1", flush=True)
        return 1, None
    path, state, history = found
    if damaged and w.run.rank == 0:
        print(f"vidtune: {'; '.join(damaged)}; resuming from the epoch-{saved_epoch(state)} checkpoint "
              f"{path} instead", flush=True)
    w.history = history
    speeds = (state.get("metrics") or {}).get("speed_by_epoch") or {}
    w.speed_by_epoch = {int(e): float(v) for e, v in speeds.items()}
    w.resumed_from_epoch = saved_epoch(state)
    return w.resumed_from_epoch + 1, state


def _data_metrics(w: _Worker) -> dict[str, float | int]:
    """reader_failures, cache_repairs and cache_hit_frac since the last call, over all workers."""
    counts = data_counts(w.run)
    new = [float(now - seen) for now, seen in zip(counts, w.counts_seen, strict=True)]
    w.counts_seen = counts
    reads, hits, failures, repairs = all_reduce_floats(new, dist.ReduceOp.SUM)
    return {Key.READER_FAILURES: int(failures), Key.CACHE_REPAIRS: int(repairs),
            Key.CACHE_HIT_FRAC: hits / reads if reads > 0 else 0.0}


def _lease_metrics(w: _Worker, window: tuple[float, float], first: bool) -> dict[str, float]:
    """concurrent_trainings, device_wait_s (first epoch of this run only) and the epoch's window."""
    concurrent = w.slot.concurrent(*window) if w.run.rank == 0 else 0.0
    concurrent = all_reduce_floats([concurrent], dist.ReduceOp.SUM)[0]   # rank 0's value everywhere
    wait = all_reduce_floats([w.slot.wait_s if first else 0.0], dist.ReduceOp.MAX)[0]
    return {Key.CONCURRENT_TRAININGS: concurrent, Key.DEVICE_WAIT_S: wait,
            Key.EPOCH_START_TS: window[0], Key.EPOCH_END_TS: window[1]}


def _other_cpu_cores(w: _Worker) -> float:
    """other_cpu_cores of the epoch: each node's busy CPU less all this run's workers there
    (a collective when distributed: the windows are gathered by node)."""
    by_node: dict[str, list[CpuWindow | None]] = {}
    for node, window in _all_gather((ray.get_runtime_context().get_node_id(), w.cpu_window)):
        by_node.setdefault(node, []).append(window)
    return other_cores(by_node)


def _epoch_metrics(w: _Worker, epoch: int, metrics: dict[str, float], *, window: tuple[float, float],
                   first: bool) -> dict[str, Any]:
    """The epoch's report: `reduce_epoch`'s `metrics` and what the worker adds (`METRIC_KEYS`)."""
    run = w.run
    peak, allocated = all_reduce_floats([peak_memory_mb(run.device), peak_allocated_mb(run.device)],
                                        dist.ReduceOp.MAX)
    w.speed_by_epoch[epoch] = metrics[Key.CLIPS_PER_S]
    return in_report_order({
        **metrics, Key.EPOCH: epoch, Key.LR: current_lr(run), Key.BATCH_SIZE: run.cfg.batch_size, Key.OOM: 0,
        Key.DIVERGED: 0, **w.where, Key.PEAK_MEM_MB: float(peak), Key.PEAK_ALLOCATED_MB: float(allocated),
        Key.STEADY_CLIPS_PER_S: steady_state(w.speed_by_epoch), **_data_metrics(w),
        **_lease_metrics(w, window, first), Key.RESUMED_FROM_EPOCH: w.resumed_from_epoch if first else 0,
        Key.DAMAGED_CHECKPOINTS: w.damaged_checkpoints if first else 0,
        Key.DEVICE_UTIL_PCT: all_reduce_floats([w.device_util_pct])[0] / run.world,
        Key.TORCH_THREADS: torch.get_num_threads(), Key.OTHER_CPU_CORES: _other_cpu_cores(w), **w.settings,
    })


def _report(w: _Worker, epoch: int, metrics: dict[str, Any], *, last: bool = False) -> None:
    """All ranks report (it is a barrier); only rank 0 writes and passes a checkpoint.

    The checkpoint is written to a local folder (`trainer.cluster.checkpoint_upload`), and Ray
    copies it to the storage in the background (a bucket: seconds to minutes for a large model)
    while the next epoch trains; Ray commits it (and deletes the local copy) only once the copy
    is whole. `last`: the run's last epoch: it is written while the weights are still on the
    device; then every rank frees its device and the devices are handed over (`_hand_over`)
    before the upload, so the next trial trains meanwhile, on a device this one has left."""
    if w.run.rank != 0:
        if last:
            _hand_over(w)
        ray.train.report(metrics)
        return
    w.history = {**w.history, epoch: metrics}
    directory = w.uploads.new_folder()
    write_history(directory, w.history)
    save_run_checkpoint(w.run, directory, epoch=epoch,
                        metrics={**metrics, "speed_by_epoch": dict(w.speed_by_epoch)})
    if last:
        _hand_over(w)
    w.uploads.report(metrics, directory, f"epoch_{epoch:04d}{w.checkpoint_suffix}")


def _hand_over(w: _Worker) -> None:
    """Free this rank's device (`free_device`), wait for every rank to have done so (the
    all-reduce is a barrier, and the run's last collective), release the process group (NCCL's
    communicator: `release_process_group`), then give the trial's devices back saying what this
    process still holds there as the driver counts it (`process_device_mb`: NVML; the lease
    records the most any rank holds, once every rank has handed back: `trainer.cluster.lease`)."""
    free_device(w.run)
    all_reduce_floats([0.0], dist.ReduceOp.MAX)
    release_process_group(w.run.device)
    w.slot.hand_back(w.run.rank, w.run.world, device_mb=process_device_mb(w.run))


def _report_no_result(w: _Worker, epoch: int, elapsed_s: float, window: tuple[float, float], *,
                      diverged: bool = False, stats: EpochStats | None = None) -> None:
    """Out of memory (this batch size does not fit) or divergence (this learning rate blows the
    weights up) is an answer for the search, not a crash: free what the run holds, report
    worst-case metrics once (`_report_worst_case`), no checkpoint, and let the caller return
    normally so Ray does not retry. `stats`: the diverged epoch's, for its train_loss.

    Every rank agreed on the outcome first (`any_rank`), so none waits in a collective for a
    rank that stopped. Limitation: an OOM on one rank only, in the middle of a DDP backward,
    leaves the others inside that step's gradient all-reduce; they fail at the collective instead.
    """
    run = w.run
    train_loss = math.nan
    if stats is not None:
        loss_sum, clips = all_reduce_floats([stats.loss_sum, float(stats.clips)])
        train_loss = loss_sum / clips if clips else math.nan
    _report_worst_case(
        run.device, epoch=epoch, batch_size=run.cfg.batch_size, lr=current_lr(run), elapsed_s=elapsed_s,
        diverged=diverged, train_loss=train_loss, measured={
            **w.where, **_data_metrics(w), **_lease_metrics(w, window, first=True),
            Key.RESUMED_FROM_EPOCH: w.resumed_from_epoch, Key.DAMAGED_CHECKPOINTS: w.damaged_checkpoints,
            **w.settings}, hand_over=lambda: _hand_over(w))


def _report_setup_oom(cfg: TrainConfig, elapsed_s: float, window: tuple[float, float]) -> None:
    """`_report_no_result` for a run that ran out of memory before it had a model or optimiser
    (epoch 1, the configured lr; it never waited for a device)."""
    _report_worst_case(
        train_device(), epoch=1, batch_size=cfg.batch_size, lr=cfg.lr, elapsed_s=elapsed_s, measured={
            **_where_it_runs(), Key.READER_FAILURES: 0, Key.CACHE_HIT_FRAC: 0.0, Key.CACHE_REPAIRS: 0,
            Key.CONCURRENT_TRAININGS: math.nan, Key.DEVICE_WAIT_S: 0.0, Key.EPOCH_START_TS: window[0],
            Key.EPOCH_END_TS: window[1], Key.RESUMED_FROM_EPOCH: 0, Key.DAMAGED_CHECKPOINTS: 0,
            **dict.fromkeys(SETTING_KEYS, "")})


def _report_worst_case(device: torch.device, *, epoch: int, batch_size: int, lr: float, elapsed_s: float,
                       measured: dict[str, Any], diverged: bool = False,
                       train_loss: float = math.nan, hand_over: Callable[[], None] | None = None) -> None:
    """Report the METRIC_KEYS of an epoch without a result (no checkpoint): `oom=1`, or
    `diverged=1`; no speed; an accuracy of 0, not NaN, since Optuna's `tell` turns a NaN objective
    into a failed trial that TPE ignores, where 0 with the constraint `tune.study.space` sets makes it an
    infeasible one. `measured`: the keys the caller knows (where it ran, reader failures, cache hits, ...).
    `hand_over`: gives the devices back (`_hand_over`), after this report's collectives, before it is sent."""
    peak, allocated = peak_memory_mb(device), peak_allocated_mb(device)  # peaks: kept after a release
    free_memory(device)
    peak, allocated = all_reduce_floats([peak, allocated], dist.ReduceOp.MAX)
    if hand_over is not None:
        hand_over()
    ray.train.report(in_report_order({
        Key.EPOCH: epoch, Key.TRAIN_LOSS: float(train_loss), Key.VAL_LOSS: math.nan, Key.VAL_ACC: 0.0,
        Key.VAL_F1: 0.0, Key.VAL_RECALL: 0.0, Key.VAL_AUC: 0.0, Key.CLIPS_PER_S: 0.0,
        Key.COMPUTE_CLIPS_PER_S: 0.0, Key.STEADY_CLIPS_PER_S: 0.0, Key.EPOCH_TIME_S: float(elapsed_s),
        Key.DATA_WAIT_FRAC: 0.0, Key.PEAK_MEM_MB: float(peak), Key.PEAK_ALLOCATED_MB: float(allocated),
        Key.NONFINITE_STEPS: math.nan, Key.LR: float(lr), Key.BATCH_SIZE: batch_size,
        Key.OOM: int(not diverged), Key.DIVERGED: int(diverged), Key.DEVICE_UTIL_PCT: math.nan,
        Key.TORCH_THREADS: torch.get_num_threads(), Key.OTHER_CPU_CORES: math.nan, **measured,
    }))
