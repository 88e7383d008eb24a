"""`python tune/search.py`: search batch size and learning rate for fine-tuning a video
transformer. Ray Tune + Optuna propose trials, each trial is a Ray Train run, MLflow records them.

With no arguments it runs the embedded demo (generated data, the `tiny` model, the CPU).
Bad input fails in seconds, before Ray starts, with exit code 2 and a message naming the flag.
"""
from __future__ import annotations

import sys
from pathlib import Path

# Run by path, sys.path[0] is tune/: replace it by the repository root, so this project's
# `datasets` shadows Hugging Face's and tune/'s modules (report, options, ...) cannot shadow others.
REPO_ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
if sys.path[:1] != [str(REPO_ROOT)]:
    sys.path.insert(0, str(REPO_ROOT))

import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from typing import Any, Sequence  # noqa: E402

from datasets.config import DataConfig  # noqa: E402
from datasets.errors import DataError  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from tune.options import SearchOptions, UsageError, build_parser, parse_options  # noqa: E402

__all__ = ["build_parser", "main"]

DEFAULT_STORAGE = "vidtune-results"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the search; returns the exit code (2 for unusable input, with a one-paragraph message)."""
    from trainer.launch import ConfigError

    try:
        opts = parse_options(argv)
        return run(opts)
    except (UsageError, ConfigError, DataError) as e:
        print(f"vidtune search: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vidtune search: interrupted; every MLflow run was closed (KILLED). Continue with --resume.",
              file=sys.stderr)
        return 130


@dataclass(frozen=True)
class Plan:
    """The resolved search before Ray: options, base training config, where results go."""

    opts: SearchOptions
    base: TrainConfig
    storage: str              # Tune storage root (absolute path or URI)
    name: str                 # experiment name (folder under storage)
    demo: bool
    index: Any = None         # the driver's datasets.index.VideoIndex (None in tests that skip it)

    @property
    def experiment_path(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}"


def run(opts: SearchOptions) -> int:
    plan = prepare(opts)
    if opts.dry_run:
        print(describe(plan))
        print("dry run: everything checked (cluster resources are checked when the search connects); nothing ran.")
        return 0
    return execute(plan)


def prepare(opts: SearchOptions) -> Plan:
    """Every check that needs no Ray: options, data (indexed on the driver), stores, experiment."""
    from trainer.launch import validate_config
    from tune.tracking import check_store_uri

    demo = opts.data is None
    if demo:
        from tune.demo import ensure_demo_data

        root, made = ensure_demo_data()
        print(f"demo: {'generated' if made else 'using'} the synthetic dataset in {root}"
              " (pass --data PATH for your own videos)")
        opts = replace(opts, data=str(root))
    base = base_config(opts)
    validate_config(base)
    check_store_uri(opts.mlflow_uri, "--mlflow-uri")
    if opts.optuna_storage:
        if not opts.optuna_storage.startswith(("sqlite:", "postgresql", "mysql")):
            raise UsageError("--optuna-storage", f"{opts.optuna_storage}: give a database URL such as sqlite:///optuna.db")
        if opts.optuna_storage.startswith("sqlite:"):
            check_store_uri(opts.optuna_storage, "--optuna-storage")
    storage = opts.storage or str(Path(DEFAULT_STORAGE).resolve())
    if "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
    name = experiment_name(opts, storage)
    index = index_data(base.data)
    return Plan(opts=opts, base=base, storage=storage, name=name, demo=demo, index=index)


def base_config(o: SearchOptions) -> TrainConfig:
    data = DataConfig(root=str(Path(o.data).expanduser().resolve()) if o.data else "", layout=o.layout,
                      positive_class=o.positive_class, num_frames=o.num_frames, frame_stride=o.frame_stride,
                      height=o.height, width=o.width, loader_workers=o.loader_workers,
                      clip_cache=o.cache, clip_cache_dir=o.cache_dir, clip_cache_max_gb=o.cache_max_gb,
                      clip_cache_format=o.cache_format)
    return TrainConfig(data=data, model=o.model, weights=o.weights, epochs=o.epochs, precision=o.precision,
                       weight_decay=o.weight_decay, seed=o.seed,
                       batch_size=(o.batch_sizes or (8,))[0], lr=math.sqrt(o.lr_min * o.lr_max))


def experiment_name(o: SearchOptions, storage: str) -> str:
    """--name, or with --resume the latest restorable experiment in storage, else a new name."""
    from ray.tune import Tuner

    if o.resume:
        if o.name:
            path = f"{storage.rstrip('/')}/{o.name}"
            if not Tuner.can_restore(path):
                raise UsageError("--resume", f"no interrupted search to continue at {path}; check --name and --storage")
            return o.name
        if "://" in storage:
            raise UsageError("--resume", "with remote --storage, also pass --name of the search to continue")
        found = sorted((p for p in Path(storage).glob("*") if p.is_dir() and Tuner.can_restore(str(p))),
                       key=lambda p: p.stat().st_mtime)
        if not found:
            raise UsageError("--resume", f"no interrupted search to continue in {storage}; pass --storage (and --name)")
        return found[-1].name
    if o.name:
        if "://" not in storage and (Path(storage) / o.name).exists():
            raise UsageError("--name", f"{Path(storage) / o.name} already exists; continue it with --resume or pick another --name")
        return o.name
    return time.strftime("vidtune-%Y%m%d-%H%M%S")


def index_data(data: DataConfig) -> Any:
    """Probe every video on the driver: fails fast (DataError) with the dropped-file report, and
    warms the index cache the trial workers read. Returns the VideoIndex."""
    from datasets.index import build_index

    index = build_index(data)
    print(index.summary())
    return index


def describe(plan: Plan) -> str:
    from tune.space import early_stopping_enabled

    o = plan.opts
    doc = {
        "experiment": plan.experiment_path, "resume": o.resume, "demo": plan.demo,
        "search": {"batch_sizes": list(o.batch_sizes) if o.batch_sizes else "by device (CPU 4,8; GPU 8,16,32)",
                   "lr": [o.lr_min, o.lr_max],
                   "weight_decay": [o.weight_decay_min, o.weight_decay_max] if o.search_weight_decay else o.weight_decay,
                   "num_samples": o.num_samples, "objective": o.objective, "seed": o.seed,
                   "early_stop": "ASHA" if early_stopping_enabled(o) else "off",
                   "optuna_storage": o.optuna_storage},
        "resources": {"address": o.address or "local", "workers_per_trial": o.workers_per_trial,
                      "cpus_per_worker": o.cpus_per_worker, "gpus_per_worker": o.gpus_per_worker,
                      "gpus_per_trial": o.gpus_per_trial, "max_concurrent_trials": o.max_concurrent_trials},
        "mlflow": {"uri": o.mlflow_uri, "experiment": o.experiment},
        "clip_cache": {"enabled": o.cache, "dir": o.cache_dir or "~/.cache/vidtune/clips",
                        "max_gb": o.cache_max_gb,
                        "format": o.cache_format + (" (jpeg when trials train on GPUs, else raw)"
                                                    if o.cache_format == "auto" else "")},
        "train_config": plan.base.to_dict(),
    }
    return "resolved configuration:\n" + json.dumps(doc, indent=2, default=str)


def execute(plan: Plan) -> int:
    """Start Ray, check the cluster, run (or resume) the search, report."""
    import ray

    from trainer.launch import init_ray
    from tune.runner import run_search

    started = init_ray(address=plan.opts.address)
    try:
        return run_search(plan)
    finally:
        if started:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
