"""The trial driver: the small Tune function each trial runs. It turns the sampled
hyperparameters into a `TrainConfig`, builds the trial's Ray Train `TorchTrainer` (named after
the trial id) and calls `fit()`; the workers' per-epoch reports reach Tune through
`TuneReportCallback`. The driver itself takes only a sliver of a CPU (`DRIVER_CPUS`), so on a
2-core machine two trials' training workers get a whole core each.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import ray
from ray import tune
from ray.train import Result
from ray.tune.experiment import Trial
from ray.tune.integration.ray_train import TuneReportCallback

from vidtune.datasets.index import VideoIndex
from vidtune.trainer.cluster.build_trainer import build_torch_trainer
from vidtune.trainer.cluster.lease import LEAD, LeaseSettings
from vidtune.trainer.cluster.node_setup import NodeSetup
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.report_keys import Key
from vidtune.tune.config import searched
from vidtune.tune.running.cleanup import PlacementGroupRecorder, was_released
from vidtune.tune.running.trial_retry import is_lost_process, note_own_error, raise_if_failed_before

DRIVER_CPUS = 0.1          # the driver only waits on fit(); a full CPU would starve the workers
REUSE_WAIT_S = 60          # how long Tune waits for a stopped trial's function before reusing its process


# A trial's share of its GPU as Ray sees it, by role (`trainer.cluster.lease.LeaseBook.take_role`). Ray
# places fractional GPU requests best-fit (the fullest GPU that still has room), so trials that
# all asked for half a GPU would pile in pairs onto GPUs 0, 1, .. and leave the rest idle. A lead
# asks for more than half: no two leads fit on one GPU, and a lead goes to a GPU without one. A
# follower asks for what a lead leaves: it goes behind a lead, and only once every GPU has one.
LEAD_GPU_SHARE = 0.6
FOLLOW_GPU_SHARE = 1.0 - LEAD_GPU_SHARE


@dataclass(frozen=True)
class TrialResources:
    """What one trial's Train run asks Ray for.

    `gpus_per_worker` is the share of a GPU a worker trains on (1 = a whole GPU, 0.5 = two
    trials packed on one). With `overlap`, a one-worker trial on a whole GPU lets the next trial
    start on the same GPU while it trains: the next one starts up (driver, Train controller,
    worker, data: ~12 s) and then waits on the device lease (`trainer.cluster.lease`), which keeps the
    trainings one at a time per GPU. Ray sees the two as a lead and a follower sharing the GPU
    (`LEAD_GPU_SHARE`), so that trainings spread over all GPUs first. Multi-worker trials ask for
    whole GPUs (two of one trial's workers on one GPU would break its process group). Packed
    trials train side by side, as asked, and take roles too: a lead per GPU first, then
    followers filling the share it leaves.
    """

    workers: int = 1
    cpus_per_worker: float = 0.9
    gpus_per_worker: float = 0.0
    overlap: bool = True

    @property
    def use_gpu(self) -> bool:
        return self.gpus_per_worker > 0

    @property
    def overlaps(self) -> bool:
        """Whether a second trial starts behind each training on its GPU (lead / follower)."""
        return self.overlap and self.workers == 1 and self.gpus_per_worker == 1

    @property
    def packed(self) -> bool:
        """A one-worker trial on a share of a GPU (--gpus-per-trial 0.5): several train side by side."""
        return self.workers == 1 and 0 < self.gpus_per_worker < 1

    @property
    def takes_roles(self) -> bool:
        """Whether the trial asks the lease for a lead or follower role, so that trials spread
        over every GPU before any two share one (overlapping and packed trials)."""
        return self.overlaps or self.packed

    @property
    def trainings_per_gpu(self) -> int:
        """How many trainings the lease lets share one GPU (2 with --gpus-per-trial 0.5)."""
        if 0 < self.gpus_per_worker < 1:
            return max(1, int(1 / self.gpus_per_worker + 1e-9))
        return 1

    def ray_gpus_per_worker(self, role: str = LEAD) -> float:
        """The GPU share asked of Ray per worker: the lead's or follower's part of a whole GPU
        when overlapping; when packed (k trainings per GPU), the lead's share, or an equal part of
        what it leaves for each of the k - 1 followers (a lead and its followers fill one GPU, and
        no two leads share one, so the first trials spread over every GPU: without roles Ray's
        best-fit placement would pile half-GPU trials onto GPUs 0, 0, 1, 1); else the share
        itself (several workers: whole GPUs)."""
        if self.overlaps:
            return LEAD_GPU_SHARE if role == LEAD else FOLLOW_GPU_SHARE
        if self.packed:
            followers = max(1, self.trainings_per_gpu - 1)
            return LEAD_GPU_SHARE if role == LEAD else round((1.0 - LEAD_GPU_SHARE) / followers, 4)
        return self.gpus_per_worker

    def per_worker(self, role: str = LEAD) -> dict[str, float]:
        res = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            res["GPU"] = self.ray_gpus_per_worker(role)
        return res


def short_name(trial: Trial) -> str:
    """A Tune trial's one name everywhere (console, table, trials.csv, MLflow run name, trial and
    checkpoint folders): `t03-bs8-lr2.5e-4`, the trial's number in the search, then each searched
    value (`tune.config.searched`: `-wd1e-2` when weight decay is searched). The number comes from Tune's
    experiment tag (`3_batch_size=8,...`); the Tune id stays in MLflow's `vidtune.trial_id` tag.
    Tune's `trial_name_creator` and `trial_dirname_creator` (public API) call it."""
    tag = str(getattr(trial, "experiment_tag", "") or "")
    number = tag.split("_", 1)[0]
    head = f"t{int(number):02d}" if number.isdigit() else f"t-{trial.trial_id}"
    cfg = dict(getattr(trial, "config", None) or {})
    return "-".join([head] + [p.name_part(cfg[p.name]) for p in searched.PARAMS if p.name in cfg])


def trial_config(base: TrainConfig, sampled: dict[str, Any]) -> TrainConfig:
    """The base configuration with the sampled values put in, each as its field's type (Optuna
    and Tune may hand floats, strings or numpy scalars). By field name, so a worker needs no
    declaration of what was searched. ValueError for a name that is no number of TrainConfig."""
    numbers = {f.name: type(getattr(base, f.name)) for f in fields(base)
               if type(getattr(base, f.name)) in (int, float)}
    unknown = set(sampled) - set(numbers)
    if unknown:
        raise ValueError(f"unexpected sampled parameter(s) {sorted(unknown)}: not a number option of "
                         "TrainConfig")
    return base.with_overrides(**{k: numbers[k](float(v)) for k, v in sampled.items()})


def make_trial_driver(base: TrainConfig, resources: TrialResources, *, train_storage: str,
                      registry_name: str | None = None, lease_name: str | None = None,
                      index: VideoIndex | None = None, trainer_factory: Callable[..., Any] | None = None,
                      score_metric: str = Key.VAL_ACC.value,
                      node_setup: NodeSetup | None = None) -> Callable[[dict], None]:
    """The Tune function of one trial.

    `train_storage`: where the trial's Train run keeps its checkpoints (a subfolder named after
    the trial, `short_name`).
    `registry_name`: the `tune.running.cleanup` registry its placement group is recorded in, and its own
    errors, so that Tune's retry (meant for a lost node) does not train it again (`tune.running.trial_retry`);
    None: none.
    `lease_name`: the search's `trainer.cluster.lease` actor; the trial's workers train only while they
    hold their devices (None: no lease, trials may share a device).
    `index`: the driver's `datasets.index.VideoIndex`, handed to every trial's workers (the
    videos checked before Ray started; None: each run indexes the dataset itself).
    `trainer_factory`: defaults to `trainer.cluster.build_trainer.build_torch_trainer`; tests pass one that
    builds a `TorchTrainer` around a scripted worker loop (same signature).
    `score_metric`: what ranks the trial's checkpoints (`tune.outputs.results.objective_key`).
    `node_setup`: what the search prepared on every node at its start; a trial's workers on a node
    that joined later prepare it first (`trainer.cluster.node_setup`). None: nothing to check.
    """
    base_dict = base.to_dict()

    def trial_driver(config: dict) -> None:
        # Tune reuses this process for the next trial once this function has returned; it waits
        # TUNE_FUNCTION_THREAD_TIMEOUT_S (2 s by default) for that. A stopped trial returns when
        # the search has ended its Train run (see the except below), which can take longer on a
        # loaded machine; past the wait, Tune would end the next trial with an error.
        os.environ.setdefault("TUNE_FUNCTION_THREAD_TIMEOUT_S", str(REUSE_WAIT_S))
        factory = trainer_factory or functools.partial(build_torch_trainer, score_metric=score_metric)
        context = tune.get_context()
        trial_id, trial_name = context.get_trial_id(), context.get_trial_name()
        cfg = trial_config(TrainConfig.from_dict(base_dict), config)
        callbacks: list[Any] = [TuneReportCallback()]
        if registry_name:
            callbacks.append(PlacementGroupRecorder(registry_name, trial_id))
        run_path = f"{train_storage.rstrip('/')}/{trial_name}"
        finished = finished_run_metrics(run_path, cfg.epochs)
        if finished is not None:
            # Resumed after the driver died between the last epoch and Tune recording it: Train
            # would resume from the final checkpoint and report nothing, so report its metrics.
            tune.report(finished)
            return
        if registry_name:
            raise_if_failed_before(registry_name, trial_id)
        lease = LeaseSettings(lease_name, trial_id) if lease_name else None
        role = LEAD
        if lease_name and resources.takes_roles:
            role = ray.get(ray.get_actor(lease_name).take_role.remote(trial_id), timeout=60)
        trainer = factory(
            cfg, num_workers=resources.workers, use_gpu=resources.use_gpu,
            resources_per_worker=resources.per_worker(role), name=trial_name,
            storage_path=train_storage, callbacks=callbacks, device_lease=lease, index=index,
            node_setup=node_setup,
        )
        try:
            trainer.fit()
        except Exception as e:
            # Tune stopped this trial (ASHA, the end of the search) and the search ended its Train
            # run (tune.running.cleanup): nothing failed. Returning frees this process for the next trial.
            if registry_name and was_released(registry_name, trial_id):
                return
            if registry_name and not is_lost_process(e):
                note_own_error(registry_name, trial_id, e)
            raise

    return trial_driver


def finished_run_metrics(run_path: str, epochs: int) -> dict | None:
    """The last checkpointed metrics of an earlier Train run at `run_path` that already trained
    all `epochs` (a trial resumed by `--resume`), with its checkpoint path; else None."""
    try:
        previous = Result.from_path(run_path)
    except Exception:       # no such run yet, or not a finished Train run folder
        return None
    metrics = dict(previous.metrics or {})
    if int(metrics.get(Key.EPOCH, 0) or 0) < epochs:
        return None
    if previous.checkpoint is not None:
        metrics["checkpoint_path"] = previous.checkpoint.path
    return metrics
