"""`vidtune train`'s run on Ray, once its inputs are checked (`trainer.commands.train`): start or join
Ray, check the cluster can hold the workers, fit, print each epoch as it ends, and name the best
checkpoint. The heavy half of the command (Ray Train, torch), imported by `trainer.commands.train.main`.
"""
from __future__ import annotations

import math
import queue as stdlib_queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.util.queue import Empty, Queue

from vidtune.datasets.index import VideoIndex
from vidtune.errors import VidtuneError
from vidtune.trainer.cluster.build_trainer import build_torch_trainer
from vidtune.trainer.cluster.capacity import AUTOSCALER_CONFIG, ClusterCapacity, capacity_of
from vidtune.trainer.commands.train_options import PROG, RunOptions, check_capacity
from vidtune.trainer.ray_setup.launch import init_ray, joins_cluster
from vidtune.trainer.training.checkpointing import first_whole
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.report_keys import Key


def format_epoch(m: dict[str, Any], epochs: int) -> str:
    """One human-readable line of a worker report."""
    head = f"epoch {m[Key.EPOCH]}/{epochs}"
    if m.get(Key.OOM):
        return f"{head}  OUT OF MEMORY at batch size {m[Key.BATCH_SIZE]} (peak {m[Key.PEAK_MEM_MB]:.0f} MB)"
    if m.get(Key.DIVERGED):
        return f"{head}  DIVERGED: training loss {m[Key.TRAIN_LOSS]}; stopped, no checkpoint"
    return (f"{head}  train_loss {m[Key.TRAIN_LOSS]:.4f}  val_loss {m[Key.VAL_LOSS]:.4f}  "
            f"val_acc {m[Key.VAL_ACC]:.3f}  val_f1 {m[Key.VAL_F1]:.3f}  val_recall {m[Key.VAL_RECALL]:.3f}  "
            f"val_auc {m[Key.VAL_AUC]:.3f}  {m[Key.CLIPS_PER_S]:.1f} clips/s  {m[Key.EPOCH_TIME_S]:.1f} s  "
            f"data_wait {100 * m[Key.DATA_WAIT_FRAC]:.0f}%  peak_mem {m[Key.PEAK_MEM_MB]:.0f} MB  "
            f"lr {m[Key.LR]:.2e}"
            + (f"  reader_failures {m[Key.READER_FAILURES]}" if m.get(Key.READER_FAILURES) else ""))


def failure_message(last: dict[str, Any], lr: float) -> str | None:
    """Why a run whose last report is `last` has no result, and what to change; None when it
    trained. `lr`: the run's --lr."""
    if last.get(Key.OOM):
        return (f"out of memory at batch size {last.get(Key.BATCH_SIZE)}; lower --batch-size "
                "(use --grad-accum to keep the effective batch), or try --precision bf16/fp16")
    if last.get(Key.DIVERGED):
        return (f"training diverged in epoch {last.get(Key.EPOCH)}: the training loss became "
                f"{last.get(Key.TRAIN_LOSS)} (inf or NaN weights) at --lr {lr:g}; lower --lr (e.g. "
                f"{lr / 10:g}), or keep --clip-grad-norm on and --warmup-frac above 0")
    return None


def _epoch_printer(epochs: int):
    """A Ray Train callback (runs in the Train controller) that sends rank 0's metrics to a
    queue, and a driver thread that prints them as they come, unprefixed by Ray's log tags.
    Its `close()` returns every report, in order (empty without any): Train's `Result.metrics`
    holds only reports that came with a checkpoint, which out of memory and divergence do not."""
    q = Queue(actor_options={"num_cpus": 0})

    class EpochQueue(ray.train.UserCallback):
        def __init__(self, queue):
            self.queue = queue

        def after_report(self, run_context, metrics, checkpoint):
            self.queue.put(dict(metrics[0]))

    stop = threading.Event()
    reports: list[dict[str, Any]] = []

    def pump():
        while True:
            try:
                metrics = q.get(timeout=0.5)
            except (Empty, stdlib_queue.Empty):
                if stop.is_set():
                    return
                continue
            reports.append(metrics)
            print(format_epoch(metrics, epochs), flush=True)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()

    def close() -> list[dict[str, Any]]:
        stop.set()
        thread.join(timeout=10)
        q.shutdown()
        return reports

    return EpochQueue(q), close


class TrainingError(VidtuneError, RuntimeError):
    """The run trained but left no result to use (it failed, ran out of memory, diverged, or left
    no whole checkpoint); the message says why and what to change."""


@dataclass(frozen=True)
class TrainOutcome:
    """A run that trained: its best whole `checkpoint` (by val_acc, ties to the later epoch) with
    that `epoch` and `val_acc`, and every report rank 0 made (`reports`, one per epoch)."""

    name: str
    path: str                     # the run's folder: <storage>/<name> (Ray Train's Result.path)
    checkpoint: str
    epoch: int
    val_acc: float
    reports: list[dict[str, Any]]


def run(cfg: TrainConfig, where: RunOptions, index: VideoIndex | None = None) -> int:
    """`fit`, then print the best checkpoint: the command's exit code (1 when it has no result)."""
    try:
        outcome = fit(cfg, where, index)
    except TrainingError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    print(f"best checkpoint (epoch {outcome.epoch}, val_acc {outcome.val_acc:.3f}): {outcome.checkpoint}")
    return 0


def fit(cfg: TrainConfig, where: RunOptions, index: VideoIndex | None = None) -> TrainOutcome:
    """Start Ray (shut down again at the end when this call started it), fit, and return the
    best whole checkpoint. Inputs must have been checked. TrainingError when there is no result."""
    started = init_ray(address=where.address, ray_start=where.ray_start)
    try:
        return _fit(cfg, where, index)
    finally:
        if started:   # a notebook's second run, or the caller's own Ray, starts clean
            ray.shutdown()


def _fit(cfg: TrainConfig, where: RunOptions, index: VideoIndex | None) -> TrainOutcome:
    # Again on what Ray has, on a cluster the nodes its autoscaler may start (the config `ray up`
    # leaves on the head): Train would wait without end for workers that cannot be placed.
    capacity = read_capacity(AUTOSCALER_CONFIG if joins_cluster(where.address) else None)
    request = check_capacity(where, capacity, place="the Ray cluster", more="add GPU nodes")
    use_gpu = request.gpus_per_worker > 0
    resources = {"CPU": float(request.cpus_per_worker)}
    if use_gpu:
        resources["GPU"] = float(request.gpus_per_worker)
    name = where.name or time.strftime("vidtune-train-%Y%m%d-%H%M%S")
    callback, close = _epoch_printer(cfg.epochs)
    trainer = build_torch_trainer(cfg, num_workers=where.workers, use_gpu=use_gpu,
                                  resources_per_worker=resources, name=name, storage_path=where.storage,
                                  callbacks=[callback], index=index)
    print(f"training {cfg.model} on {where.workers} worker(s), {'GPU' if use_gpu else 'CPU'}, run {name}",
          flush=True)
    try:
        result = trainer.fit()
    except Exception as e:  # TrainingFailedError wraps the worker's exception
        close()
        raise TrainingError(f"training failed: {e}") from None
    reports = close()
    last = reports[-1] if reports else result.metrics or {}
    problem = failure_message(last, cfg.lr)
    if problem:
        raise TrainingError(problem)
    # Best first by val_acc (ties: the later epoch); a damaged one is skipped with a line.
    ranked = sorted(result.best_checkpoints or [], key=lambda cm: (_acc(cm[1]), cm[1].get(Key.EPOCH, 0)),
                    reverse=True)
    if not ranked and result.checkpoint is not None:
        ranked = [(result.checkpoint, last)]
    best, skipped = first_whole([c.path for c, _ in ranked])
    for why in skipped:
        print(f"{PROG}: warning: {why}; not named best", file=sys.stderr)
    if best is None:
        raise TrainingError("training reported no " + ("whole checkpoint" if skipped else "checkpoint"))
    score = next(m for c, m in ranked if c.path == best)
    acc = _acc(score)
    return TrainOutcome(name=name, path=str(result.path), checkpoint=best, epoch=int(score.get(Key.EPOCH, 0)),
                        val_acc=acc if math.isfinite(acc) else math.nan, reports=reports)


def read_capacity(config: Path | None) -> ClusterCapacity:
    """The running Ray cluster's capacity (`trainer.cluster.capacity.capacity_of` its nodes); `config`:
    the autoscaler's cluster config (None: no autoscaler)."""
    return capacity_of(ray.nodes(), config)


def _acc(metrics: dict[str, Any]) -> float:
    acc = metrics.get(Key.VAL_ACC, math.nan)
    return acc if isinstance(acc, (int, float)) and math.isfinite(acc) else -math.inf
