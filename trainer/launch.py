"""Driver-side launch helpers: start or join Ray, check a config before
any worker starts, and build the Ray Train `TorchTrainer` of one training run.

Used by `trainer.train` (one run), `tune.search` (one trainer per trial) and the tests.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from vidtune.datasets.index import VideoIndex, build_index
from vidtune.flags import ConfigError, check_bounds, flag_specs
from vidtune.trainer.config import PRECISIONS, TrainConfig
from vidtune.trainer.gpus import SIMULATE_ENV, simulated_gpus
from vidtune.trainer.ray_auth import token_refusal_explained
from vidtune.trainer.ray_start import RayStart, start_local_ray

# Train polls its workers every 2 s by default; each report and the end of fit() wait on a poll,
# so 0.5 s saves ~5 s per short trial (bench/trial_overhead.py). Ray propagates it driver ->
# controller -> workers.
HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
DEFAULT_HEALTH_CHECK_INTERVAL_S = "0.5"
# Train starts a PreemptionWatcher actor (a fresh process, ~1.2 s of CPU) for every run, to see a
# cluster node being drained (spot instances, autoscaler). A Ray this process starts on its own
# machine is never drained, so there it is switched off (bench/search_overhead.py shows the cost).
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"

BUILTIN_WEIGHTS = ("none", "kinetics")
TRAIN_FLAGS = tuple(flag_specs(TrainConfig))

__all__ = ["ConfigError", "PRECISIONS", "validate_config", "check_batch_sizes", "check_writable_folder",
           "init_ray", "build_torch_trainer", "worker_env_vars", "cluster_gpus"]


def worker_env_vars() -> dict[str, str]:
    """Environment every Ray worker process gets from this driver: today only the simulated-GPU
    count of a CPU test run (`vidtune.trainer.gpus`).

    The code itself is not shipped: workers import the installed `vidtune` package of their node
    (on this machine, the driver's own interpreter and site-packages; on a cluster, what
    `cluster.yaml`'s setup installed on every node).
    """
    return {SIMULATE_ENV: os.environ[SIMULATE_ENV]} if simulated_gpus() else {}


AUTH_MODE_ENV = "RAY_AUTH_MODE"   # Ray's token authentication: on unless this says otherwise


def auth_off_note() -> str | None:
    """One line when Ray's token authentication is switched off in this environment (Ray 2.60
    turns it on for a Ray it starts unless RAY_AUTH_MODE says otherwise); vidtune never does it."""
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is None or mode.strip().lower() == "token":
        return None
    return (f"note: Ray's token authentication is off ({AUTH_MODE_ENV}={mode}): anyone who can reach this "
            f"machine's Ray ports can run code as you; unset {AUTH_MODE_ENV} to turn it back on "
            "(docs/troubleshooting.md, \"What a search exposes\")")


def init_ray(address: str | None = None, num_cpus: int | None = None, *,
             ray_start: RayStart | None = None, **kw: Any) -> bool:
    """Start (or connect to) Ray.

    A no-op when Ray is already initialised in this process (tests share one session).
    `address`: None or "local" starts a local Ray (never the machine's last `ray start`; RAY_ADDRESS
    joins one unless it says "local"), "auto" or "ray://host:10001" joins a cluster, whose nodes
    must have vidtune installed (`cluster.yaml`'s setup does it). Extra keyword arguments go to
    `ray.init`; a `runtime_env` given there is merged with `worker_env_vars()` (its own env_vars
    win). A local Ray gets VIDTUNE_SIMULATE_GPUS GPUs when that is set (`vidtune.trainer.gpus`),
    and starts as `ray_start` says (`vidtune.trainer.ray_start`: object store, time limit;
    RayStartError when it cannot).
    Returns True when this call started or connected Ray, False when it was already running.
    """
    os.environ.setdefault(HEALTH_CHECK_ENV, DEFAULT_HEALTH_CHECK_INTERVAL_S)
    import ray  # heavy (seconds): not for the CLIs' --help or a bad flag; after the env var Ray reads

    if ray.is_initialized():
        return False
    note = auth_off_note()
    if note:
        print(note, flush=True)
    local = not joins_cluster(address)      # a local Ray, started here
    if local:
        os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")
        if simulated_gpus():
            kw["num_gpus"] = simulated_gpus()
    runtime_env = dict(kw.pop("runtime_env", None) or {})
    env_vars = {**worker_env_vars(), **(runtime_env.get("env_vars") or {})}
    if env_vars:
        runtime_env["env_vars"] = env_vars
    if local:
        start_local_ray(ray.init, ray_start or RayStart(), num_cpus=num_cpus, runtime_env=runtime_env or None,
                        **kw)
    else:
        with token_refusal_explained(address, ray.exceptions.AuthenticationError):
            ray.init(address=address, num_cpus=num_cpus, runtime_env=runtime_env or None, **kw)
    return True


LOCAL_ADDRESS = "local"     # Ray's own word for "start a Ray of this process's own"


def joins_cluster(address: str | None) -> bool:
    """Whether `init_ray(address)` joins a running Ray (--address, or RAY_ADDRESS in the
    environment) rather than starting one on this machine. "local" (either way) starts one, as
    it does for ray.init; so does neither: a local search never follows the machine's last
    `ray start` (`trainer.ray_start.start_local_ray`)."""
    if address is None:
        address = os.environ.get("RAY_ADDRESS") or None
    return address is not None and address.strip().lower() != LOCAL_ADDRESS


def cluster_gpus() -> float:
    """GPUs the running Ray cluster offers (0.0 on a CPU machine). Ray must be initialised."""
    import ray  # heavy: as in init_ray

    return float(ray.cluster_resources().get("GPU", 0.0))


def validate_config(cfg: TrainConfig) -> None:
    """Check every option that would otherwise fail inside a Ray worker, on the driver, before
    Ray starts: the declared bounds of every field, the dataset path, the model name, the clip
    size against the model, the weights file. Raises `ConfigError` naming the flag (the same
    flag in `trainer.train` and the search) and value at fault and what to do.

    A weights file is loaded onto a CPU model of that name, so a file of another architecture is
    refused here rather than after a cluster has been allocated.
    """
    check_bounds(cfg, TRAIN_FLAGS)
    _check_data(cfg)
    from vidtune.trainer.models import get_spec, has_kinetics_weights  # torch: seconds, so checked last

    try:   # an hf: model's checkpoint is fetched here, once, on the driver (a refusal: one line)
        get_spec(cfg.model)
    except ValueError as e:
        raise ConfigError("--model", str(e)) from None
    if cfg.weights == "kinetics" and not has_kinetics_weights(cfg.model):
        raise ConfigError("--weights", f"model {cfg.model!r} has no Kinetics weights; pass --weights none "
                          "(an hf: model then loads its checkpoint's own) or a state-dict file")
    _check_clip_size(cfg)
    if cfg.weights not in BUILTIN_WEIGHTS:
        _check_weights_file(cfg.model, Path(cfg.weights))


def check_batch_sizes(batch_sizes: Iterable[int], train_videos: int, workers: int, *, flag: str,
                      workers_flag: str) -> None:
    """Each worker of a run needs at least one full batch of training videos per epoch (the
    loader drops a last, partial batch). Raises ConfigError naming `flag` for the sizes that
    cannot get one. The one batch-size check: both CLIs run it on the driver, before any worker
    starts (`trainer.run.build_run` relies on it)."""
    per_worker = train_videos // max(1, workers)
    too_big = sorted(b for b in batch_sizes if b > per_worker)
    if too_big:
        sizes = ",".join(map(str, too_big))
        raise ConfigError(flag, f"batch size {sizes} is more than the {per_worker} training videos each of "
                          f"the {workers} worker(s) gets ({train_videos} in all); lower {flag} or "
                          f"{workers_flag}, or add videos")


def check_num_frames(cfg: TrainConfig, index: VideoIndex, *, flag: str = "--num-frames") -> None:
    """An explicit clip length (`cfg.data.num_frames`) must fit in the shortest usable video of
    `index` (a `datasets.index.VideoIndex`): a longer clip repeats frames of every short video, so
    the model would train on stills. ConfigError naming `flag`."""
    wanted = cfg.data.num_frames
    videos = [*index.train, *index.val]
    if wanted is None or not videos:
        return
    shortest = min(videos, key=lambda v: v.num_frames)
    if wanted > shortest.num_frames:
        raise ConfigError(flag, f"{wanted} frames per clip is more than the shortest usable video has "
                          f"({shortest.path.name}: {shortest.num_frames} frames); pass {flag} "
                          f"{shortest.num_frames} or less, or --min-frames {wanted} to leave the shorter "
                          "videos out")


def check_training_inputs(cfg: TrainConfig, *, batch_sizes: Iterable[int] | None, workers: int,
                          batch_flag: str, workers_flag: str, storage: str | None = None,
                          show: Callable[[VideoIndex], None] | None = None) -> VideoIndex:
    """The one set of checks a training needs before Ray starts, for `vidtune train` and the
    search alike: every option of `cfg` (`validate_config`), the --storage and --cache-dir
    folders, the dataset (indexed here: `datasets.index.build_index`), frames per clip against
    the shortest video, and each batch size (`batch_sizes`; None: decided once the cluster is
    known) against the training videos each of `workers` workers gets. `show` is handed the index
    before the checks that read it, so a refusal follows the data report. Returns the index (the
    workers get it). ConfigError / DataError naming the flag or file at fault."""
    validate_config(cfg)
    if storage:
        check_writable_folder(storage, "--storage")   # a URI (s3://...) is not checked
    if cfg.data.clip_cache and cfg.data.clip_cache_dir is not None:
        check_writable_folder(cfg.data.clip_cache_dir, "--cache-dir")
    index = build_index(cfg.data)
    if show is not None:
        show(index)
    check_num_frames(cfg, index)
    if batch_sizes is not None:
        check_batch_sizes(batch_sizes, len(index.train), workers, flag=batch_flag, workers_flag=workers_flag)
    return index


def check_writable_folder(folder: str | Path, flag: str) -> None:
    """`folder` is (or can be created as) a writable folder; URIs (s3://...) are not checked."""
    if "://" in str(folder):
        return
    path = Path(folder).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError(flag, f"{existing or path} is not a folder; pass a writable folder")
    try:   # a real write: os.access says yes to root on a read-only mount
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(flag, f"{existing} is not writable ({e.strerror}); "
                          "pass a folder you can write to") from None


def _check_data(cfg: TrainConfig) -> None:
    if not cfg.data.root:
        raise ConfigError("--data", "no dataset given; pass the folder of videos (or a CSV manifest)")
    root = Path(cfg.data.root).expanduser()
    if not root.exists():
        raise ConfigError("--data", f"{root} does not exist; pass the folder of videos (or a CSV manifest)")


def _check_clip_size(cfg: TrainConfig) -> None:
    from vidtune.trainer.models import (  # heavy: torch + torchvision, as in validate_config
        check_input_size,
        get_spec,
    )

    spec, d = get_spec(cfg.model), cfg.data
    num_frames, height, width = (d.num_frames or spec.num_frames, d.height or spec.height,
                                 d.width or spec.width)
    try:
        check_input_size(cfg.model, num_frames, height, width)
    except ValueError as e:
        flag = ("--num-frames" if num_frames != spec.num_frames else
                "--height" if height != spec.height else "--width" if width != spec.width else "--model")
        raise ConfigError(flag, str(e)) from None


def _check_weights_file(model_name: str, path: Path) -> None:
    from vidtune.trainer.models import (  # heavy: torch + torchvision, as in validate_config
        WeightsError,
        build_model,
    )

    if not path.is_file():
        raise ConfigError(
            "--weights",
            f"{path} is not a file; pass 'none', 'kinetics' or the path of a saved state dict / "
            "vidtune checkpoint",
        )
    try:
        # Loads the file onto a CPU model of that name: refuses another architecture (only the
        # classification head may differ), a damaged file, or one that is not a state dict.
        build_model(model_name, weights=str(path))
    except WeightsError as e:
        raise ConfigError("--weights", str(e)) from None


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
    callbacks: list | None = None,
    checkpoint_keep: int = 1,
    train_loop: Callable[[dict], None] | None = None,
    device_lease: Any = None,
    index: VideoIndex | None = None,
    score_metric: str = "val_acc",
):
    """The Ray Train (V2) `TorchTrainer` of one training run of `cfg`.

    Checkpoints are ranked by `score_metric` (val_acc or val_f1: a search's objective, the
    metric that picks its best epoch; the best `checkpoint_keep`, at least 2, are kept, plus
    always the latest so a rerun with the same `name` and `storage_path` resumes from it). `storage_path`
    None means Ray's default `~/ray_results`; on a multi-node cluster pass shared storage.
    A run whose worker dies restarts from its last checkpoint up to `cfg.max_failures` times
    (`--max-failures`); out of memory is not a failure (the worker reports `oom=1` and returns).
    A rank left waiting in a collective by another (failed, stuck) fails after
    `cfg.collective_timeout_min` (`--collective-timeout-min`, `TorchConfig(timeout_s=...)`).
    `train_loop`: the per-worker function, `trainer.worker.train_loop_per_worker` by default
    (pass a wrapper of it to, e.g., register extra models in the worker process first).
    `device_lease`: a `trainer.lease.LeaseSettings` (a search's trials): the workers wait for
    their devices before the first epoch and give them back after the last (`trainer.lease`).
    `index`: the `datasets.index.VideoIndex` the driver checked; the workers train on exactly
    those videos instead of indexing the dataset again.
    """
    import ray.train  # heavy: only once a run is built, not for the CLIs' --help or a bad flag

    from vidtune.trainer.lease import LEASE_CONFIG_KEY  # heavy: imports ray
    from vidtune.trainer.process_group import GPU_BACKEND, LeasedTorchConfig  # heavy: Ray Train, torch
    from vidtune.trainer.torch_trainer import VidtuneTorchTrainer  # heavy: as process_group
    from vidtune.trainer.worker import INDEX_CONFIG_KEY, train_loop_per_worker  # heavy: imports ray and torch

    run_config = ray.train.RunConfig(
        name=name,
        storage_path=storage_path,
        callbacks=callbacks,
        # At least two: Ray always keeps the latest on top of the best `num_to_keep` by the score,
        # so with two the run holds at least one checkpoint besides the latest, which a worker
        # falls back to when the latest is damaged (`trainer.worker._read_checkpoint`).
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
        # Also set through ray.init; repeated here for drivers that connected to Ray themselves.
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
    # GPUs: gloo for the worker's own (CPU) collectives, NCCL for DDP's (trainer.process_group.GPU_BACKEND),
    # and no CUDA context before the lease (LeasedTorchConfig). Simulated GPUs (trainer.gpus): the
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
