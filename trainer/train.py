"""One fine-tuning run without a search, on Ray Train (one or more workers, GPUs when present).

    python -m trainer.train --data DIR --model tiny --epochs 3 --batch-size 8 --lr 3e-4

Prints one line per epoch as it ends and, at the end, the best checkpoint (by val_acc), which
`python -m trainer.predict --checkpoint PATH VIDEO...` uses. Rerunning with the same --name and
--storage resumes after the last finished epoch. Exit codes: 0 done, 1 training failed or ran
out of memory, 2 bad input (reported before Ray starts).
"""
from __future__ import annotations

import argparse
import math
import queue as stdlib_queue
import sys
import threading
import time
from typing import Any, Sequence


from datasets.flags import ConfigError, add_flags, build, join_negative_values
from trainer.config import TrainConfig
from trainer.launch import TRAIN_FLAGS

GROUPS = {"TrainConfig": "model and training", "DataConfig": "data"}


def build_parser() -> argparse.ArgumentParser:
    """Every `TrainConfig` field's flag (the same names as the search's), plus where it runs."""
    p = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n\n")[0])
    add_flags(p, TRAIN_FLAGS, group_of=lambda s: GROUPS[s.owner.__name__])
    g = p.add_argument_group("where it runs")
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


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of the flags given (the generated flags' dests are the fields' paths)."""
    paths = {s.path for s in TRAIN_FLAGS}
    return build(TrainConfig, {k: v for k, v in vars(args).items() if k in paths})


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
    return (f"{head}  train_loss {m['train_loss']:.4f}  val_loss {m['val_loss']:.4f}  "
            f"val_acc {m['val_acc']:.3f}  val_f1 {m['val_f1']:.3f}  val_recall {m['val_recall']:.3f}  "
            f"val_auc {m['val_auc']:.3f}  {m['clips_per_s']:.1f} clips/s  {m['epoch_time_s']:.1f} s  "
            f"data_wait {100 * m['data_wait_frac']:.0f}%  peak_mem {m['peak_mem_mb']:.0f} MB  lr {m['lr']:.2e}"
            + (f"  reader_failures {m['reader_failures']}" if m.get("reader_failures") else ""))


def _epoch_printer(epochs: int):
    """A Ray Train callback (runs in the Train controller) that sends rank 0's metrics to a
    queue, and a driver thread that prints them as they come, unprefixed by Ray's log tags."""
    import ray.train
    from ray.util.queue import Empty, Queue

    q = Queue(actor_options={"num_cpus": 0})

    class EpochQueue(ray.train.UserCallback):
        def __init__(self, queue):
            self.queue = queue

        def after_report(self, run_context, metrics, checkpoint):
            self.queue.put(dict(metrics[0]))

    stop = threading.Event()

    def pump():
        while True:
            try:
                print(format_epoch(q.get(timeout=0.5), epochs), flush=True)
            except (Empty, stdlib_queue.Empty):
                if stop.is_set():
                    return

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()

    def close():
        stop.set()
        thread.join(timeout=10)
        q.shutdown()

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
    close()
    last = result.metrics or {}
    if last.get("oom"):
        print(f"error: out of memory at batch size {last.get('batch_size')}; lower --batch-size "
              f"(use --grad-accum to keep the effective batch), or try --precision bf16/fp16", file=sys.stderr)
        return 1
    best = result.get_best_checkpoint(metric="val_acc", mode="max") if result.best_checkpoints else result.checkpoint
    if best is None:
        print("error: training reported no checkpoint", file=sys.stderr)
        return 1
    score = next((m for c, m in (result.best_checkpoints or []) if c.path == best.path), last)
    print(f"best checkpoint (epoch {score.get('epoch')}, val_acc {score.get('val_acc', math.nan):.3f}): {best.path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from datasets.errors import DataError

    args = parse_args(argv)
    try:
        cfg = config_from_args(args)
        index = check_inputs(cfg, args)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(index.summary(), flush=True)
    return run(cfg, args, index)


if __name__ == "__main__":
    sys.exit(main())
