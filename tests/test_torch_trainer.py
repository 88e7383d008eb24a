"""vidtune's TorchTrainer: Ray's, less the Ray Data process a run without datasets never uses and
the placement-group cleaner vidtune does the work of (tune.running.cleanup)."""
from __future__ import annotations

import ray.train
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

from vidtune.trainer.cluster.torch_trainer import TorchTrainer, VidtuneTorchTrainer


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


def _worker_group_error(error: BaseException):
    from ray.train import WorkerGroupError

    return WorkerGroupError(f"rank 0: {error}", {0: error})


def test_a_full_disk_ends_the_run_at_once_other_worker_failures_restart_as_rays_do():
    """Restarting from the last checkpoint only fills the same disk again: errno 28 in a worker's
    error (the OSError itself, or its text as Ray passes it on) ends the run at its first failure,
    --max-failures or not; any other worker failure is Ray's to retry, up to max_failures."""
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision

    from vidtune.trainer.cluster.torch_trainer import DiskFullNotRetried

    full = OSError(28, "No space left on device", "/results/t01/checkpoint.pt")
    for error in (full, RuntimeError(f"ray::RayTrainWorker.run_train_fn() failed: {full}")):
        policy = DiskFullNotRetried(FailureConfig(max_failures=3))
        assert policy.make_decision(_worker_group_error(error)) == FailureDecision.RAISE, error
    policy = DiskFullNotRetried(FailureConfig(max_failures=1))
    died = _worker_group_error(RuntimeError("the actor died unexpectedly"))
    assert [policy.make_decision(died) for _ in range(2)] == [FailureDecision.RETRY, FailureDecision.RAISE]


def test_the_trainer_hands_its_controller_the_disk_full_policy(tmp_path, monkeypatch):
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from vidtune.trainer.cluster.torch_trainer import DiskFullNotRetried

    handed = {}
    monkeypatch.setattr(DataParallelTrainer, "_initialize_and_run_controller",
                        lambda self, **kw: handed.update(kw) or "result")
    run = ray.train.RunConfig(name="t", storage_path=str(tmp_path),
                              failure_config=ray.train.FailureConfig(max_failures=2))
    trainer = VidtuneTorchTrainer(_loop, run_config=run)
    assert trainer._initialize_and_run_controller(failure_policy=object(), callbacks=[]) == "result"
    policy = handed["failure_policy"]
    assert isinstance(policy, DiskFullNotRetried) and policy.failure_config.max_failures == 2
    assert handed["callbacks"] == []
