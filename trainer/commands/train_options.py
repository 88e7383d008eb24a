"""What `vidtune train` takes besides the `TrainConfig` (where the run goes, its config file),
and the rule its workers must fit by: shared by the command (`trainer.commands.train`, light: read before
Ray starts) and the run on Ray (`trainer.commands.train_run`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from vidtune.flags import flag_specs, option
from vidtune.trainer.cluster.capacity import ClusterCapacity, WorkerRequest, check_fits
from vidtune.trainer.ray_setup.ray_start import RayStart

PROG = "vidtune train"       # the command as the user typed it: its usage, errors and warnings


@dataclass(frozen=True)
class RunOptions:
    """What `vidtune train` takes besides the `TrainConfig`: its config file and where
    the run goes. None: decided when Ray is up (GPUs) or named by Ray (storage, name)."""

    config: str | None = option(None, flag="--config", metavar="FILE",
                                help="a search's best_config.json (its train_config), or a TOML/YAML file of "
                                "options (keys as the flags, e.g. batch-size or batch_size); flags given "
                                "on the command line override it")
    workers: int = option(1, flag="--workers", metavar="N", ge=1,
                          help="Ray Train workers, data-parallel replicas")
    gpus_per_worker: float | None = option(None, flag="--gpus-per-worker", metavar="G", ge=0,
                                           help="GPUs per worker (default: 1 when GPUs are present, else 0)")
    cpus_per_worker: float = option(1.0, flag="--cpus-per-worker", metavar="C", gt=0,
                                    help="CPUs Ray reserves per worker")
    storage: str | None = option(None, flag="--storage", metavar="PATH",
                                 help="where checkpoints go (default ~/ray_results; shared storage on a "
                                 "cluster)")
    name: str | None = option(None, flag="--name", metavar="NAME",
                              help="run name (default vidtune-train-TIMESTAMP); reuse it to resume")
    address: str | None = option(None, flag="--address", metavar="ADDR",
                                 help="Ray cluster address (auto, ray://host:10001); default: local Ray")
    ray_start: RayStart = field(default_factory=RayStart)   # a local Ray's object store and time limit


RUN_FLAGS = tuple(flag_specs(RunOptions))


def check_capacity(where: RunOptions, capacity: ClusterCapacity, *, place: str, more: str) -> WorkerRequest:
    """The run's workers fit on `capacity` (`trainer.cluster.capacity.check_fits`, the search's rule),
    counting the nodes an autoscaler may start; returns what each worker asks for,
    --gpus-per-worker defaulting to 1 where there are GPUs. ConfigError naming the flag
    (--gpus-per-worker when given, else --workers); `place` and `more` as `check_fits`'s."""
    nodes = capacity.planned
    gpus = where.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if sum(g for _, g in nodes) > 0 else 0.0
    flag = "--gpus-per-worker" if where.gpus_per_worker is not None else "--workers"
    request = WorkerRequest(where.workers, where.cpus_per_worker, gpus, gpus_flag=flag)
    check_fits(request, nodes, where=place, more=more)
    return request
