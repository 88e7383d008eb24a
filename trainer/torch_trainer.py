"""vidtune's Ray Train `TorchTrainer`: Ray's own, less one process per run that vidtune never uses.

Ray Train (2.60) starts a `DatasetManager` actor for every run, whether or not the run was given
Ray Data datasets: a fresh Ray worker process that imports Ray Data (~1 s of CPU, ~170 MB), on
the node of the run's controller (on a cluster, the head, beside the search), and the workers
wait for it before their training function starts. vidtune feeds its workers with its own
decord/torch DataLoader (`trainer.worker`) and passes no datasets, so a trial spent ~1.5 s of its
start-up and a process on the head on nothing (`bench/trial_overhead.py`). Given datasets, this
is Ray's trainer unchanged.

This is the trainer layer's one home for Ray internals (`DatasetsCallback`, the callback that
starts the actor, and `_create_default_callbacks`, where Train lists its callbacks; Train has no
public switch for either; and the logger of a worker's reports, `quiet_report_lines`). Like
`vidtune.tune.ray_internals`, it checks the Ray minor on import.
"""
from __future__ import annotations

import logging

from ray.train.torch import TorchTrainer

from vidtune.ray_version import check_ray_version, moved_internal

check_ray_version()
try:
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
except ImportError as e:  # only reachable on another Ray with VIDTUNE_ALLOW_UNTESTED_RAY=1
    raise moved_internal("ray.train.v2._internal.callbacks.datasets.DatasetsCallback", e) from e
try:
    from ray.train.v2._internal.execution import context as _train_context
except ImportError as e:
    raise moved_internal("ray.train.v2._internal.execution.context", e) from e

__all__ = ["TorchTrainer", "VidtuneTorchTrainer", "quiet_report_lines"]


def quiet_report_lines() -> None:
    """Keep Train's "Reporting training result N: TrainingReport(...)" line (a ~2 KB dump of
    every metric, logged at INFO by each worker for each report) off the user's console; the
    console prints its own epoch line. The logger is named by Train's file path, not a module."""
    logging.getLogger(_train_context.__file__).setLevel(logging.WARNING)


class VidtuneTorchTrainer(TorchTrainer):
    """`ray.train.torch.TorchTrainer` whose runs without `datasets` start no `DatasetManager`."""

    def _create_default_callbacks(self):
        callbacks = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        return [cb for cb in callbacks if not isinstance(cb, DatasetsCallback)]
