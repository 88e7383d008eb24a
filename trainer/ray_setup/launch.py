"""Driver-side launch helpers: check a config before any worker starts, and start or join Ray.

The light half of launching: nothing here imports Ray or torch at import time, so the CLIs
refuse a bad flag in well under a second. The checks that need the model registry
(`trainer.training.model_checks`) and Ray itself (`init_ray`) are imported when they run; the heavy
half, the Ray Train run, is `trainer.cluster.build_trainer`. Used by `trainer.commands.train`, the search's
`tune.preflight` and `tune.runner`, and the tests.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from vidtune.datasets.index import VideoIndex, build_index
from vidtune.flags import ConfigError, check_bounds, flag_specs
from vidtune.trainer.models.own_models import modules_to_ship
from vidtune.trainer.ray_setup.fixed_ports import taken_fixed_ports, taken_line
from vidtune.trainer.ray_setup.ray_auth import token_refusal_explained
from vidtune.trainer.ray_setup.ray_start import RayStart, start_local_ray
from vidtune.trainer.training.config import PRECISIONS, TrainConfig
from vidtune.trainer.training.gpus import SIMULATE_ENV, simulated_gpus

# Train polls its workers every 2 s by default; each report and the end of fit() wait on polls:
# fit() returns about 4 polls after the training function ends (bench/trial_overhead.py: 2.06 s at
# 0.5 s, 1.04 s at 0.25, 1.03 s at 0.2). Polling that often costs the controller ~2.5% of a core.
# Ray propagates it driver -> controller -> workers.
HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
DEFAULT_HEALTH_CHECK_INTERVAL_S = "0.25"
# Train starts a PreemptionWatcher actor (a fresh process, ~1.2 s of CPU) for every run, to see a
# cluster node being drained (spot instances, autoscaler). A Ray this process starts on its own
# machine is never drained, so there it is switched off (bench/search_overhead.py shows the cost).
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"

TRAIN_FLAGS = tuple(flag_specs(TrainConfig))

__all__ = ["ConfigError", "PRECISIONS", "validate_config", "check_batch_sizes", "check_writable_folder",
           "check_output_folders", "init_ray", "worker_env_vars", "worker_runtime_env"]


# Where the driver fetched an hf: model's checkpoint (trainer.models.hf_models), and whether the hub may be
# asked at all: every worker reads the same cache, offline when the driver is (never the token:
# the driver downloads, workers only read).
HF_CACHE_ENV = ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE")
HUB_CACHE_ENV = "HF_HUB_CACHE"   # what --weights-cache sets: the hub cache alone (HF_HOME keeps the token)


def worker_env_vars() -> dict[str, str]:
    """Environment every Ray worker process gets from this driver: the simulated-GPU count of a
    CPU test run (`vidtune.trainer.training.gpus`) and the Hugging Face cache settings (`HF_CACHE_ENV`).

    The code itself is not shipped: workers import the installed `vidtune` package of their node
    (on this machine, the driver's own interpreter and site-packages; on a cluster, what
    `cluster.yaml`'s setup installed on every node).
    """
    env = {name: os.environ[name] for name in HF_CACHE_ENV if name in os.environ}
    return {**env, SIMULATE_ENV: os.environ[SIMULATE_ENV]} if simulated_gpus() else env


def worker_runtime_env() -> dict[str, Any]:
    """Ray's `runtime_env` of this driver's job (`ray.init`): `worker_env_vars()`, and the code of
    the own models (`--model module:function`) this process loaded that a worker could not import
    otherwise (`trainer.models.own_models.modules_to_ship`: a file, or a package's folder), as
    `py_modules`, which Ray uploads once and puts on each worker's sys.path. Local py_modules are
    taken at the job level only (an actor's or Train's `worker_runtime_env` refuses a path), and
    every task, actor and Train worker of the job inherits them."""
    env: dict[str, Any] = {"env_vars": worker_env_vars()}
    if shipped := modules_to_ship():
        env["py_modules"] = shipped
    return env


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
    `ray.init`; a `runtime_env` given there is merged with `worker_runtime_env()` (its own env_vars
    win), so the own model checked on the driver reaches every worker, of a Ray started or joined.
    A local Ray gets VIDTUNE_SIMULATE_GPUS GPUs when that is set (`vidtune.trainer.training.gpus`),
    and starts as `ray_start` says (`vidtune.trainer.ray_setup.ray_start`: object store, time limit;
    RayStartError when it cannot); one line says which of Ray's fixed ports another process held,
    so that it runs without them (`vidtune.trainer.ray_setup.fixed_ports`).
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
    ours = worker_runtime_env()
    env_vars = {**ours["env_vars"], **(runtime_env.get("env_vars") or {})}
    if env_vars:
        runtime_env["env_vars"] = env_vars
    py_modules = list(dict.fromkeys([*(runtime_env.get("py_modules") or []), *ours.get("py_modules", [])]))
    if py_modules:
        runtime_env["py_modules"] = py_modules
    if local:
        # before Ray starts: what it will not bind (trainer.ray_setup.fixed_ports)
        taken = taken_fixed_ports(dashboard=kw.get("include_dashboard") is not False)
        start_local_ray(ray.init, ray_start or RayStart(), num_cpus=num_cpus, runtime_env=runtime_env or None,
                        **kw)
        if line := taken_line(taken):
            print(line, flush=True)
    else:
        with token_refusal_explained(address, ray.exceptions.AuthenticationError):
            ray.init(address=address, num_cpus=num_cpus, runtime_env=runtime_env or None, **kw)
    return True


LOCAL_ADDRESS = "local"     # Ray's own word for "start a Ray of this process's own"


def joins_cluster(address: str | None) -> bool:
    """Whether `init_ray(address)` joins a running Ray (--address, or RAY_ADDRESS in the
    environment) rather than starting one on this machine. "local" (either way) starts one, as
    it does for ray.init; so does neither: a local search never follows the machine's last
    `ray start` (`trainer.ray_setup.ray_start.start_local_ray`)."""
    if address is None:
        address = os.environ.get("RAY_ADDRESS") or None
    return address is not None and address.strip().lower() != LOCAL_ADDRESS


def validate_config(cfg: TrainConfig) -> None:
    """Check every option that would otherwise fail inside a Ray worker, on the driver, before
    Ray starts: the declared bounds of every field, the dataset path, the model name, the clip
    size against the model, the weights file. Raises `ConfigError` naming the flag (the same
    flag in `trainer.commands.train` and the search) and value at fault and what to do.

    A weights file is loaded onto a CPU model of that name, so a file of another architecture is
    refused here rather than after a cluster has been allocated.
    """
    check_bounds(cfg, TRAIN_FLAGS)
    _check_data(cfg)
    use_weights_cache(cfg)
    from vidtune.trainer.training.model_checks import check_model  # heavy (torch: seconds), so checked last

    check_model(cfg)


def use_weights_cache(cfg: TrainConfig) -> None:
    """`--weights-cache`: a writable folder (ConfigError naming the flag otherwise), made this
    process's Hugging Face hub cache (`HUB_CACHE_ENV`) before an hf: model is fetched into it;
    every Ray worker then inherits it (`worker_env_vars`), so init Ray after this."""
    if cfg.weights_cache is None:
        return
    if "://" in cfg.weights_cache:
        raise ConfigError("--weights-cache", f"{cfg.weights_cache} is a URI; the Hugging Face cache is a "
                          "folder: pass a path every node sees (a shared file system)")
    check_writable_folder(cfg.weights_cache, "--weights-cache")
    os.environ[HUB_CACHE_ENV] = str(Path(cfg.weights_cache).expanduser().resolve())


def check_batch_sizes(batch_sizes: Iterable[int], train_videos: int, workers: int, *, flag: str,
                      workers_flag: str) -> None:
    """Each worker of a run needs at least one full batch of training videos per epoch (the
    loader drops a last, partial batch). Raises ConfigError naming `flag` for the sizes that
    cannot get one. The one batch-size check: both CLIs run it on the driver, before any worker
    starts (`trainer.training.run.build_run` relies on it)."""
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
    check_output_folders(cfg, storage)
    validate_config(cfg)
    index = build_index(cfg.data)
    if show is not None:
        show(index)
    check_num_frames(cfg, index)
    if batch_sizes is not None:
        check_batch_sizes(batch_sizes, len(index.train), workers, flag=batch_flag, workers_flag=workers_flag)
    return index


def check_output_folders(cfg: TrainConfig, storage: str | None) -> None:
    """The folders a training writes: `storage` (--storage) and, with the clip cache on,
    --cache-dir, each writable or creatable (URIs such as s3://... are not checked). Cheap: run
    before anything slow (the model check, indexing, generating the demo's videos), so that a
    bad folder is refused in a second."""
    if storage:
        check_writable_folder(storage, "--storage")
    if cfg.data.clip_cache and cfg.data.clip_cache_dir is not None:
        check_writable_folder(cfg.data.clip_cache_dir, "--cache-dir")


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
