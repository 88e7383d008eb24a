"""One fine-tuning run without a search, on Ray Train (one or more workers, GPUs when present).

    python -m trainer.train --data DIR --model tiny --epochs 3 --batch-size 8 --lr 3e-4
    python -m trainer.train --config best_config.json --epochs 10    # retrain a search's best trial

Prints one line per epoch as it ends and, at the end, the best checkpoint (by val_acc), which
`python -m trainer.predict --checkpoint PATH VIDEO...` uses. Rerunning with the same --name and
--storage resumes after the last finished epoch. `--config` reads a search's best_config.json
(its "train_config") or a JSON/TOML/YAML file of TrainConfig fields; flags given override it.
Exit codes: 0 done, 1 training failed, ran out of memory or diverged (its loss became inf or
NaN: lower --lr), 2 bad input (reported before Ray starts).
"""
from __future__ import annotations

import argparse
import math
import queue as stdlib_queue
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from datasets.config import DataConfig
from datasets.flags import ConfigError, FlagSpec, add_flags, build, coerce, join_negative_values, read_options_file
from trainer.config import TrainConfig
from trainer.launch import TRAIN_FLAGS

GROUPS = {"TrainConfig": "model and training", "DataConfig": "data"}


def build_parser() -> argparse.ArgumentParser:
    """Every `TrainConfig` field's flag (the same names as the search's), plus where it runs."""
    p = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n\n")[0])
    add_flags(p, TRAIN_FLAGS, group_of=lambda s: GROUPS[s.owner.__name__])
    g = p.add_argument_group("where it runs")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="a JSON best_config.json written by a search (its train_config), or a JSON/TOML/YAML file "
                   "of TrainConfig fields; flags given on the command line override it")
    g.add_argument("--workers", type=int, default=1, metavar="N",
                   help="Ray Train workers, data-parallel replicas (default 1)")
    g.add_argument("--gpus-per-worker", type=float, default=None, metavar="G",
                   help="GPUs per worker (default: 1 when GPUs are present, else 0)")
    g.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="C",
                   help="CPUs Ray reserves per worker (default 1)")
    g.add_argument("--storage", default=None, metavar="PATH",
                   help="where checkpoints go (default ~/ray_results; shared storage on a cluster)")
    g.add_argument("--name", default=None, help="run name (default vidtune-train-TIMESTAMP); reuse it to resume")
    g.add_argument("--address", default=None, help="Ray cluster address (auto, ray://host:10001); default: local Ray")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    return build_parser().parse_args(join_negative_values(argv, TRAIN_FLAGS))


SEARCH_NAME_KEYS = ("search", "search_name", "experiment")   # best_config.json's key naming its search


@dataclass(frozen=True)
class ConfigFile:
    """A `--config` file read: `values` {dotted path: value} in the fields' types, `keys` {dotted
    path: the key as written in the file}, and `best` the search's best_config.json document
    (trial_id, val_acc, ...) when the file is one."""

    file: Path
    values: dict[str, Any] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)
    best: dict[str, Any] | None = None

    def describe(self) -> str:
        """The line printed at start: the file and, for a search's best_config.json, which trial."""
        if self.best is None:
            return f"config: {self.file}"
        trial = self.best.get("name") or self.best.get("trial_id")      # the row's name: the trial's
        search = next((self.best[k] for k in SEARCH_NAME_KEYS if self.best.get(k)), None)
        what = "the best trial" + (f" {trial}" if trial else "")
        what += f" of search {search}" if search else " of a search"
        acc = self.best.get("val_acc")
        if isinstance(acc, (int, float)) and not isinstance(acc, bool) and math.isfinite(acc):
            what += f", val_acc {acc:.3f}"
        return f"config: {self.file} ({what})"


_SPEC_BY_PATH = {s.path: s for s in TRAIN_FLAGS}
_SPEC_BY_KEY = {k: s for s in TRAIN_FLAGS for k in s.keys}
_TRAIN_FIELDS = {f.name for f in fields(TrainConfig)} - {"data"}
_DATA_FIELDS = {f.name for f in fields(DataConfig)}


def _typed(spec: FlagSpec, value: Any, where: str) -> Any:
    """The value in the field's type, or ConfigError("--config") naming the file and key."""
    if value is None and not spec.optional:
        raise ConfigError("--config", f"{where}: got null; give a value, or leave the key out for the default")
    if spec.kind == "str" and isinstance(value, (bool, list, dict)):
        raise ConfigError("--config", f"{where}: got {value!r}; give a string")
    try:
        return coerce(spec, value, where)
    except ConfigError as e:
        raise ConfigError("--config", str(e)) from None


def load_config_file(path: str) -> ConfigFile:
    """Read `--config`: (a) a search's best_config.json, whose "train_config" (TrainConfig.to_dict())
    is used and the rest (the trial's row) only described; (b) an object of TrainConfig fields in
    to_dict() form, the data fields in a "data" table; (c) keys named like the flags without their
    dashes (`batch-size`, `grad-accum`, `data` = the dataset path, `no-cache`), which may be mixed
    with (b). Unknown keys, keys given twice and values of the wrong type raise ConfigError
    naming the file; the bounds are checked later, with the flags (trainer.launch.validate_config)."""
    file = Path(path).expanduser()
    raw = read_options_file(file, suffixes=(".json", ".toml", ".yaml", ".yml"),
                            instead="a search's best_config.json (download it from the search's MLflow run "
                            "or its experiment folder) or a .json/.toml/.yaml file of options")
    if not isinstance(raw, dict):
        raise ConfigError("--config", f"{file} must hold an object of options (key: value), not "
                          f"{type(raw).__name__}")
    best, prefix = None, ""
    if "train_config" in raw:
        best, prefix = raw, "train_config."
        raw = raw["train_config"]
        if not isinstance(raw, dict):
            raise ConfigError("--config", f"{file}: train_config must be an object of TrainConfig fields, not "
                              f"{type(raw).__name__}; use the best_config.json the search wrote")

    values: dict[str, Any] = {}
    keys: dict[str, str] = {}
    unknown: list[str] = []

    def put(spec: FlagSpec, label: str, value: Any, *, flag_key: bool) -> None:
        where = f"{file}: {label}"
        value = _typed(spec, value, where)
        key = label.rsplit(".", 1)[-1] if flag_key else None
        if flag_key and spec.negated and key in spec.keys[:2]:   # `no-cache = true` is clip_cache false
            value = not value
        if spec.path in values:
            raise ConfigError("--config", f"{file}: {keys[spec.path]} and {label} both set {spec.flag}; keep one")
        values[spec.path], keys[spec.path] = value, label

    for key, value in raw.items():
        key = str(key)
        label = prefix + key
        if key == "data" and isinstance(value, dict):              # to_dict() form: DataConfig's fields
            for k, v in value.items():
                k = str(k)
                if k in _DATA_FIELDS and f"data.{k}" in _SPEC_BY_PATH:
                    put(_SPEC_BY_PATH[f"data.{k}"], f"{label}.{k}", v, flag_key=False)
                else:
                    unknown.append(f"{label}.{k}")
        elif key in _TRAIN_FIELDS and key in _SPEC_BY_PATH:         # to_dict() form: a TrainConfig field
            put(_SPEC_BY_PATH[key], label, value, flag_key=False)
        elif key in _SPEC_BY_KEY:                                    # a flag's name without its dashes
            put(_SPEC_BY_KEY[key], label, value, flag_key=True)
        else:
            unknown.append(label)
    if unknown:
        hint = ("; a search's best_config.json needs its \"train_config\" (written by searches since it was added): "
                "pass the trial's --batch-size and --lr as flags instead"
                if best is None and {"trial_id", "objective"} & set(raw) else "")
        raise ConfigError("--config", f"{file}: unknown option(s) {', '.join(map(repr, unknown))}{hint}; known: "
                          "TrainConfig's fields (the data's in a \"data\" table), as in a best_config.json's "
                          "train_config, or the flags of `python -m trainer.train --help` without their dashes")
    return ConfigFile(file=file, values=values, keys=keys, best=best)


def config_from_args(args: argparse.Namespace, loaded: ConfigFile | None = None) -> TrainConfig:
    """The TrainConfig of the defaults, then the `--config` file (`loaded`, read here when not
    given), then the flags given (the generated flags' dests are the fields' paths; flags not
    given are absent from `args`)."""
    if loaded is None and getattr(args, "config", None):
        loaded = load_config_file(args.config)
    values = dict(loaded.values) if loaded else {}
    values.update({k: v for k, v in vars(args).items() if k in _SPEC_BY_PATH})
    return build(TrainConfig, values)


def _blame_file(e: ConfigError, loaded: ConfigFile | None, args: argparse.Namespace) -> ConfigError:
    """A bound or path error of a value the `--config` file set (not a flag) names the file and key."""
    spec = next((s for s in TRAIN_FLAGS if s.flag == e.flag), None)
    if loaded is None or spec is None or spec.path not in loaded.keys or spec.path in vars(args):
        return e
    message = str(e)[len(e.flag) + 2:]
    return ConfigError(e.flag, f"{message} (set by {loaded.keys[spec.path]} in {loaded.file}: correct it there, "
                       f"or override it with {e.flag})")


def check_inputs(cfg: TrainConfig, args: argparse.Namespace):
    """Everything checkable before Ray starts; returns the dataset index (handed to the workers).
    Raises ConfigError / DataError naming the flag or file at fault."""
    from datasets.index import build_index
    from trainer.launch import check_batch_sizes, check_writable_folder, validate_config

    validate_config(cfg)
    if args.workers < 1:
        raise ConfigError("--workers", f"got {args.workers}; it must be an integer >= 1")
    if not args.cpus_per_worker > 0:
        raise ConfigError("--cpus-per-worker", f"got {args.cpus_per_worker}; it must be > 0")
    if args.gpus_per_worker is not None and not args.gpus_per_worker >= 0:
        raise ConfigError("--gpus-per-worker", f"got {args.gpus_per_worker}; it must be >= 0")
    if args.storage:
        check_writable_folder(args.storage, "--storage")
    if cfg.data.clip_cache and cfg.data.clip_cache_dir:
        check_writable_folder(cfg.data.clip_cache_dir, "--cache-dir")
    index = build_index(cfg.data)
    check_batch_sizes((cfg.batch_size,), len(index.train), args.workers, flag="--batch-size", workers_flag="--workers")
    return index


def format_epoch(m: dict[str, Any], epochs: int) -> str:
    """One human-readable line of a worker report."""
    head = f"epoch {m['epoch']}/{epochs}"
    if m.get("oom"):
        return f"{head}  OUT OF MEMORY at batch size {m['batch_size']} (peak {m['peak_mem_mb']:.0f} MB)"
    if m.get("diverged"):
        return f"{head}  DIVERGED: training loss {m['train_loss']}; stopped, no checkpoint"
    return (f"{head}  train_loss {m['train_loss']:.4f}  val_loss {m['val_loss']:.4f}  "
            f"val_acc {m['val_acc']:.3f}  val_f1 {m['val_f1']:.3f}  val_recall {m['val_recall']:.3f}  "
            f"val_auc {m['val_auc']:.3f}  {m['clips_per_s']:.1f} clips/s  {m['epoch_time_s']:.1f} s  "
            f"data_wait {100 * m['data_wait_frac']:.0f}%  peak_mem {m['peak_mem_mb']:.0f} MB  lr {m['lr']:.2e}"
            + (f"  reader_failures {m['reader_failures']}" if m.get("reader_failures") else ""))


def failure_message(last: dict[str, Any], lr: float) -> str | None:
    """Why a run whose last report is `last` has no result, and what to change; None when it
    trained. `lr`: the run's --lr."""
    if last.get("oom"):
        return (f"out of memory at batch size {last.get('batch_size')}; lower --batch-size "
                "(use --grad-accum to keep the effective batch), or try --precision bf16/fp16")
    if last.get("diverged"):
        return (f"training diverged in epoch {last.get('epoch')}: the training loss became {last.get('train_loss')} "
                f"(inf or NaN weights) at --lr {lr:g}; lower --lr (e.g. {lr / 10:g}), or keep "
                "--clip-grad-norm on and --warmup-frac above 0")
    return None


def _epoch_printer(epochs: int):
    """A Ray Train callback (runs in the Train controller) that sends rank 0's metrics to a
    queue, and a driver thread that prints them as they come, unprefixed by Ray's log tags.
    Its `close()` returns the last metrics reported (None without any): Train's `Result.metrics`
    holds only reports that came with a checkpoint, which out of memory and divergence do not."""
    import ray.train
    from ray.util.queue import Empty, Queue

    q = Queue(actor_options={"num_cpus": 0})

    class EpochQueue(ray.train.UserCallback):
        def __init__(self, queue):
            self.queue = queue

        def after_report(self, run_context, metrics, checkpoint):
            self.queue.put(dict(metrics[0]))

    stop = threading.Event()
    last: list[dict[str, Any]] = []

    def pump():
        while True:
            try:
                metrics = q.get(timeout=0.5)
            except (Empty, stdlib_queue.Empty):
                if stop.is_set():
                    return
                continue
            last[:] = [metrics]
            print(format_epoch(metrics, epochs), flush=True)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()

    def close() -> dict[str, Any] | None:
        stop.set()
        thread.join(timeout=10)
        q.shutdown()
        return last[0] if last else None

    return EpochQueue(q), close


def _resources(args: argparse.Namespace) -> tuple[bool, dict[str, float]]:
    import torch

    from trainer.launch import cluster_gpus

    gpus = args.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if (torch.cuda.is_available() or cluster_gpus() > 0) else 0.0
    resources = {"CPU": float(args.cpus_per_worker)}
    if gpus > 0:
        resources["GPU"] = float(gpus)
    return gpus > 0, resources


def run(cfg: TrainConfig, args: argparse.Namespace, index: Any = None) -> int:
    """Start Ray, fit, print the best checkpoint. Inputs must have been checked."""
    from trainer.launch import build_torch_trainer, init_ray

    init_ray(address=args.address)
    use_gpu, resources = _resources(args)
    name = args.name or time.strftime("vidtune-train-%Y%m%d-%H%M%S")
    callback, close = _epoch_printer(cfg.epochs)
    trainer = build_torch_trainer(cfg, num_workers=args.workers, use_gpu=use_gpu, resources_per_worker=resources,
                                  name=name, storage_path=args.storage, callbacks=[callback], index=index)
    print(f"training {cfg.model} on {args.workers} worker(s), {'GPU' if use_gpu else 'CPU'}, run {name}", flush=True)
    try:
        result = trainer.fit()
    except Exception as e:  # TrainingFailedError wraps the worker's exception
        close()
        print(f"error: training failed: {e}", file=sys.stderr)
        return 1
    last = close() or result.metrics or {}
    problem = failure_message(last, cfg.lr)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    from trainer.checkpointing import first_whole

    # Best first by val_acc (ties: the later epoch); a damaged one is skipped with a line.
    ranked = sorted(result.best_checkpoints or [], key=lambda cm: (_acc(cm[1]), cm[1].get("epoch", 0)), reverse=True)
    if not ranked and result.checkpoint is not None:
        ranked = [(result.checkpoint, last)]
    best, skipped = first_whole([c.path for c, _ in ranked])
    for why in skipped:
        print(f"warning: {why}; not named best", file=sys.stderr)
    if best is None:
        print("error: training reported no " + ("whole checkpoint" if skipped else "checkpoint"), file=sys.stderr)
        return 1
    score = next(m for c, m in ranked if c.path == best)
    print(f"best checkpoint (epoch {score.get('epoch')}, val_acc {score.get('val_acc', math.nan):.3f}): {best}")
    return 0


def _acc(metrics: dict[str, Any]) -> float:
    acc = metrics.get("val_acc", math.nan)
    return acc if isinstance(acc, (int, float)) and math.isfinite(acc) else -math.inf


def main(argv: Sequence[str] | None = None) -> int:
    from datasets.errors import DataError

    args = parse_args(argv)
    try:
        loaded = load_config_file(args.config) if args.config else None
        if loaded:
            print(loaded.describe(), flush=True)
        cfg = config_from_args(args, loaded)
        try:
            index = check_inputs(cfg, args)
        except ConfigError as e:
            raise _blame_file(e, loaded, args) from None
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(index.summary(), flush=True)
    return run(cfg, args, index)


if __name__ == "__main__":
    sys.exit(main())
