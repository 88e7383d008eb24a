"""vidtune's TorchTrainer: Ray's, less the Ray Data process a run without datasets never uses and
the placement-group cleaner vidtune does the work of (tune.cleanup)."""
from __future__ import annotations

import ray.train
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

from vidtune.trainer.torch_trainer import TorchTrainer, VidtuneTorchTrainer


def _loop(config: dict) -> None:
    pass


def _callback_types(trainer) -> list[type]:
    return [type(cb) for cb in trainer._create_default_callbacks()]


def test_without_datasets_no_datasets_callback_no_cleaner_and_every_other_callback_of_rays(tmp_path):
    run = ray.train.RunConfig(name="t", storage_path=str(tmp_path))
    ours = _callback_types(VidtuneTorchTrainer(_loop, run_config=run))
    rays = _callback_types(TorchTrainer(_loop, run_config=run))
    assert DatasetsCallback in rays                    # Ray's starts a DatasetManager for every run
    assert PlacementGroupCleanerCallback in rays       # ... and a detached PlacementGroupCleaner
    assert ours == [t for t in rays if t not in (DatasetsCallback, PlacementGroupCleanerCallback)]


def test_given_datasets_it_keeps_rays_datasets_callback_but_starts_no_cleaner(tmp_path):
    run = ray.train.RunConfig(name="t", storage_path=str(tmp_path))
    datasets = {"train": lambda: None}                 # not read: only whether any were given
    ours = _callback_types(VidtuneTorchTrainer(_loop, run_config=run, datasets=datasets))
    rays = _callback_types(TorchTrainer(_loop, run_config=run, datasets=datasets))
    assert DatasetsCallback in ours
    assert ours == [t for t in rays if t is not PlacementGroupCleanerCallback]
