"""Driver-side launch helpers: start Ray so workers import this project, check a config before
any worker starts, and build the Ray Train `TorchTrainer` of one training run.

Used by `trainer.train` (one run), `tune.search` (one trainer per trial) and the tests.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from datasets.config import CLIP_CACHE_FORMATS
from trainer.config import TrainConfig

REPO_ROOT = Path(__file__).resolve().parents[1]

# Train polls its workers every 2 s by default; each report and the end of fit() wait on a poll,
# so 0.5 s saves ~5 s per short trial (DESIGN.md). Ray propagates it driver -> controller -> workers.
HEALTH_CHECK_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
DEFAULT_HEALTH_CHECK_INTERVAL_S = "0.5"

PRECISIONS = ("auto", "fp32", "fp16", "bf16")
BUILTIN_WEIGHTS = ("none", "kinetics")


class ConfigError(ValueError):
    """A training option cannot be used. `flag` is the CLI flag of the option at fault."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def worker_env_vars() -> dict[str, str]:
    """Environment of every Ray worker process: the repository root first on PYTHONPATH.

    Ray workers start in a temporary folder, so without this `import datasets` would find
    Hugging Face's package (installed too) instead of this project's.
    """
    existing = os.environ.get("PYTHONPATH", "")
    parts = [str(REPO_ROOT)] + [p for p in existing.split(os.pathsep) if p and p != str(REPO_ROOT)]
    return {"PYTHONPATH": os.pathsep.join(parts)}


def init_ray(address: str | None = None, num_cpus: int | None = None, **kw: Any) -> bool:
    """Start (or connect to) Ray with this repository on the workers' PYTHONPATH.

    A no-op when Ray is already initialised in this process (tests share one session).
    `address`: None starts a local Ray, "auto" or "ray://host:10001" joins a cluster (there the
    repository must sit at the same path on every node, as `cluster.yaml` arranges).
    Extra keyword arguments go to `ray.init`; a `runtime_env` given there is merged (its
    env_vars win except PYTHONPATH, which gets the repository root prepended).
    Returns True when this call started or connected Ray, False when it was already running.
    """
    os.environ.setdefault(HEALTH_CHECK_ENV, DEFAULT_HEALTH_CHECK_INTERVAL_S)
    import ray

    if ray.is_initialized():
        return False
    runtime_env = dict(kw.pop("runtime_env", None) or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    ours = worker_env_vars()
    if "PYTHONPATH" in env_vars:
        ours["PYTHONPATH"] = os.pathsep.join([ours["PYTHONPATH"], env_vars["PYTHONPATH"]])
    env_vars.update(ours)
    runtime_env["env_vars"] = env_vars
    ray.init(address=address, num_cpus=num_cpus, runtime_env=runtime_env, **kw)
    return True


def cluster_gpus() -> float:
    """GPUs the running Ray cluster offers (0.0 on a CPU machine). Ray must be initialised."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0))


def validate_config(cfg: TrainConfig) -> None:
    """Check every option that would otherwise fail inside a Ray worker, on the driver, before
    Ray starts. Raises `ConfigError` naming the flag and value at fault and what to do.

    A weights file is loaded onto a CPU model of that name, so a file of another architecture is
    refused here rather than after a cluster has been allocated.
    """
    _check_numbers(cfg)
    if cfg.precision not in PRECISIONS:
        raise ConfigError("--precision", f"unknown precision {cfg.precision!r}; choose one of {', '.join(PRECISIONS)}")
    _check_data(cfg)
    from trainer.models import MODEL_NAMES  # imports torch + torchvision: seconds, so checked last

    if cfg.model not in MODEL_NAMES:
        raise ConfigError("--model", f"unknown model {cfg.model!r}; choose one of {', '.join(MODEL_NAMES)}")
    _check_clip_size(cfg)
    if cfg.weights not in BUILTIN_WEIGHTS:
        _check_weights_file(cfg.model, Path(cfg.weights))


def _check_numbers(cfg: TrainConfig) -> None:
    def need(ok: bool, flag: str, value: Any, rule: str) -> None:
        if not ok:
            raise ConfigError(flag, f"got {value!r}; it must be {rule}")

    need(cfg.batch_size >= 1, "--batch-size", cfg.batch_size, "an integer >= 1")
    need(math.isfinite(cfg.lr) and cfg.lr > 0, "--lr", cfg.lr, "a number > 0 (e.g. 3e-4)")
    need(cfg.epochs >= 1, "--epochs", cfg.epochs, "an integer >= 1")
    need(cfg.grad_accum_steps >= 1, "--grad-accum", cfg.grad_accum_steps, "an integer >= 1")
    need(cfg.weight_decay >= 0, "--weight-decay", cfg.weight_decay, ">= 0")
    need(0 <= cfg.label_smoothing < 1, "--label-smoothing", cfg.label_smoothing, "in [0, 1)")
    need(0 <= cfg.warmup_frac < 1, "--warmup-frac", cfg.warmup_frac, "in [0, 1)")
    need(cfg.clip_grad_norm >= 0, "--clip-grad-norm", cfg.clip_grad_norm, ">= 0 (0 disables clipping)")
    need(cfg.freeze_backbone_epochs >= 0, "--freeze-backbone-epochs", cfg.freeze_backbone_epochs, ">= 0")
    d = cfg.data
    for flag, value in (("--num-frames", d.num_frames), ("--height", d.height), ("--width", d.width)):
        need(value is None or value >= 1, flag, value, "an integer >= 1 (or left out for the model's size)")
    need(d.frame_stride >= 1, "--frame-stride", d.frame_stride, "an integer >= 1")
    need(d.loader_workers >= 0, "--loader-workers", d.loader_workers, "an integer >= 0")
    need(0 < d.val_fraction < 1, "--val-fraction", d.val_fraction, "in (0, 1)")
    need(math.isfinite(d.clip_cache_max_gb) and d.clip_cache_max_gb >= 0, "--cache-max-gb", d.clip_cache_max_gb,
         "a number of GB >= 0 (--no-cache turns the clip cache off)")
    need(d.clip_cache_format in CLIP_CACHE_FORMATS, "--cache-format", d.clip_cache_format,
         f"one of {', '.join(CLIP_CACHE_FORMATS)}")


def _check_data(cfg: TrainConfig) -> None:
    if not cfg.data.root:
        raise ConfigError("--data", "no dataset given; pass the folder of videos (or a CSV manifest)")
    root = Path(cfg.data.root).expanduser()
    if not root.exists():
        raise ConfigError("--data", f"{root} does not exist; pass the folder of videos (or a CSV manifest)")


def _check_clip_size(cfg: TrainConfig) -> None:
    from trainer.models import check_input_size, get_spec

    spec, d = get_spec(cfg.model), cfg.data
    num_frames, height, width = d.num_frames or spec.num_frames, d.height or spec.height, d.width or spec.width
    try:
        check_input_size(cfg.model, num_frames, height, width)
    except ValueError as e:
        raise ConfigError("--num-frames" if num_frames != spec.num_frames else "--size", str(e)) from None


def _check_weights_file(model_name: str, path: Path) -> None:
    from trainer.models import WeightsError, build_model

    if not path.is_file():
        raise ConfigError(
            "--weights",
            f"{path} is not a file; pass 'none', 'kinetics' or the path of a saved state dict / vidtune checkpoint",
        )
    try:
        # Loads the file onto a CPU model of that name: refuses another architecture (only the
        # classification head may differ), a damaged file, or one that is not a state dict.
        build_model(model_name, weights=str(path))
    except WeightsError as e:
        raise ConfigError("--weights", str(e)) from None


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
    train_loop=None,
    device_lease=None,
):
    """The Ray Train (V2) `TorchTrainer` of one training run of `cfg`.

    Checkpoints are ranked by `val_acc` (the best `checkpoint_keep` are kept, plus always the
    latest so a rerun with the same `name` and `storage_path` resumes from it). `storage_path`
    None means Ray's default `~/ray_results`; on a multi-node cluster pass shared storage.
    No retries (`max_failures=0`): a failing trial is reported, not rerun; out of memory is not
    a failure (the worker reports `oom=1` and returns).
    `train_loop`: the per-worker function, `trainer.worker.train_loop_per_worker` by default
    (pass a wrapper of it to, e.g., register extra models in the worker process first).
    `device_lease`: a `trainer.lease.LeaseSettings` (a search's trials): the workers wait for
    their devices before the first epoch and give them back after the last (`trainer.lease`).
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    from trainer.worker import train_loop_per_worker

    if num_workers < 1:
        raise ConfigError("--workers", f"got {num_workers}; it must be an integer >= 1")
    run_config = ray.train.RunConfig(
        name=name,
        storage_path=storage_path,
        callbacks=callbacks,
        checkpoint_config=ray.train.CheckpointConfig(
            num_to_keep=checkpoint_keep,
            checkpoint_score_attribute="val_acc",
            checkpoint_score_order="max",
        ),
        failure_config=ray.train.FailureConfig(max_failures=0),
        # Train's INFO log repeats every report's metrics dict; the CLIs print their own lines.
        logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        # Also set through ray.init; repeated here for drivers that connected to Ray themselves.
        worker_runtime_env={"env_vars": worker_env_vars()},
    )
    scaling = ray.train.ScalingConfig(
        num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources_per_worker
    )
    from trainer.lease import LEASE_CONFIG_KEY

    loop_config = cfg.to_dict()
    if device_lease is not None:
        loop_config[LEASE_CONFIG_KEY] = device_lease.to_dict()
    return TorchTrainer(
        train_loop or train_loop_per_worker,
        train_loop_config=loop_config,
        scaling_config=scaling,
        run_config=run_config,
    )
