"""The search's options: one frozen dataclass, the CLI that fills it, and the config-file merge.

Precedence, lowest first: the dataclass defaults < the `--smoke-test` preset < the config file
(`--config FILE`, TOML or YAML, same names as the flags) < flags given on the command line.
Checks that need no Ray (numbers, bounds, file paths) live here too; they raise `UsageError`
naming the flag (or config key) at fault, which `tune.search.main` turns into exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Sequence

from datasets.config import CLIP_CACHE_FORMATS

OBJECTIVES = ("val_acc", "val_f1", "pareto")
PRECISIONS = ("auto", "fp32", "fp16", "bf16")
CPU_BATCH_SIZES = (4, 8)           # the tiny model at 64 px: larger batches gain nothing on 2 cores
GPU_BATCH_SIZES = (8, 16, 32)      # mvit_v2_s at 16 x 224 x 224 fits 32 in bf16 on a 40 GB card


class UsageError(ValueError):
    """Unusable search input. `flag` names the option at fault (a flag, or a config-file key)."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True)
class SearchOptions:
    """Everything `python tune/search.py` can be told. None means "decide from the hardware"."""

    # data (see datasets.config.DataConfig)
    data: str | None = None              # dataset folder or CSV manifest; None = the embedded demo data
    layout: str = "auto"
    positive_class: str | None = None
    num_frames: int | None = None        # None = the model's clip length
    height: int | None = None            # None = the model's frame size
    width: int | None = None
    frame_stride: int = 2
    loader_workers: int = 2              # DataLoader processes per training worker
    cache: bool = True                   # decode each video once into the clip cache (datasets.cache)
    cache_dir: str | None = None         # None = ~/.cache/vidtune/clips (node-local)
    cache_max_gb: float = 50.0           # past it, the remaining videos are decoded every read
    cache_format: str = "auto"           # auto (jpeg when trials train on GPUs, else raw) | jpeg | raw
    # training (see trainer.config.TrainConfig)
    model: str = "tiny"
    weights: str = "none"
    epochs: int = 3
    precision: str = "auto"
    weight_decay: float = 0.05           # fixed value when not searched
    # search space
    batch_sizes: tuple[int, ...] | None = None   # None = CPU_BATCH_SIZES or GPU_BATCH_SIZES
    lr_min: float = 1e-4
    lr_max: float = 3e-3
    search_weight_decay: bool = False
    weight_decay_min: float = 1e-4
    weight_decay_max: float = 0.1
    probe_batch_size: bool = False       # cap batch sizes by trainer.batch_probe.find_max_batch_size
    # search
    num_samples: int = 4                 # trials
    objective: str = "val_acc"
    early_stop: bool = True              # ASHA when epochs >= 3 (never with pareto)
    grace_period: int = 1                # epochs every trial gets before ASHA may stop it
    max_concurrent_trials: int | None = None   # None = as many as the resources allow
    seed: int = 0
    optuna_storage: str | None = None    # e.g. sqlite:///optuna.db, for optuna-dashboard
    study_name: str | None = None        # None = the experiment name
    # where it runs
    address: str | None = None           # None = a local Ray; "auto" = the running cluster
    local: bool = False                  # force single-GPU local mode
    workers_per_trial: int = 1
    cpus_per_worker: float = 0.9        # a core less the trial driver's 0.1 (tune/trial.py): N trials fit on N cores
    gpus_per_worker: float | None = None # None = 1 where the cluster has GPUs, else 0
    gpus_per_trial: float | None = None  # 0.5 packs two one-worker trials per GPU
    storage: str | None = None           # Tune/Train storage; None = ./vidtune-results
    name: str | None = None              # experiment name; None = vidtune-<timestamp> (latest one with --resume)
    resume: bool = False
    # tracking
    mlflow_uri: str = "sqlite:///mlruns.db"
    experiment: str = "vidtune"
    # run
    config: str | None = None
    smoke_test: bool = False
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["batch_sizes"] = list(self.batch_sizes) if self.batch_sizes is not None else None
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# The `--smoke-test` preset (Ray's examples style): a first run that finishes in a minute or two.
# Clip size stays the model's: torchvision's MViTs are built for one input size.
SMOKE_TEST: dict[str, Any] = dict(num_samples=2, epochs=1, batch_sizes=(4,), loader_workers=1, early_stop=False)

# The embedded demo's preset (no --data, no --smoke-test): enough epochs, at learning rates that
# suit the `tiny` model, for the demo's trials to show real learning (val_acc well above 0.5)
# rather than four coin flips; about 3-4 minutes on 2 CPU cores. The tiny model's accuracy leaves
# chance only from about epoch 3, so ASHA may stop trials from there on, not on epoch-1 noise.
# Flags and a config file override it.
DEMO: dict[str, Any] = dict(epochs=6, lr_min=2e-4, lr_max=2e-3, grace_period=3)

FIELD_NAMES = tuple(f.name for f in fields(SearchOptions))


def _int_list(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 4,8,16)")


def build_parser() -> argparse.ArgumentParser:
    """The CLI. Every default is SUPPRESSed so `parse_args` returns only the flags given; the
    defaults live in `SearchOptions` (shown in the help text) and the config file fills the rest."""
    p = argparse.ArgumentParser(
        prog="python tune/search.py",
        description="Search batch size and learning rate (Ray Tune + Optuna) for fine-tuning a "
        "video transformer; every trial is a Ray Train run recorded in MLflow. With no arguments "
        "it runs a short demo on generated data on the CPU.",
        argument_default=argparse.SUPPRESS,
    )
    d = SearchOptions()
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help="dataset folder (RWF-2000 or class folders) or CSV manifest; "
                   "default: the embedded demo dataset, generated once into ~/.cache/vidtune")
    g.add_argument("--layout", choices=("auto", "rwf2000", "class_folders", "csv"), help=f"dataset layout (default {d.layout})")
    g.add_argument("--positive-class", metavar="NAME", help="name of the violent class (default: inferred, e.g. Fight)")
    g.add_argument("--num-frames", type=int, metavar="T", help="frames per clip (default: the model's)")
    g.add_argument("--height", type=int, metavar="PX", help="frame height after decoding (default: the model's)")
    g.add_argument("--width", type=int, metavar="PX", help="frame width after decoding (default: the model's)")
    g.add_argument("--frame-stride", type=int, metavar="K", help=f"take every K-th frame (default {d.frame_stride})")
    g.add_argument("--loader-workers", type=int, metavar="N", help=f"DataLoader processes per training worker (default {d.loader_workers})")

    g.add_argument("--cache-dir", metavar="DIR", help="node-local folder of the decode-once clip cache "
                   "(default ~/.cache/vidtune/clips; python -m datasets.cache fills it ahead)")
    g.add_argument("--cache-max-gb", type=float, metavar="GB", help=f"clip cache disk budget; past it the rest "
                   f"is decoded on every read (default {d.cache_max_gb:g})")
    g.add_argument("--cache-format", choices=CLIP_CACHE_FORMATS, help=f"how cached frames are stored: jpeg "
                   f"(~12 KB a 224 px frame, decoded on the GPU), raw uint8 (150 KB, fastest on a CPU), or auto: "
                   f"jpeg when trials train on GPUs, else raw (default {d.cache_format})")
    g.add_argument("--no-cache", dest="cache", action="store_false", help="decode every clip from the video "
                   "files on every read (no clip cache)")

    g = p.add_argument_group("model and training")
    g.add_argument("--model", metavar="NAME", help=f"model: tiny (CPU), mvit_v2_s, mvit_v1_b, swin3d_t/s/b (default {d.model})")
    g.add_argument("--weights", metavar="W", help=f"none, kinetics, or a state-dict file (default {d.weights})")
    g.add_argument("--epochs", type=int, metavar="N", help=f"epochs per trial (default {d.epochs})")
    g.add_argument("--precision", choices=PRECISIONS, help=f"autocast precision; auto = bf16/fp16 on CUDA, fp32 on CPU (default {d.precision})")
    g.add_argument("--weight-decay", type=float, metavar="WD", help=f"AdamW weight decay when it is not searched (default {d.weight_decay})")

    g = p.add_argument_group("search space")
    g.add_argument("--batch-sizes", type=_int_list, metavar="B,B,..", help="batch sizes to try per worker "
                   f"(default {','.join(map(str, CPU_BATCH_SIZES))} on CPU, {','.join(map(str, GPU_BATCH_SIZES))} with GPUs)")
    g.add_argument("--lr-min", type=float, metavar="LR", help=f"lower bound of the log-uniform learning rate (default {d.lr_min})")
    g.add_argument("--lr-max", type=float, metavar="LR", help=f"upper bound of the log-uniform learning rate (default {d.lr_max})")
    g.add_argument("--search-weight-decay", action="store_true", help="also search weight decay (log-uniform)")
    g.add_argument("--weight-decay-min", type=float, metavar="WD", help=f"lower weight-decay bound (default {d.weight_decay_min})")
    g.add_argument("--weight-decay-max", type=float, metavar="WD", help=f"upper weight-decay bound (default {d.weight_decay_max})")
    g.add_argument("--probe-batch-size", action="store_true", help="drop batch sizes above the largest that fits "
                   "in GPU memory (measured once on a GPU before the search)")

    g = p.add_argument_group("search")
    g.add_argument("--num-samples", type=int, metavar="N", help=f"number of trials (default {d.num_samples})")
    g.add_argument("--objective", choices=OBJECTIVES, help="what to maximise: val_acc, val_f1, or pareto "
                   f"(accuracy and clips/s together, reports the Pareto front) (default {d.objective})")
    g.add_argument("--no-early-stop", dest="early_stop", action="store_false", help="never stop trials early "
                   "(ASHA is on by default when --epochs >= 3, off with pareto)")
    g.add_argument("--grace-period", type=int, metavar="E", help=f"epochs each trial runs before ASHA may stop it (default {d.grace_period})")
    g.add_argument("--max-concurrent-trials", type=int, metavar="N", help="trials at once (default: 2 per GPU, one training and one starting behind it; "
                   "1 per CPU-only machine; within what the resources allow)")
    g.add_argument("--seed", type=int, metavar="N", help=f"seed of the Optuna TPE sampler and of training (default {d.seed})")
    g.add_argument("--optuna-storage", metavar="URL", help="store the Optuna study (e.g. sqlite:///optuna.db) to open it with optuna-dashboard")
    g.add_argument("--study-name", metavar="NAME", help="Optuna study name (default: the experiment name)")

    g = p.add_argument_group("where it runs")
    g.add_argument("--address", metavar="ADDR", help="Ray cluster to join: auto or ray://host:10001 (default: start a local Ray)")
    g.add_argument("--local", action="store_true", help="single-machine mode: one trial at a time owns the GPU (auto with one GPU)")
    g.add_argument("--workers-per-trial", type=int, metavar="N", help=f"Ray Train workers per trial (default {d.workers_per_trial})")
    g.add_argument("--cpus-per-worker", type=float, metavar="C", help=f"CPUs reserved per training worker (default {d.cpus_per_worker}: a core less the "
                   "trial driver's 0.1, so two one-worker trials fit on 2 cores; torch uses at least 1 thread)")
    g.add_argument("--gpus-per-worker", type=float, metavar="G", help="GPUs per training worker (default 1 if the cluster has GPUs, else 0)")
    g.add_argument("--gpus-per-trial", type=float, metavar="G", help="GPUs per trial, split over its workers; 0.5 packs two trials per GPU")
    g.add_argument("--storage", metavar="PATH", help="results and checkpoints: a local folder, NFS or s3:// (shared on a cluster) (default ./vidtune-results)")
    g.add_argument("--name", metavar="NAME", help="experiment name (default vidtune-<date-time>; with --resume, the latest in --storage)")
    g.add_argument("--resume", action="store_true", help="continue an interrupted search (--name, or the latest one in --storage)")

    g = p.add_argument_group("tracking")
    g.add_argument("--mlflow-uri", metavar="URI", help=f"MLflow tracking URI: sqlite:///FILE or http(s)://server (default {d.mlflow_uri} in the working folder)")
    g.add_argument("--experiment", metavar="NAME", help=f"MLflow experiment name (default {d.experiment})")

    g = p.add_argument_group("run")
    g.add_argument("--config", metavar="FILE", help="TOML or YAML file of these options (keys as the flags, e.g. lr-min or lr_min); flags override it")
    g.add_argument("--smoke-test", action="store_true", help="shrink everything for a first run: 2 trials, 1 epoch, batch size 4, one loader process")
    g.add_argument("--dry-run", action="store_true", help="validate everything, print the resolved configuration, run nothing")
    return p


def load_config_file(path: str) -> dict[str, Any]:
    """Read a TOML (.toml) or YAML (.yaml/.yml) options file into {field_name: value}.

    Keys may be written as flags (`lr-min`) or field names (`lr_min`); a `[search]` table in TOML
    may hold them too. Unknown keys raise UsageError naming the key and the file.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError("--config", f"{file} is not a file; pass a .toml or .yaml options file")
    text = file.read_text(encoding="utf-8")
    try:
        if file.suffix == ".toml":
            import tomllib

            raw = tomllib.loads(text)
        elif file.suffix in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text) or {}
        else:
            raise UsageError("--config", f"{file}: unknown file type {file.suffix!r}; use .toml, .yaml or .yml")
    except UsageError:
        raise
    except Exception as e:  # tomllib.TOMLDecodeError, yaml.YAMLError
        raise UsageError("--config", f"{file} cannot be parsed: {e}") from None
    if not isinstance(raw, dict):
        raise UsageError("--config", f"{file} must hold a table of options (key = value), not {type(raw).__name__}")
    if isinstance(raw.get("search"), dict) and len(raw) == 1:
        raw = raw["search"]
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name in ("config",) or name not in FIELD_NAMES:
            raise UsageError(f"{key} (in {file})", f"unknown option {key!r} in {file}; known options are the "
                             "flags of `python tune/search.py --help` without the leading dashes")
        out[name] = _coerce(name, value, f"{key} (in {file})")
    return out


def _coerce(name: str, value: Any, where: str) -> Any:
    """A config-file value in the field's type (TOML/YAML give ints for floats, lists for tuples)."""
    default = getattr(SearchOptions(), name)
    if name == "batch_sizes":
        if isinstance(value, str):
            try:
                return _int_list(value)
            except argparse.ArgumentTypeError as e:
                raise UsageError(where, str(e)) from None
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
        raise UsageError(where, f"got {value!r}; give a list of integers such as [4, 8, 16]")
    if value is None:
        return None
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise UsageError(where, f"got {value!r}; give true or false")
    if isinstance(default, float) or name in ("gpus_per_worker", "gpus_per_trial"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise UsageError(where, f"got {value!r}; give a number")
    if isinstance(default, int) or name in ("num_frames", "height", "width", "max_concurrent_trials"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UsageError(where, f"got {value!r}; give an integer")
    return str(value)


def parse_options(argv: Sequence[str] | None) -> SearchOptions:
    """Flags + config file + preset -> validated SearchOptions (UsageError on bad input)."""
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    merged: dict[str, Any] = {}
    if given.get("smoke_test"):
        merged.update(SMOKE_TEST)
    if given.get("config"):
        merged.update(load_config_file(given["config"]))
        if merged.get("smoke_test") and not given.get("smoke_test"):
            merged = {**SMOKE_TEST, **merged}
    merged.update(given)
    if merged.get("data") is None and not merged.get("smoke_test"):
        merged = {**DEMO, **merged}
    opts = SearchOptions(**merged)
    validate(opts)
    return opts


def validate(o: SearchOptions) -> None:
    """Checks that need neither Ray nor the dataset. Raises UsageError naming the flag."""
    def need(ok: bool, flag: str, value: Any, rule: str) -> None:
        if not ok:
            raise UsageError(flag, f"got {value!r}; it must be {rule}")

    if o.batch_sizes is not None:
        need(len(o.batch_sizes) > 0, "--batch-sizes", ",".join(map(str, o.batch_sizes)),
             "a non-empty comma-separated list of batch sizes, e.g. 4,8,16")
        need(all(b >= 1 for b in o.batch_sizes), "--batch-sizes", ",".join(map(str, o.batch_sizes)),
             "positive integers, e.g. 4,8,16")
    for flag, v in (("--lr-min", o.lr_min), ("--lr-max", o.lr_max)):
        need(math.isfinite(v) and v > 0, flag, v, "a number > 0 (e.g. 1e-4)")
    if o.lr_min > o.lr_max:
        raise UsageError("--lr-min/--lr-max", f"the bounds are inverted: --lr-min {o.lr_min:g} is above "
                         f"--lr-max {o.lr_max:g}; pass the smaller value as --lr-min")
    if o.search_weight_decay:
        for flag, v in (("--weight-decay-min", o.weight_decay_min), ("--weight-decay-max", o.weight_decay_max)):
            need(math.isfinite(v) and v > 0, flag, v, "a number > 0 (the search is log-uniform)")
        if o.weight_decay_min > o.weight_decay_max:
            raise UsageError("--weight-decay-min/--weight-decay-max", f"the bounds are inverted: "
                             f"{o.weight_decay_min:g} > {o.weight_decay_max:g}; pass the smaller value as the minimum")
    need(o.num_samples >= 1, "--num-samples", o.num_samples, "an integer >= 1")
    need(o.epochs >= 1, "--epochs", o.epochs, "an integer >= 1")
    need(o.grace_period >= 1, "--grace-period", o.grace_period, "an integer >= 1")
    need(o.workers_per_trial >= 1, "--workers-per-trial", o.workers_per_trial, "an integer >= 1")
    need(o.cpus_per_worker > 0, "--cpus-per-worker", o.cpus_per_worker, "a number > 0")
    need(o.objective in OBJECTIVES, "--objective", o.objective, f"one of {', '.join(OBJECTIVES)}")
    need(o.precision in PRECISIONS, "--precision", o.precision, f"one of {', '.join(PRECISIONS)}")
    for flag, v in (("--gpus-per-worker", o.gpus_per_worker), ("--gpus-per-trial", o.gpus_per_trial)):
        need(v is None or (math.isfinite(v) and v >= 0), flag, v, "a number >= 0")
    if o.gpus_per_worker is not None and o.gpus_per_trial is not None and \
            not math.isclose(o.gpus_per_worker * o.workers_per_trial, o.gpus_per_trial):
        raise UsageError("--gpus-per-trial", f"{o.gpus_per_trial:g} disagrees with --gpus-per-worker "
                         f"{o.gpus_per_worker:g} x --workers-per-trial {o.workers_per_trial}; give only one of the two")
    need(o.max_concurrent_trials is None or o.max_concurrent_trials >= 1, "--max-concurrent-trials",
         o.max_concurrent_trials, "an integer >= 1")
    need(math.isfinite(o.cache_max_gb) and o.cache_max_gb >= 0, "--cache-max-gb", o.cache_max_gb,
         "a number of GB >= 0 (0 caches nothing; --no-cache turns the cache off)")
    need(o.cache_format in CLIP_CACHE_FORMATS, "--cache-format", o.cache_format, f"one of {', '.join(CLIP_CACHE_FORMATS)}")
    if o.cache and o.cache_dir is not None:
        _check_cache_dir(Path(o.cache_dir).expanduser())
    if o.data is not None and not Path(o.data).expanduser().exists():
        raise UsageError("--data", f"{o.data} does not exist; pass the folder of videos (or a CSV manifest), "
                         "or leave --data out to run the demo")


def _check_cache_dir(folder: Path) -> None:
    """The clip cache folder is usable: it is (or can be made) a writable folder."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise UsageError("--cache-dir", f"{existing or folder} is not a folder; pass a writable folder")
    if not os.access(existing, os.W_OK):
        raise UsageError("--cache-dir", f"{existing} is not writable; pass a writable folder or --no-cache")


def with_defaults_for_hardware(o: SearchOptions, *, cluster_gpus: float) -> SearchOptions:
    """Fill the hardware-dependent options (batch sizes, GPUs per worker) from what Ray offers."""
    changes: dict[str, Any] = {}
    has_gpu = cluster_gpus > 0
    if o.batch_sizes is None:
        changes["batch_sizes"] = GPU_BATCH_SIZES if has_gpu else CPU_BATCH_SIZES
    if o.gpus_per_worker is None:
        if o.gpus_per_trial is not None:
            changes["gpus_per_worker"] = o.gpus_per_trial / o.workers_per_trial
        else:
            changes["gpus_per_worker"] = 1.0 if has_gpu else 0.0
    return replace(o, **changes)


def gpus_per_trial(o: SearchOptions) -> float:
    """GPUs one trial holds (its workers together)."""
    if o.gpus_per_trial is not None:
        return o.gpus_per_trial
    return (o.gpus_per_worker or 0.0) * o.workers_per_trial
