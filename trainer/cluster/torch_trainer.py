"""vidtune's Ray Train `TorchTrainer`: Ray's, less two processes per run that vidtune never uses.

Ray Train (2.60) starts, for every run:
- a `DatasetManager` actor, whether or not the run was given Ray Data datasets: a fresh Ray
  worker process that imports Ray Data (~1 s of CPU, ~170 MB) on the node of the run's
  controller, which the workers wait for before their training function starts. vidtune feeds
  its workers with its own decord/torch DataLoader (`trainer.cluster.worker`) and passes no datasets.
- a detached `PlacementGroupCleaner` actor on the head node, which polls the State API every
  second to remove the run's placement group should its controller die without removing it.
  vidtune removes them itself: a search's `tune.running.cleanup.ReleaseTrialResources` ends each trial's
  controller and placement groups when Tune ends or retries the trial (Ray's cleaner fails on a loaded
  machine, or with two Rays on one); `vidtune train`'s groups belong to its job and go with it.
  Stopping the cleaner also held the end of every `fit()` for ~0.45 s.
`bench/trial_overhead.py` measures both. Given datasets, the `DatasetManager` is kept.

It also restarts no worker group that failed on a full disk (`DiskFullNotRetried`): Ray's policy
restarts any worker failure up to `--max-failures` times, and a restart from the last checkpoint
only fills the same disk again (~10 s a restart, and the message the user needs comes later).

This is the trainer layer's one home for Ray internals (`DatasetsCallback` and
`PlacementGroupCleanerCallback`, the callbacks that start the actors, and
`_create_default_callbacks`, where Train lists its callbacks; Train has no public switch for
either; its failure policy, `_initialize_and_run_controller`'s `failure_policy`; the logger of
a worker's reports, `quiet_report_lines`; and Ray's torch backend with its helper that sets
RANK/LOCAL_RANK, which `trainer.cluster.process_group_ports` reuses to place the process group's sockets).
Like
`vidtune.tune.running.ray_internals`, it checks the Ray minor on import.
"""
from __future__ import annotations

import logging

from ray.train import WorkerGroupError
from ray.train.torch import TorchTrainer

from vidtune.errors import no_space_left
from vidtune.ray_version import check_ray_version, moved_internal

check_ray_version()
try:
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
except ImportError as e:  # only reachable on another Ray with VIDTUNE_ALLOW_UNTESTED_RAY=1
    raise moved_internal("ray.train.v2._internal.callbacks.datasets.DatasetsCallback", e) from e
try:
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
except ImportError as e:
    raise moved_internal(
        "ray.train.v2._internal.callbacks.placement_group_callback.PlacementGroupCleanerCallback", e) from e
try:
    from ray.train.v2._internal.execution import context as _train_context
except ImportError as e:
    raise moved_internal("ray.train.v2._internal.execution.context", e) from e
try:
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
except ImportError as e:
    raise moved_internal("ray.train.v2._internal.execution.failure_handling.DefaultFailurePolicy", e) from e

try:
    from ray.train.torch.config import _set_torch_distributed_env_vars, _TorchBackend
except ImportError as e:
    raise moved_internal("ray.train.torch.config._TorchBackend", e) from e

__all__ = ["DiskFullNotRetried", "TorchTrainer", "VidtuneTorchTrainer", "_TorchBackend",
           "_set_torch_distributed_env_vars", "quiet_report_lines"]


def quiet_report_lines() -> None:
    """Keep Train's "Reporting training result N: TrainingReport(...)" line (a ~2 KB dump of
    every metric, logged at INFO by each worker for each report) off the user's console; the
    console prints its own epoch line. The logger is named by Train's file path, not a module."""
    logging.getLogger(_train_context.__file__).setLevel(logging.WARNING)


class DiskFullNotRetried(DefaultFailurePolicy):
    """Ray Train's failure policy, except that a worker group that failed on a full disk (errno
    28 in any worker's error) ends the run at once instead of restarting from its checkpoint."""

    def make_decision(self, training_failed_error):
        error = training_failed_error
        if isinstance(error, WorkerGroupError) and any(
                no_space_left(e) for e in (error, *error.worker_failures.values())):
            self._log_decision(FailureDecision.RAISE, error, 1, 0)
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)


class VidtuneTorchTrainer(TorchTrainer):
    """`ray.train.torch.TorchTrainer` that starts no `PlacementGroupCleaner`, nor a
    `DatasetManager` for a run without `datasets`, and does not restart a full disk's failure."""

    def _create_default_callbacks(self):
        unused = (PlacementGroupCleanerCallback,) if self.datasets else \
            (PlacementGroupCleanerCallback, DatasetsCallback)
        return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, unused)]

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        controller_init_kwargs["failure_policy"] = DiskFullNotRetried(self.run_config.failure_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)
