"""The Ray Train (V2) `TorchTrainer` of one training run (`build_torch_trainer`): its checkpoint
ranking, failure and logging settings, its workers and their process group.

The heavy half of launching (Ray Train, torch, the worker's code); the light half, the checks
run before Ray starts and `init_ray`, is `trainer.ray_setup.launch`. Used by `trainer.commands.train_run` (one
run), `tune.running.trial` (one trainer per trial) and the tests.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray.train

from vidtune import atomic_fs
from vidtune.datasets.index import VideoIndex
from vidtune.trainer.cluster.lease import LEASE_CONFIG_KEY
from vidtune.trainer.cluster.node_setup import NODE_SETUP_CONFIG_KEY, NodeSetup
from vidtune.trainer.cluster.process_group import GPU_BACKEND, LeasedTorchConfig
from vidtune.trainer.cluster.torch_trainer import VidtuneTorchTrainer
from vidtune.trainer.cluster.worker_entry import train_loop_per_worker
from vidtune.trainer.ray_setup.launch import worker_env_vars
from vidtune.trainer.training.config import INDEX_CONFIG_KEY, TrainConfig
from vidtune.trainer.training.gpus import simulated_gpus
from vidtune.trainer.training.report_keys import Key


def collective_timeout_s(cfg: TrainConfig) -> int:
    """`cfg.collective_timeout_min` in whole seconds (`TorchConfig.timeout_s` is an int), at least 1."""
    return max(1, round(cfg.collective_timeout_min * 60))


def build_torch_trainer(
    cfg: TrainConfig,
    *,
    num_workers: int = 1,
    use_gpu: bool = False,
    resources_per_worker: dict | None = None,
    name: str | None = None,
    storage_path: str | None = None,
    storage_filesystem: Any = None,
    callbacks: list | None = None,
    checkpoint_keep: int = 1,
    train_loop: Callable[[dict], None] | None = None,
    device_lease: Any = None,
    index: VideoIndex | None = None,
    score_metric: str = Key.VAL_ACC.value,
    node_setup: NodeSetup | None = None,
):
    """The Ray Train (V2) `TorchTrainer` of one training run of `cfg`.

    Checkpoints are ranked by `score_metric` (val_acc or val_f1: a search's objective, the
    metric that picks its best epoch; the best `checkpoint_keep`, at least 2, are kept, plus
    always the latest so a rerun with the same `name` and `storage_path` resumes from it). `storage_path`
    None means Ray's default `~/ray_results`; on a multi-node cluster pass shared storage.
    `storage_filesystem`: a `pyarrow.fs.FileSystem` that `storage_path` is on, when Ray cannot
    infer it from the path (Ray's `RunConfig(storage_filesystem=...)`: custom credentials, ...).
    A run whose worker dies restarts from its last checkpoint up to `cfg.max_failures` times
    (`--max-failures`); out of memory is not a failure (the worker reports `oom=1` and returns).
    A rank left waiting in a collective by another (failed, stuck) fails after
    `cfg.collective_timeout_min` (`--collective-timeout-min`, `TorchConfig(timeout_s=...)`).
    `train_loop`: the per-worker function, `trainer.cluster.worker_entry.train_loop_per_worker` by default
    (pass a wrapper of it to, e.g., register extra models in the worker process first).
    `device_lease`: a `trainer.cluster.lease.LeaseSettings` (a search's trials): the workers wait for
    their devices before the first epoch and give them back after the last (`trainer.cluster.lease`).
    `index`: the `datasets.index.VideoIndex` the driver checked; the workers train on exactly
    those videos instead of indexing the dataset again.
    `node_setup`: what a search prepared on every node at its start, which each worker makes sure
    its own node has before it trains (a node that joined later: `trainer.cluster.node_setup`).
    """
    run_config = ray.train.RunConfig(
        name=name,
        storage_path=storage_path,
        # each checkpoint file whole or absent on a full disk (vidtune/atomic_fs.py), unless the
        # caller gives its own filesystem
        storage_filesystem=storage_filesystem if storage_filesystem is not None else (
            atomic_fs.storage_filesystem(storage_path) if storage_path else None),
        callbacks=callbacks,
        # At least two: Ray always keeps the latest on top of the best `num_to_keep` by the score,
        # so with two the run holds at least one checkpoint besides the latest, which a worker
        # falls back to when the latest is damaged (`trainer.cluster.worker._read_checkpoint`).
        checkpoint_config=ray.train.CheckpointConfig(
            num_to_keep=max(2, checkpoint_keep),
            checkpoint_score_attribute=score_metric,
            checkpoint_score_order="max",
        ),
        # A dead worker (killed, node lost) restarts the group from the last checkpoint, at most
        # cfg.max_failures times. Out of memory never gets here: the worker reports it and returns.
        failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
        # Train's INFO log repeats every report's metrics dict; the CLIs print their own lines.
        logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        # Also set through ray.init; repeated here for drivers that connected to Ray themselves. An
        # own model's code is not: Ray takes local py_modules at the job level only (ray.init), and
        # every worker inherits the job's.
        worker_runtime_env={"env_vars": worker_env_vars()},
    )
    scaling = ray.train.ScalingConfig(
        num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources_per_worker
    )
    loop_config = cfg.to_dict()
    if device_lease is not None:
        loop_config[LEASE_CONFIG_KEY] = device_lease.to_dict()
    if index is not None:
        loop_config[INDEX_CONFIG_KEY] = index
    if node_setup is not None:
        loop_config[NODE_SETUP_CONFIG_KEY] = node_setup.to_dict()
    # GPUs: gloo for the worker's own (CPU) collectives, NCCL for DDP's
    # (trainer.cluster.process_group.GPU_BACKEND),
    # and no CUDA context before the lease (LeasedTorchConfig). Simulated GPUs (trainer.training.gpus): the
    # workers train on the CPU, where NCCL cannot run. The CPU: gloo (Ray's choice).
    # timeout_s: a rank that fails mid-collective ends the run after --collective-timeout-min
    # instead of NCCL's 30 minutes (a timed-out NCCL collective ends its worker's process under
    # torch's async error handling; gloo raises in the waiting rank).
    backend = None if not use_gpu else "gloo" if simulated_gpus() else GPU_BACKEND
    torch_config = LeasedTorchConfig(backend=backend, timeout_s=collective_timeout_s(cfg))
    return VidtuneTorchTrainer(
        train_loop or train_loop_per_worker,
        torch_config=torch_config,
        train_loop_config=loop_config,
        scaling_config=scaling,
        run_config=run_config,
    )
