"""Two of the search's option groups: where its trials run and what each asks Ray for
(`Resources`), and what MLflow records (`Tracking`), each with the checks of its own fields.
`tune.config.options.SearchOptions` holds them beside the training run and the search space."""
from __future__ import annotations

from dataclasses import dataclass, field

from vidtune.flags import ConfigError, option
from vidtune.trainer.cluster.capacity import check_gpus_per_worker
from vidtune.trainer.ray_setup.ray_start import RayStart


@dataclass(frozen=True)
class Resources:
    """Where trials run and what each asks Ray for. None: decided from the cluster."""

    address: str | None = option(None, flag="--address", metavar="ADDR", help="Ray cluster to join: auto or "
                                 "ray://host:10001 (default: start a local Ray)")
    workers_per_trial: int = option(1, flag="--workers-per-trial", metavar="N", ge=1,
                                    help="Ray Train workers (data-parallel replicas) per trial")
    # None: decided from the cluster (`tune.running.cluster.fit_to_cluster`, `trainer.cluster.cpu_share`).
    cpus_per_worker: float | None = option(None, flag="--cpus-per-worker", metavar="C", gt=0,
                                           help="CPUs reserved per training worker (default: 0.9 on CPUs, a "
                                           "core less the trial driver's 0.1; on GPUs the node's CPUs per "
                                           "GPU shared by the trials there, e.g. 3.5 with 8, at least 0.9)")
    gpus_per_worker: float | None = option(None, flag="--gpus-per-worker", metavar="G", ge=0,
                                           help="GPUs per training worker (default 1 if the cluster has "
                                           "GPUs, else 0)")
    gpus_per_trial: float | None = option(None, flag="--gpus-per-trial", metavar="G", ge=0,
                                          help="GPUs per trial, split over its workers; 0.5 packs two trials "
                                          "per GPU")
    cluster_config: str | None = option(
        None, flag="--cluster-config", metavar="FILE",
        help="the autoscaler's cluster config, whose node types x max_workers count towards the trials at "
        "once (with --address; default ~/ray_bootstrap_config.yaml, which `ray up` leaves on the head)")
    max_concurrent_trials: int | None = option(
        None, flag="--max-concurrent-trials", metavar="N", ge=1,
        help="trials at once (default: 2 per GPU, one training and one starting behind it; "
        "1 per CPU-only machine; within what the resources allow)")

    ray_start: RayStart = field(default_factory=RayStart)   # a local Ray's object store and time limit


@dataclass(frozen=True)
class Tracking:
    mlflow_uri: str = option("sqlite:///mlruns.db", flag="--mlflow-uri", metavar="URI",
                             help="MLflow tracking URI: sqlite:///FILE or http(s)://server "
                             "(default sqlite:///mlruns.db in the working folder)")
    experiment: str = option("vidtune", flag="--experiment", metavar="NAME",
                             help="MLflow experiment that holds the search's runs "
                             "(not --name, the search's folder)")
    artifact_location: str | None = option(None, flag="--artifact-location", metavar="URI",
                                           help="where a new MLflow experiment keeps its artifacts: a folder "
                                           "or s3://... (default: mlartifacts/ beside a sqlite:/// store; a "
                                           "tracking server's own); an existing experiment keeps its own")
    log_model: bool = option(True, flag="--no-log-model",
                             help="leave the best model out of MLflow (nor registered): its checkpoint "
                             "stays in the results folder; saves the model's export (seconds to a minute)")
    # Two fields, one setting: a str flag cannot be switched off. Declared in this order, the
    # config file's key `register-model` is the name's (its `no-register-model` the switch's).
    register: bool = option(True, flag="--no-register-model",
                            help="log the best model in MLflow without registering it")
    register_model: str | None = option(None, flag="--register-model", metavar="NAME",
                                        help="register the best trial's model in MLflow's Model Registry "
                                        "under NAME, as its next version (default: the --experiment name)")

    @property
    def model_name(self) -> str | None:
        """The registered model's name, or None with --no-register-model or --no-log-model."""
        return (self.register_model or self.experiment) if self.register and self.log_model else None



def check_tracking(t: Tracking) -> None:
    """The registry's switches agree (the name itself: `tune.tracking.store.check_model_name`)."""
    if t.register_model is not None and not t.register:
        raise ConfigError("--register-model/--no-register-model", "give one of them, not both")
    if t.register_model is not None and not t.log_model:
        raise ConfigError("--register-model/--no-log-model", "a model not logged cannot be registered: "
                          "give one of them, not both")


def check_resources(r: Resources) -> None:
    """`trainer.cluster.capacity.check_gpus_per_worker`, `vidtune train`'s rule, on the share each worker
    of a trial gets (from --gpus-per-worker, or --gpus-per-trial split over the workers)."""
    flag = "--gpus-per-worker" if r.gpus_per_worker is not None else "--gpus-per-trial"
    per_worker = r.gpus_per_worker if r.gpus_per_worker is not None else (
        r.gpus_per_trial / r.workers_per_trial if r.gpus_per_trial is not None else None)
    check_gpus_per_worker(per_worker, r.workers_per_trial, flag=flag, workers_flag="--workers-per-trial",
                          whole=f"--gpus-per-trial {r.workers_per_trial}")
