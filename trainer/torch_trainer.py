"""vidtune's Ray Train `TorchTrainer`: Ray's own, less one process per run that vidtune never uses.

Ray Train (2.60) starts a `DatasetManager` actor for every run, whether or not the run was given
Ray Data datasets: a fresh Ray worker process that imports Ray Data (~1 s of CPU, ~170 MB), on
the node of the run's controller (on a cluster, the head, beside the search), and the workers
wait for it before their training function starts. vidtune feeds its workers with its own
decord/torch DataLoader (`trainer.worker`) and passes no datasets, so a trial spent ~1.5 s of its
start-up and a process on the head on nothing (`bench/trial_overhead.py`). Given datasets, this
is Ray's trainer unchanged.

This is the trainer layer's one use of a Ray internal (`DatasetsCallback`, the callback that
starts the actor, and `_create_default_callbacks`, where Train lists its callbacks; Train has no
public switch for either). Like `vidtune.tune.ray_internals`, it checks the Ray minor on import.
"""
from __future__ import annotations

from ray.train.torch import TorchTrainer

from vidtune.ray_version import check_ray_version, moved_internal

check_ray_version()
try:
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
except ImportError as e:  # only reachable on another Ray with VIDTUNE_ALLOW_UNTESTED_RAY=1
    raise moved_internal("ray.train.v2._internal.callbacks.datasets.DatasetsCallback", e) from e

__all__ = ["TorchTrainer", "VidtuneTorchTrainer"]


class VidtuneTorchTrainer(TorchTrainer):
    """`ray.train.torch.TorchTrainer` whose runs without `datasets` start no `DatasetManager`."""

    def _create_default_callbacks(self):
        callbacks = super()._create_default_callbacks()
        if self.datasets:
            return callbacks
        return [cb for cb in callbacks if not isinstance(cb, DatasetsCallback)]
