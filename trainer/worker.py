"""The Ray Train per-worker function: builds data, model and optimiser, runs the epochs with
`trainer.loop`, all-reduces the metrics and reports them (with a checkpoint from rank 0).

It wires the pieces; the training step itself lives in `trainer.loop`, precision decisions in
`trainer.precision`, metric reduction in `trainer.metrics`.
"""
from __future__ import annotations

import math
import posixpath
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from trainer.checkpointing import (CheckpointError, checkpoint_problem, load_checkpoint, restore_training_state,
                                   save_checkpoint)
from trainer.config import TrainConfig
from trainer.launch import INDEX_CONFIG_KEY
from trainer.gpus import physical_gpu_ids, train_device
from trainer.history import read_history, write_history
from trainer.utilization import DeviceUtilization, OtherCpuLoad, other_cores
from trainer.lease import LEASE_CONFIG_KEY, LeaseSettings, TrainingSlot, device_keys
from trainer.metrics import METRIC_KEYS as _REDUCED_KEYS
from trainer.metrics import all_reduce_floats, steady_state
from trainer.precision import is_out_of_memory

# What each epoch's report holds: reduce_epoch's metrics plus what the worker adds.
# steady_clips_per_s: median clips_per_s of epochs 2.. so far (trainer.metrics.steady_state).
# cache_hit_frac: clip reads served by the clip cache / all clip reads, this epoch.
# concurrent_trainings: most trainings on this trial's devices at once during the epoch (lease).
# device_wait_s: time this run waited for its device before its first epoch (0 after).
# epoch_start_ts / epoch_end_ts: unix time the epoch's training started / its scoring ended.
# device_util_pct: the device's utilisation over the epoch, mean over workers (trainer.utilization).
# resumed_from_epoch: on the first epoch after the run restarted from a checkpoint (a worker
#   group restarted by Train's FailureConfig, or a --resume), that checkpoint's epoch; else 0.
# damaged_checkpoints: on the first epoch after a restart, the checkpoints found damaged and
#   skipped (`_read_checkpoint`): with resumed_from_epoch > 0 the run fell back to an older one,
#   with resumed_from_epoch 0 it started again from scratch; else 0.
# cache_repairs: clip-cache entries found damaged and decoded again this epoch, all workers.
# torch_threads: the CPU threads torch used in rank 0's training (--cpu-threads, or the default);
#   on the CPU, clips/s follows it.
# other_cpu_cores: cores that other processes kept busy on the worker's machine during the epoch
#   (trainer.utilization.OtherCpuLoad; the most over the workers; NaN without /proc).
# oom / diverged: 1 on the run's one report when it ran out of memory / its training loss or
#   weights became inf or NaN (then no accuracy nor speed, and no checkpoint); else 0.
# node_id, node_ip, gpu_ids: where the run trained (`_where_it_runs`); strings.
METRIC_KEYS = ("epoch", *_REDUCED_KEYS, "steady_clips_per_s", "peak_mem_mb", "lr", "batch_size", "oom",
               "diverged", "reader_failures", "cache_hit_frac", "concurrent_trainings", "device_wait_s",
               "epoch_start_ts", "epoch_end_ts", "node_id", "node_ip", "gpu_ids", "resumed_from_epoch",
               "device_util_pct", "torch_threads", "other_cpu_cores", "damaged_checkpoints", "cache_repairs")


class ShardSampler(Sampler[int]):
    """Indices `rank, rank + world, ...` of a dataset, in order, without padding: every
    validation video is scored exactly once across the workers (DistributedSampler would pad
    with duplicates so that every rank gets the same count)."""

    def __init__(self, length: int, rank: int, world: int):
        self.indices = list(range(rank, length, world))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def with_sampler(loader: DataLoader, sampler: Sampler) -> DataLoader:
    """The same loader with another sampler. Unlike `ray.train.torch.prepare_data_loader`, keeps
    `persistent_workers`, `prefetch_factor` and the multiprocessing context, which
    `build_loader` sets so that decoding workers are not restarted every epoch."""
    extra: dict[str, Any] = {}
    if loader.num_workers > 0:
        extra = dict(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
                     multiprocessing_context=loader.multiprocessing_context)
    return DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
        pin_memory_device=loader.pin_memory_device, **extra,
    )


@dataclass
class _Run:
    """What one worker holds during training."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    policy: Any
    spec: Any
    class_names: dict[int, str]
    train_loader: DataLoader
    val_loader: DataLoader
    train_transform: torch.nn.Module
    val_transform: torch.nn.Module
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    slot: TrainingSlot
    where: dict[str, str] | None = None              # node_id, node_ip, gpu_ids (`_where_it_runs`)
    failures_seen: int = 0              # this rank's failed video reads counted in earlier epochs
    repairs_seen: int = 0               # this rank's clip-cache repairs counted in earlier epochs
    reads_seen: tuple[int, int] = (0, 0)   # this rank's (clip reads, cache hits) in earlier epochs
    speed_by_epoch: dict[int, float] | None = None   # clips_per_s of each epoch trained, for steady_state
    resumed_from_epoch: int = 0                      # the checkpoint's epoch this run started after
    damaged_checkpoints: int = 0                     # damaged checkpoints skipped at this run's start
    checkpoint_suffix: str = ""                      # after a fallback: keeps new folder names unique
    history: dict[int, dict] | None = None           # every epoch's report so far (trainer.history)
    device_util_pct: float = math.nan                # this rank's device utilisation in the last epoch
    cpu_window: Any = None                           # this rank's OtherCpuLoad view of the last epoch


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point. `config` is `TrainConfig.to_dict()`.

    Reports once per epoch (`METRIC_KEYS`, all-reduced so rank 0's dict covers every worker)
    with a checkpoint from rank 0; resumes after the epoch of `ray.train.get_checkpoint()`.
    Out of memory (building the model, moving it to its device, or in an epoch) and divergence
    (a non-finite training loss or weights) end the run with one `oom=1` / `diverged=1` report
    and a normal return (see `_report_no_result`): answers for the search, not crashes to retry.

    `config["video_index"]`, when set, is the driver's `datasets.index.VideoIndex` (the videos
    it checked); without it the worker builds the index itself (from the index cache).

    The data, model and optimiser are built on the CPU; the model goes to its device only once
    the run holds it. In a search (`config["device_lease"]` set) the run waits for its devices
    (`trainer.lease`) in between, while another trial may be training there with nearly all of
    the GPU's memory, and gives them back as soon as its last epoch is scored, before the final
    checkpoint and Train's teardown.
    """
    config = dict(config)
    lease = LeaseSettings.from_dict(config.pop(LEASE_CONFIG_KEY, None))
    index = config.pop(INDEX_CONFIG_KEY, None)
    cfg = TrainConfig.from_dict(config)
    started, started_ts = time.perf_counter(), time.time()
    run = _unless_out_of_memory(_setup, cfg, TrainingSlot(lease), index)
    if _any_rank(run is None):   # agreed before any other collective, so no rank waits for a lost one
        _report_setup_oom(cfg, time.perf_counter() - started, _epoch_window(started_ts, time.time()))
        return
    try:
        run.where = _where_it_runs()
        start_epoch, state = _read_checkpoint(run)
        if run.slot.settings is not None:   # the same on every rank: the key gather is a collective
            run.slot.acquire(_all_device_keys(run))
        started, started_ts = time.perf_counter(), time.time()
        # The model (and with it, as it trains, the optimizer's state) takes device memory only
        # now: moved before the wait, it could run out of memory beside the trial training there.
        if _any_rank(_unless_out_of_memory(run.model.to, run.device) is None):
            run.slot.release()
            _report_no_result(run, start_epoch, time.perf_counter() - started,
                              _epoch_window(started_ts, time.time()))
            return
        _prepare_model(run, state)
        _use_device_threads(run)
        utilization, other_load = DeviceUtilization(run.device), OtherCpuLoad()
        for epoch in range(start_epoch, run.cfg.epochs + 1):
            started, started_ts = time.perf_counter(), time.time()
            utilization.start()
            other_load.start()
            outcome, outputs = _train_and_evaluate(run, epoch)
            run.device_util_pct, run.cpu_window = utilization.stop(), other_load.stop()
            window = _epoch_window(started_ts, time.time())
            if outcome != "trained":
                run.slot.release()
                _report_no_result(run, epoch, time.perf_counter() - started, window,
                                  diverged=outcome == "diverged", stats=outputs)
                return
            if epoch == run.cfg.epochs:
                run.slot.release()   # the next trial trains while this one checkpoints and ends
            metrics = _epoch_metrics(run, epoch, *outputs, window=window, first=epoch == start_epoch)
            _report(run, epoch, metrics)
    finally:
        run.slot.release()


def _unless_out_of_memory(step: Callable[..., Any], *args: Any) -> Any:
    """`step(*args)`, or None when it ran out of memory (torch.OutOfMemoryError is a
    RuntimeError). The error is dropped on return, so its traceback's tensors can be freed."""
    try:
        return step(*args)
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
    return None


def _setup(cfg: TrainConfig, slot: TrainingSlot, index: Any = None) -> _Run:
    """Everything a run needs, with the model and optimiser on the CPU (`_prepare_model` puts
    the model on its device later). Runs no collective: a rank that runs out of memory here
    must not leave the others waiting in one."""
    from datasets.index import build_index
    from datasets.transforms import ClipTransform
    from trainer.loop import make_optimizer, make_scheduler
    from trainer.models import build_model, get_spec, prepare_input_transform, prepare_model_memory_format
    from trainer.precision import choose_precision, configure_backends

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    _use_allocated_cpus(cfg.cpu_threads)
    device = train_device()
    policy = choose_precision(cfg.precision, device)
    configure_backends(device)
    spec = get_spec(cfg.model)
    if index is None:
        index = build_index(cfg.data)  # probes once per dataset; later calls read the cache
    train_loader, val_loader = _loaders(cfg, spec, index, rank, world, device)

    torch.manual_seed(cfg.seed)  # same initial head on every rank and for every worker count
    model = prepare_model_memory_format(build_model(cfg.model, weights=cfg.weights), cfg.channels_last)
    # Built on the CPU parameters: `module.to(device)` keeps the same Parameter objects, and
    # the optimizer has no state yet (a checkpoint's is restored after the move).
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, device)
    # The loop steps the optimizer (and scheduler) after every group of grad_accum_steps
    # batches and after a last, shorter group.
    steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum_steps)
    scheduler = make_scheduler(optimizer, cfg.epochs * steps_per_epoch, cfg.warmup_frac)

    def transform(train: bool) -> torch.nn.Module:
        t = ClipTransform(spec.mean, spec.std, train=train).to(device)
        return prepare_input_transform(t, cfg.channels_last)

    return _Run(
        cfg=cfg, rank=rank, world=world, device=device, policy=policy, spec=spec,
        class_names=dict(index.class_names), train_loader=train_loader, val_loader=val_loader,
        train_transform=transform(True), val_transform=transform(False), model=model,
        optimizer=optimizer, scheduler=scheduler, scaler=policy.make_scaler(), slot=slot, speed_by_epoch={},
    )


def _prepare_model(run: _Run, state: dict[str, Any] | None) -> None:
    """Once the model is on its device: wrap it for DDP (a collective: rank 0's weights are
    broadcast), compile it when asked, and restore the checkpoint's training state (the
    optimizer's state follows the parameters to their device as it loads)."""
    cfg = run.cfg
    # Frozen-backbone epochs leave backbone parameters without gradients; DDP must then look
    # for unused parameters (a graph walk per step), so it does only when freezing is asked for.
    ddp_kwargs = {"find_unused_parameters": True} if cfg.freeze_backbone_epochs > 0 else None
    model = ray.train.torch.prepare_model(run.model, move_to_device=run.device, parallel_strategy_kwargs=ddp_kwargs)
    if cfg.compile:
        from trainer.models import maybe_compile

        model = maybe_compile(model, True)
    run.model = model
    if state is not None:
        restore_training_state(state, model=run.model, optimizer=run.optimizer, scaler=run.scaler,
                               scheduler=run.scheduler)


def _use_allocated_cpus(threads: int | None) -> None:
    """Give torch `threads` threads (--cpu-threads), by default as many as the CPUs Ray reserved
    for this worker (at least 1)."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    torch.set_num_threads(threads or max(1, int(cpus)))


def _use_device_threads(run: _Run) -> None:
    """Training on the CPU under the lease: the node's CPU is this trial's alone while it trains
    (other trials there only start up or wait), so its workers on this node share all its cores
    rather than the sliver Ray reserved for each (which lets the next trial start meanwhile).
    `--cpu-threads` overrides this (set once, by `_use_allocated_cpus`)."""
    if not run.slot.held or run.device.type != "cpu" or run.cfg.cpu_threads:
        return
    node = ray.get_runtime_context().get_node_id()
    cpus = next((n["Resources"].get("CPU", 1.0) for n in ray.nodes() if n.get("NodeID") == node), 1.0)
    local_workers = max(1, ray.train.get_context().get_local_world_size())
    torch.set_num_threads(max(1, int(cpus) // local_workers))


def _all_device_keys(run: _Run) -> list[str]:
    """The lease keys of every rank's device (a collective when distributed)."""
    mine = device_keys(run.device)
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    keys: list[Any] = [None] * run.world
    dist.all_gather_object(keys, mine)
    return sorted({key for rank_keys in keys for key in rank_keys})


def _epoch_window(start_ts: float, end_ts: float) -> tuple[float, float]:
    """The epoch's (earliest start, latest end) over all workers, unix seconds."""
    start = -all_reduce_floats([-start_ts], dist.ReduceOp.MAX)[0]
    end = all_reduce_floats([end_ts], dist.ReduceOp.MAX)[0]
    return start, end


def clip_datasets(cfg: TrainConfig, spec: Any, index: Any, device: torch.device) -> tuple[Any, Any]:
    """The (train, val) `VideoClipDataset`s of a run: the model's clip size unless overridden,
    read through the clip cache `cfg.data` asks for (its `auto` format resolved for `device`).
    Also used by bench/search_overhead.py, so its plain runs read the data as trials do."""
    from datasets.cache import FrameCache
    from datasets.video import VideoClipDataset
    from trainer.precision import is_cuda

    d = cfg.data
    size = dict(num_frames=d.num_frames or spec.num_frames, frame_stride=d.frame_stride,
                height=d.height or spec.height, width=d.width or spec.width)
    cache = FrameCache.from_config(d, on_gpu=is_cuda(device))
    # JPEG frames are decoded on the GPU in batches (decode_jpeg(device=...)), not by the loader.
    encoded = cache is not None and cache.format == "jpeg" and is_cuda(device)
    common = dict(seed=cfg.seed, cache=cache, encoded=encoded, **size)
    return (VideoClipDataset(index.train, train=True, **common),
            VideoClipDataset(index.val, train=False, **common))


def _loaders(cfg: TrainConfig, spec: Any, index: Any, rank: int, world: int,
             device: torch.device) -> tuple[DataLoader, DataLoader]:
    """Train loader (shuffled per epoch, sharded, same batch count on every rank so DDP steps
    stay in lockstep) and val loader (sharded without duplicates)."""
    from datasets.video import build_loader

    d = cfg.data
    train_set, val_set = clip_datasets(cfg, spec, index, device)
    common = dict(num_workers=d.loader_workers, pin_memory=device.type != "cpu", seed=cfg.seed)
    train_loader = build_loader(train_set, batch_size=cfg.batch_size, train=True, **common)
    val_loader = build_loader(val_set, batch_size=cfg.batch_size, train=False, **common)
    # A DistributedSampler even for one worker: its order depends only on (seed, epoch), so a
    # resumed run sees the same batches as an uninterrupted one.
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    if len(train_sampler) < cfg.batch_size:
        raise ValueError(
            f"--batch-size {cfg.batch_size} is larger than the {len(train_sampler)} training videos "
            f"each of the {world} worker(s) gets; lower --batch-size or --workers")
    return with_sampler(train_loader, train_sampler), with_sampler(val_loader, ShardSampler(len(val_set), rank, world))


def _where_it_runs() -> dict[str, str]:
    """Where the run trains (a collective when distributed): `node_id`, rank 0's Ray node;
    `node_ip`, the IPs of the nodes its workers are on; `gpu_ids`, the physical ids of the GPUs
    Ray gave its workers (`trainer.gpus`), sorted and without repeats, each prefixed with its
    node's IP when the workers span nodes (ids are per node); "" on the CPU. Comma-separated."""
    mine = (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), physical_gpu_ids())
    views: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized():
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, mine)
    ips = sorted({ip for _, ip, _ in views})
    gpus = {f"{ip}:{gpu}" if len(ips) > 1 else gpu for _, ip, ids in views for gpu in ids}
    # Shorter first: "2" before "10" for numeric ids.
    return {"node_id": views[0][0], "node_ip": ",".join(ips),
            "gpu_ids": ",".join(sorted(gpus, key=lambda g: (len(g), g)))}


def _read_checkpoint(run: _Run) -> tuple[int, dict[str, Any] | None]:
    """(first epoch to run, the checkpoint's state to restore) for the checkpoint Ray hands back
    on a rerun (its latest); (1, None) without one. Read (onto the CPU) before the run holds its
    device; `_prepare_model` restores it once the model is there.

    A checkpoint is used only once `checkpoint_problem` finds it whole: a damaged latest one
    gives way to the newest whole one of the run's other checkpoints (`_resume_candidates`), and
    without any the run starts again from epoch 1; either is said in one line (to the search's
    log) and in the first epoch's `damaged_checkpoints`."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 1, None
    found, damaged = first_whole_checkpoint(_resume_candidates(checkpoint))
    run.damaged_checkpoints = len(damaged)
    if damaged:
        # Ray still lists the damaged folder as its latest: new folders must not reuse its name,
        # or Ray deleting that entry later would delete the new checkpoint.
        run.checkpoint_suffix = f"-{int(time.time())}"
    if found is None:
        if run.rank == 0:
            print(f"vidtune: no whole checkpoint to resume from ({'; '.join(damaged)}); "
                  f"this trial starts again from epoch 1", flush=True)
        return 1, None
    path, state, history = found
    if damaged and run.rank == 0:
        print(f"vidtune: {'; '.join(damaged)}; resuming from the epoch-{int(state['epoch'])} checkpoint "
              f"{path} instead", flush=True)
    run.history = history
    speeds = (state.get("metrics") or {}).get("speed_by_epoch") or {}
    run.speed_by_epoch = {int(e): float(v) for e, v in speeds.items()}
    run.resumed_from_epoch = int(state["epoch"])
    return run.resumed_from_epoch + 1, state


def _resume_candidates(latest: ray.train.Checkpoint) -> list[ray.train.Checkpoint]:
    """`latest`, then the other checkpoint folders (`epoch_*`) of its run, newest first (by name:
    epochs are zero-padded), on the same filesystem (local or remote)."""
    from pyarrow import fs

    here = latest.path.rstrip("/")
    infos = latest.filesystem.get_file_info(fs.FileSelector(posixpath.dirname(here), allow_not_found=True))
    others = sorted((i.path for i in infos if i.type == fs.FileType.Directory
                     and posixpath.basename(i.path).startswith("epoch_") and i.path.rstrip("/") != here),
                    key=posixpath.basename, reverse=True)
    return [latest, *(ray.train.Checkpoint(path, filesystem=latest.filesystem) for path in others)]


def first_whole_checkpoint(candidates: list[ray.train.Checkpoint]
                           ) -> tuple[tuple[str, dict[str, Any], dict[int, dict]] | None, list[str]]:
    """((path, state, history) of the first of `candidates` that is whole and loads, or None;
    why each one before it was skipped). Remote checkpoints are downloaded to be checked."""
    damaged: list[str] = []
    for checkpoint in candidates:
        with checkpoint.as_directory() as directory:
            problem = checkpoint_problem(directory)
            if problem is None:
                try:
                    return (checkpoint.path, load_checkpoint(directory), read_history(directory)), damaged
                except CheckpointError as e:
                    problem = str(e)
        damaged.append(f"checkpoint {checkpoint.path} is damaged: {problem}")
    return None, damaged


def _train_and_evaluate(run: _Run, epoch: int) -> tuple[str, Any]:
    """One epoch, and how it ended, the same on every rank: ("trained", (EpochStats,
    EvalOutputs)), ("diverged", EpochStats) without evaluating, or ("out of memory", None)."""
    from trainer.loop import evaluate, finite_parameters, train_one_epoch
    from trainer.models import set_backbone_trainable, unwrap
    from trainer.precision import reset_peak_memory

    cfg = run.cfg
    run.train_loader.sampler.set_epoch(epoch)
    for dataset in (run.train_loader.dataset, run.val_loader.dataset):
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
    # Augmentation draws from the global generator: seed it per (rank, epoch) so a resumed run
    # continues exactly and ranks augment independently.
    torch.manual_seed(cfg.seed + 7919 * run.rank + epoch)
    reset_peak_memory(run.device)
    if cfg.freeze_backbone_epochs > 0:
        set_backbone_trainable(run.model, trainable=epoch > cfg.freeze_backbone_epochs)
    stats = _unless_out_of_memory(lambda: train_one_epoch(
        run.model, run.train_loader, transform=run.train_transform, optimizer=run.optimizer,
        scheduler=run.scheduler, scaler=run.scaler, policy=run.policy, device=run.device,
        grad_accum_steps=cfg.grad_accum_steps, clip_grad_norm=cfg.clip_grad_norm,
        label_smoothing=cfg.label_smoothing))
    # fp16's GradScaler skips the steps whose gradients overflow, so an inf gradient alone is
    # no divergence; an inf or NaN loss is (the epoch's mean then is one), and so are weights
    # gone non-finite (bf16/fp32 have no scaler to stop a NaN step).
    diverged = stats is not None and not (math.isfinite(stats.loss_sum) and finite_parameters(run.model))
    out_of_memory, diverged = all_reduce_floats([float(stats is None), float(diverged)], dist.ReduceOp.MAX)
    if out_of_memory:
        return "out of memory", None
    if diverged:
        return "diverged", stats
    # The plain model: DDP's forward may sync buffers (a collective) and ranks hold
    # different numbers of validation batches.
    eval_out = _unless_out_of_memory(lambda: evaluate(unwrap(run.model), run.val_loader,
                                                      transform=run.val_transform, policy=run.policy,
                                                      device=run.device))
    if _any_rank(eval_out is None):
        return "out of memory", None
    return "trained", (stats, eval_out)


def _any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on any rank (a collective: all ranks must call it)."""
    return bool(all_reduce_floats([float(flag)], dist.ReduceOp.MAX)[0])


def _reader_failures(run: _Run) -> int:
    """Failed video reads during this epoch, summed over the workers (and their loader processes)."""
    total = sum(int(getattr(loader.dataset, "failures", 0)) for loader in (run.train_loader, run.val_loader))
    local, run.failures_seen = total - run.failures_seen, total
    return int(all_reduce_floats([float(local)], dist.ReduceOp.SUM)[0])


def _cache_repairs(run: _Run) -> int:
    """Clip-cache entries found damaged and decoded again during this epoch, all workers (0 for
    datasets that do not count them)."""
    total = sum(int(getattr(loader.dataset, "cache_repairs", 0)) for loader in (run.train_loader, run.val_loader))
    local, run.repairs_seen = total - run.repairs_seen, total
    return int(all_reduce_floats([float(local)], dist.ReduceOp.SUM)[0])


def _cache_hit_frac(run: _Run) -> float:
    """Clip reads served by the clip cache / all clip reads during this epoch, all workers."""
    datasets = [loader.dataset for loader in (run.train_loader, run.val_loader)]
    reads = sum(int(getattr(d, "reads", 0)) for d in datasets)
    hits = sum(int(getattr(d, "cache_hits", 0)) for d in datasets)
    new_reads, new_hits = reads - run.reads_seen[0], hits - run.reads_seen[1]
    run.reads_seen = (reads, hits)
    new_reads, new_hits = all_reduce_floats([float(new_reads), float(new_hits)], dist.ReduceOp.SUM)
    return new_hits / new_reads if new_reads > 0 else 0.0


def _lease_metrics(run: _Run, window: tuple[float, float], first: bool) -> dict[str, float]:
    """concurrent_trainings (from the lease's record; NaN without a lease), the wait for the
    device (first epoch of this run only) and the epoch's window."""
    concurrent = run.slot.concurrent(*window) if run.rank == 0 else 0.0
    concurrent = all_reduce_floats([concurrent], dist.ReduceOp.SUM)[0]   # rank 0's value everywhere
    wait = all_reduce_floats([run.slot.wait_s if first else 0.0], dist.ReduceOp.MAX)[0]
    return {"concurrent_trainings": concurrent, "device_wait_s": wait,
            "epoch_start_ts": window[0], "epoch_end_ts": window[1]}


def _other_cpu_cores(run: _Run) -> float:
    """other_cpu_cores of the epoch: each node's busy CPU less all this run's workers there
    (a collective when distributed: the windows are gathered by node)."""
    mine = (ray.get_runtime_context().get_node_id(), run.cpu_window)
    views: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized():
        views = [None] * run.world
        dist.all_gather_object(views, mine)
    by_node: dict[str, list] = {}
    for node, window in views:
        by_node.setdefault(node, []).append(window)
    return other_cores(by_node)


def _current_lr(run: _Run) -> float:
    return float(max(group["lr"] for group in run.optimizer.param_groups))


def _epoch_metrics(run: _Run, epoch: int, stats: Any, eval_out: Any, *, window: tuple[float, float],
                   first: bool) -> dict[str, Any]:
    from trainer.metrics import peak_memory_mb, reduce_epoch

    metrics = reduce_epoch(stats, eval_out)
    peak = all_reduce_floats([peak_memory_mb(run.device)], dist.ReduceOp.MAX)[0]
    run.speed_by_epoch[epoch] = metrics["clips_per_s"]
    metrics.update(
        epoch=epoch, lr=_current_lr(run), batch_size=run.cfg.batch_size, oom=0, diverged=0, **run.where,
        reader_failures=_reader_failures(run), peak_mem_mb=float(peak),
        steady_clips_per_s=steady_state(run.speed_by_epoch), cache_hit_frac=_cache_hit_frac(run),
        **_lease_metrics(run, window, first), resumed_from_epoch=run.resumed_from_epoch if first else 0,
        damaged_checkpoints=run.damaged_checkpoints if first else 0, cache_repairs=_cache_repairs(run),
        device_util_pct=all_reduce_floats([run.device_util_pct])[0] / run.world,
        torch_threads=torch.get_num_threads(),
        other_cpu_cores=_other_cpu_cores(run),
    )
    return {key: metrics[key] for key in METRIC_KEYS}


def _report(run: _Run, epoch: int, metrics: dict[str, Any]) -> None:
    """All ranks report (it is a barrier); only rank 0 writes and passes a checkpoint."""
    if run.rank != 0:
        ray.train.report(metrics)
        return
    run.history = {**(run.history or {}), epoch: metrics}
    with tempfile.TemporaryDirectory(prefix="vidtune-ckpt-") as directory:
        write_history(directory, run.history)
        save_checkpoint(
            directory, model=run.model, optimizer=run.optimizer, scaler=run.scaler,
            scheduler=run.scheduler, epoch=epoch, config=run.cfg.to_dict(), spec=run.spec,
            class_names=run.class_names, metrics={**metrics, "speed_by_epoch": dict(run.speed_by_epoch)})
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                         checkpoint_dir_name=f"epoch_{epoch:04d}{run.checkpoint_suffix}")


def _report_no_result(run: _Run, epoch: int, elapsed_s: float, window: tuple[float, float], *,
                      diverged: bool = False, stats: Any = None) -> None:
    """Out of memory (this batch size does not fit) or divergence (this learning rate blows the
    weights up) is an answer for the search, not a crash: free what the run holds, report
    worst-case metrics once (`_no_result_metrics`), no checkpoint, and let the caller return
    normally so Ray does not retry. `stats`: the diverged epoch's, for its train_loss.

    Every rank agreed on the outcome first (`_any_rank`), so none waits in a collective for a
    rank that stopped. Limitation: an OOM on one rank only, in the middle of a DDP backward,
    leaves the others inside that step's gradient all-reduce; they fail at the collective instead.
    """
    from trainer.metrics import peak_memory_mb
    from trainer.precision import free_memory

    train_loss = math.nan
    if stats is not None:
        loss_sum, clips = all_reduce_floats([stats.loss_sum, float(stats.clips)])
        train_loss = loss_sum / clips if clips else math.nan
    peak = peak_memory_mb(run.device)  # measured before the memory is released
    run.optimizer.state.clear()
    run.optimizer.zero_grad(set_to_none=True)
    free_memory(run.device)
    ray.train.report(_no_result_metrics(
        epoch=epoch, batch_size=run.cfg.batch_size, lr=_current_lr(run), elapsed_s=elapsed_s, peak_mb=peak,
        diverged=diverged, train_loss=train_loss, where=run.where, reader_failures=_reader_failures(run),
        cache_hit_frac=_cache_hit_frac(run), **_lease_metrics(run, window, first=True),
        resumed_from_epoch=run.resumed_from_epoch, damaged_checkpoints=run.damaged_checkpoints,
        cache_repairs=_cache_repairs(run)))


def _report_setup_oom(cfg: TrainConfig, elapsed_s: float, window: tuple[float, float]) -> None:
    """`_report_no_result` for a run that ran out of memory before it had a model or optimiser
    (epoch 1, the configured lr; it never waited for a device)."""
    from trainer.metrics import peak_memory_mb
    from trainer.precision import free_memory

    device = train_device()
    peak = peak_memory_mb(device)
    free_memory(device)
    ray.train.report(_no_result_metrics(
        epoch=1, batch_size=cfg.batch_size, lr=cfg.lr, elapsed_s=elapsed_s, peak_mb=peak, diverged=False,
        where=_where_it_runs(), reader_failures=0, cache_hit_frac=0.0, concurrent_trainings=math.nan,
        device_wait_s=0.0, epoch_start_ts=window[0], epoch_end_ts=window[1], resumed_from_epoch=0,
        damaged_checkpoints=0, cache_repairs=0))


def _no_result_metrics(*, epoch: int, batch_size: int, lr: float, elapsed_s: float, peak_mb: float,
                       diverged: bool, where: dict[str, str], train_loss: float = math.nan,
                       **measured: Any) -> dict[str, Any]:
    """The METRIC_KEYS of an epoch without a result: `oom=1`, or `diverged=1`; no speed; an
    accuracy of 0, not NaN, since Optuna's `tell` turns a NaN objective into a failed trial that
    TPE ignores, where 0 with the constraint `tune.space` sets makes it an infeasible one.
    `measured`: the keys the caller knows (reader failures, cache hits, lease times, ...)."""
    peak = all_reduce_floats([peak_mb], dist.ReduceOp.MAX)[0]
    metrics = {
        "epoch": epoch, "train_loss": float(train_loss), "val_loss": math.nan, "val_acc": 0.0, "val_f1": 0.0,
        "val_recall": 0.0, "val_auc": 0.0, "clips_per_s": 0.0, "compute_clips_per_s": 0.0,
        "steady_clips_per_s": 0.0, "epoch_time_s": float(elapsed_s), "data_wait_frac": 0.0,
        "peak_mem_mb": float(peak), "lr": float(lr), "batch_size": batch_size, "oom": int(not diverged),
        "diverged": int(diverged), "device_util_pct": math.nan, "torch_threads": torch.get_num_threads(),
        "other_cpu_cores": math.nan, **where, **measured,
    }
    return {key: metrics[key] for key in METRIC_KEYS}
