"""One fine-tuning run without a search, on Ray Train (one or more workers, GPUs when present).

    vidtune train --data DIR --model tiny --epochs 3 --batch-size 8 --lr 3e-4
    vidtune train --config best_config.json --epochs 10    # retrain a search's best trial

Prints one line per epoch as it ends and, at the end, the best checkpoint (by val_acc), which
`vidtune predict --checkpoint PATH VIDEO...` uses. Rerunning with the same --name and
--storage resumes after the last finished epoch. `--config` reads a search's best_config.json
(its "train_config") or a TOML/YAML file of options, keys as the flags; flags given override it.
Exit codes: 0 done, 1 training failed, ran out of memory or diverged (its loss became inf or
NaN: lower --lr), 2 bad input (reported before Ray starts; workers a cluster given by --address
cannot hold, once connected).
"""
from __future__ import annotations

import argparse
import math
import queue as stdlib_queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vidtune.config_file import CONFIG_SUFFIXES, ConfigFile, read_config_file
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import VideoIndex
from vidtune.errors import DataError
from vidtune.flags import (
    ConfigError,
    FlagSpec,
    add_flags,
    build,
    check_bounds,
    flag_of,
    flag_specs,
    join_negative_values,
    option,
)
from vidtune.trainer.capacity import (
    AUTOSCALER_CONFIG,
    ClusterCapacity,
    WorkerRequest,
    check_fits,
    check_gpus_per_worker,
    local_capacity,
    read_capacity,
)
from vidtune.trainer.config import TrainConfig
from vidtune.trainer.launch import (
    TRAIN_FLAGS,
    build_torch_trainer,
    check_training_inputs,
    init_ray,
    joins_cluster,
)
from vidtune.trainer.ray_start import RayStart, RayStartError, import_failure_message

PROG = "vidtune train"       # the command as the user typed it: its usage, errors and warnings
GROUPS = {TrainConfig: "model and training", DataConfig: "data"}


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
ALL_FLAGS = TRAIN_FLAGS + RUN_FLAGS

# The tables a config file may hold: a search's best_config.json keeps the trial's TrainConfig
# (to_dict() field names, the data's in a nested "data" table) in "train_config", the rest of it
# being the trial's row, which is described at start, not read.
DOCUMENT_TABLE = "train_config"
KNOWN_KEYS = ("known: the flags of `vidtune train --help` without their dashes (batch-size or "
              "batch_size, no-cache), or TrainConfig's fields as a search's best_config.json writes them in "
              "its train_config (the data's in a \"data\" table)")
BEST_CONFIG_HINT = ("a search's best_config.json needs its \"train_config\" (written by searches since it "
                    "was added): pass the trial's --batch-size and --lr as flags instead")
SEARCH_NAME_KEYS = ("search", "search_name", "experiment")   # best_config.json's key naming its search


def build_parser() -> argparse.ArgumentParser:
    """Every `TrainConfig` field's flag (the same names as the search's), plus `RunOptions`'. Flags
    not given are left out of the parsed namespace, so the config file can set them."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_flags(p, TRAIN_FLAGS, group_of=lambda s: GROUPS[s.owner])
    add_flags(p, RUN_FLAGS, group_of=lambda s: "where it runs")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    return build_parser().parse_args(join_negative_values(argv, ALL_FLAGS))


def load_config_file(path: str) -> ConfigFile:
    """Read `--config` (`vidtune.config_file.read_config_file`): a search's best_config.json, whose
    "train_config" is read and the rest (the trial's row) kept as `about`; or a JSON/TOML/YAML
    file of options, keys as the flags (`batch-size`, `data` = the dataset path, `no-cache`) or
    as TrainConfig's fields (`grad_accum_steps`, a `data` table of DataConfig's). ConfigError
    naming the file and key; the bounds are checked later, with the flags (`check_inputs`)."""
    return read_config_file(
        path, [s for s in ALL_FLAGS if s.path != "config"], known=KNOWN_KEYS,
        flag=flag_of(RUN_FLAGS, "config"),
        document=DOCUMENT_TABLE, suffixes=(".json", *CONFIG_SUFFIXES),
        instead="a search's best_config.json (download it from the search's MLflow run or its experiment "
        "folder) or a .json/.toml/.yaml file of options",
        hints={"trial_id": BEST_CONFIG_HINT, "objective": BEST_CONFIG_HINT})


def describe(loaded: ConfigFile) -> str:
    """The line printed at start: the file and, for a search's best_config.json, which trial."""
    best = loaded.about
    if best is None:
        return f"config: {loaded.file}"
    trial = best.get("name") or best.get("trial_id")      # the row's name: the trial's
    search = next((best[k] for k in SEARCH_NAME_KEYS if best.get(k)), None)
    what = "the best trial" + (f" {trial}" if trial else "")
    what += f" of search {search}" if search else " of a search"
    acc = best.get("val_acc")
    if isinstance(acc, (int, float)) and not isinstance(acc, bool) and math.isfinite(acc):
        what += f", val_acc {acc:.3f}"
    return f"config: {loaded.file} ({what})"


def _merged(specs: Sequence[FlagSpec], args: argparse.Namespace, loaded: ConfigFile | None) -> dict[str, Any]:
    """{path: value} of `specs`: the `--config` file's, then the flags given (the flags' dests are
    the fields' paths; flags not given are absent from `args`)."""
    paths = {s.path for s in specs}
    values = {k: v for k, v in loaded.values.items() if k in paths} if loaded else {}
    values.update({k: v for k, v in vars(args).items() if k in paths})
    return values


def config_from_args(args: argparse.Namespace, loaded: ConfigFile | None = None) -> TrainConfig:
    """The TrainConfig of the defaults, then the `--config` file (`loaded`, read here when not
    given), then the flags given."""
    if loaded is None and getattr(args, "config", None):
        loaded = load_config_file(args.config)
    return build(TrainConfig, _merged(TRAIN_FLAGS, args, loaded))


def run_options(args: argparse.Namespace, loaded: ConfigFile | None = None) -> RunOptions:
    """The RunOptions of the defaults, then the `--config` file, then the flags given."""
    return build(RunOptions, _merged(RUN_FLAGS, args, loaded))


def check_inputs(cfg: TrainConfig, where: RunOptions) -> VideoIndex:
    """Everything checkable before Ray starts; returns the dataset index (handed to the workers).
    Raises ConfigError / DataError naming the flag or file at fault."""
    check_bounds(where, RUN_FLAGS)   # first: validate_config may load torch to read --weights
    check_gpus_per_worker(where.gpus_per_worker, where.workers, flag="--gpus-per-worker",
                          workers_flag="--workers", whole="--gpus-per-worker 1")
    index = check_training_inputs(cfg, batch_sizes=(cfg.batch_size,), workers=where.workers,
                                  batch_flag="--batch-size", workers_flag="--workers", storage=where.storage,
                                  show=lambda index: print(index.summary(), flush=True))
    if not joins_cluster(where.address):   # the machine a local Ray will have, read before it starts
        check_capacity(where, local_capacity(), place="this machine",
                       more="pass --address of a Ray cluster that has more")
    return index


def check_capacity(where: RunOptions, capacity: ClusterCapacity, *, place: str, more: str) -> WorkerRequest:
    """The run's workers fit on `capacity` (`trainer.capacity.check_fits`, the search's rule),
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
            f"data_wait {100 * m['data_wait_frac']:.0f}%  peak_mem {m['peak_mem_mb']:.0f} MB  "
            f"lr {m['lr']:.2e}"
            + (f"  reader_failures {m['reader_failures']}" if m.get("reader_failures") else ""))


def failure_message(last: dict[str, Any], lr: float) -> str | None:
    """Why a run whose last report is `last` has no result, and what to change; None when it
    trained. `lr`: the run's --lr."""
    if last.get("oom"):
        return (f"out of memory at batch size {last.get('batch_size')}; lower --batch-size "
                "(use --grad-accum to keep the effective batch), or try --precision bf16/fp16")
    if last.get("diverged"):
        return (f"training diverged in epoch {last.get('epoch')}: the training loss became "
                f"{last.get('train_loss')} (inf or NaN weights) at --lr {lr:g}; lower --lr (e.g. "
                f"{lr / 10:g}), or keep --clip-grad-norm on and --warmup-frac above 0")
    return None


def _epoch_printer(epochs: int):
    """A Ray Train callback (runs in the Train controller) that sends rank 0's metrics to a
    queue, and a driver thread that prints them as they come, unprefixed by Ray's log tags.
    Its `close()` returns the last metrics reported (None without any): Train's `Result.metrics`
    holds only reports that came with a checkpoint, which out of memory and divergence do not."""
    import ray.train  # heavy: not before the flags and the data are checked
    from ray.util.queue import Empty, Queue  # heavy: Ray, as above

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


def run(cfg: TrainConfig, where: RunOptions, index: VideoIndex | None = None) -> int:
    """Start Ray, fit, print the best checkpoint. Inputs must have been checked."""
    init_ray(address=where.address, ray_start=where.ray_start)
    # Again on what Ray has, on a cluster the nodes its autoscaler may start (the config `ray up`
    # leaves on the head): Train would wait without end for workers that cannot be placed.
    capacity = read_capacity(AUTOSCALER_CONFIG if joins_cluster(where.address) else None)
    request = check_capacity(where, capacity, place="the Ray cluster", more="add GPU nodes")
    use_gpu = request.gpus_per_worker > 0
    resources = {"CPU": float(request.cpus_per_worker)}
    if use_gpu:
        resources["GPU"] = float(request.gpus_per_worker)
    name = where.name or time.strftime("vidtune-train-%Y%m%d-%H%M%S")
    callback, close = _epoch_printer(cfg.epochs)
    trainer = build_torch_trainer(cfg, num_workers=where.workers, use_gpu=use_gpu,
                                  resources_per_worker=resources, name=name, storage_path=where.storage,
                                  callbacks=[callback], index=index)
    print(f"training {cfg.model} on {where.workers} worker(s), {'GPU' if use_gpu else 'CPU'}, run {name}",
          flush=True)
    try:
        result = trainer.fit()
    except Exception as e:  # TrainingFailedError wraps the worker's exception
        close()
        print(f"{PROG}: error: training failed: {e}", file=sys.stderr)
        return 1
    last = close() or result.metrics or {}
    problem = failure_message(last, cfg.lr)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 1
    from vidtune.trainer.checkpointing import first_whole  # heavy: torch, not before the flags are checked

    # Best first by val_acc (ties: the later epoch); a damaged one is skipped with a line.
    ranked = sorted(result.best_checkpoints or [], key=lambda cm: (_acc(cm[1]), cm[1].get("epoch", 0)),
                    reverse=True)
    if not ranked and result.checkpoint is not None:
        ranked = [(result.checkpoint, last)]
    best, skipped = first_whole([c.path for c, _ in ranked])
    for why in skipped:
        print(f"{PROG}: warning: {why}; not named best", file=sys.stderr)
    if best is None:
        print(f"{PROG}: error: training reported no " + ("whole checkpoint" if skipped else "checkpoint"),
              file=sys.stderr)
        return 1
    score = next(m for c, m in ranked if c.path == best)
    print(f"best checkpoint (epoch {score.get('epoch')}, val_acc {score.get('val_acc', math.nan):.3f}): "
          f"{best}")
    return 0


def _acc(metrics: dict[str, Any]) -> float:
    acc = metrics.get("val_acc", math.nan)
    return acc if isinstance(acc, (int, float)) and math.isfinite(acc) else -math.inf


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        loaded = load_config_file(args.config) if getattr(args, "config", None) else None
        if loaded:
            print(describe(loaded), flush=True)
        cfg, where = config_from_args(args, loaded), run_options(args, loaded)
        try:
            index = check_inputs(cfg, where)
        except ConfigError as e:
            raise (loaded.blame(e, ALL_FLAGS, vars(args)) if loaded else e) from None
    except (ConfigError, DataError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:      # torch or Ray cannot load: most often a memory limit (ulimit -v)
        print(f"{PROG}: error: {import_failure_message(e)}", file=sys.stderr)
        return 1
    try:
        return run(cfg, where, index)
    except ConfigError as e:      # the cluster cannot hold the run's workers (checked once Ray is up)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except RayStartError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"{PROG}: error: {import_failure_message(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
