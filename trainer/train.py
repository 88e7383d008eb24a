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
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run by path: this project's `datasets` must shadow Hugging Face's
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datasets.config import CLIP_CACHE_FORMATS, DataConfig  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = TrainConfig()
    p.add_argument("--data", required=True, help="dataset folder (RWF-2000 or class folders) or CSV manifest")
    p.add_argument("--layout", default="auto", help="dataset layout: auto | rwf2000 | class_folders | csv")
    p.add_argument("--positive-class", default=None, help="name of the violent class (default: inferred, e.g. Fight)")
    p.add_argument("--val-fraction", type=float, default=DataConfig.val_fraction,
                   help="share held out for validation when the layout has no split")
    p.add_argument("--model", default=d.model, help="model name (tiny for the CPU, mvit_v2_s, swin3d_t, ...)")
    p.add_argument("--weights", default=d.weights, help="none | kinetics | path of a state dict or vidtune checkpoint")
    p.add_argument("--epochs", type=int, default=d.epochs, help="training epochs")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="clips per optimizer step, per worker")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW peak learning rate (after warmup)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--warmup-frac", type=float, default=d.warmup_frac, help="share of steps in linear warmup")
    p.add_argument("--label-smoothing", type=float, default=d.label_smoothing, help="cross-entropy label smoothing")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum_steps, help="batches accumulated per optimizer step")
    p.add_argument("--clip-grad-norm", type=float, default=d.clip_grad_norm, help="gradient norm limit (0 disables)")
    p.add_argument("--precision", default=d.precision, help="auto | fp32 | fp16 | bf16 (auto: bf16 on recent GPUs, fp16 on older, fp32 on CPU)")
    p.add_argument("--freeze-backbone-epochs", type=int, default=d.freeze_backbone_epochs,
                   help="train only the classification head for the first N epochs")
    p.add_argument("--channels-last", action="store_true", help="channels_last_3d memory format (faster convs on GPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slow first steps)")
    p.add_argument("--num-frames", type=int, default=None, help="frames per clip (default: the model's)")
    p.add_argument("--frame-stride", type=int, default=DataConfig.frame_stride, help="take every k-th frame")
    p.add_argument("--size", type=int, default=None, help="clip height = width in pixels (default: the model's)")
    p.add_argument("--loader-workers", type=int, default=DataConfig.loader_workers,
                   help="DataLoader decoding processes per training worker")
    p.add_argument("--cache-dir", default=None, help="node-local clip cache folder: each video is decoded once "
                   "(default ~/.cache/vidtune/clips; shared with searches)")
    p.add_argument("--cache-max-gb", type=float, default=DataConfig.clip_cache_max_gb,
                   help="clip cache disk budget; past it the rest is decoded on every read")
    p.add_argument("--cache-format", choices=CLIP_CACHE_FORMATS, default=DataConfig.clip_cache_format,
                   help="auto (jpeg on a GPU, raw on the CPU) | jpeg | raw")
    p.add_argument("--no-cache", dest="cache", action="store_false", help="decode every clip from the videos on every read")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (init, shuffling, augmentation)")
    p.add_argument("--workers", type=int, default=1, help="Ray Train workers (data-parallel replicas)")
    p.add_argument("--gpus-per-worker", type=float, default=None,
                   help="GPUs per worker (default: 1 when GPUs are present, else 0)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs Ray reserves per worker (torch threads)")
    p.add_argument("--storage", default=None, help="where checkpoints go (default ~/ray_results; shared storage on a cluster)")
    p.add_argument("--name", default=None, help="run name (default vidtune-train-TIMESTAMP); reuse it to resume")
    p.add_argument("--address", default=None, help="Ray cluster address (auto, ray://host:10001); default: local Ray")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    data = DataConfig(root=args.data, layout=args.layout, positive_class=args.positive_class,
                      val_fraction=args.val_fraction, num_frames=args.num_frames,
                      frame_stride=args.frame_stride, height=args.size, width=args.size,
                      loader_workers=args.loader_workers, clip_cache=args.cache, clip_cache_dir=args.cache_dir,
                      clip_cache_max_gb=args.cache_max_gb, clip_cache_format=args.cache_format)
    return TrainConfig(
        data=data, model=args.model, weights=args.weights, epochs=args.epochs, batch_size=args.batch_size,
        lr=args.lr, weight_decay=args.weight_decay, warmup_frac=args.warmup_frac,
        label_smoothing=args.label_smoothing, grad_accum_steps=args.grad_accum,
        clip_grad_norm=args.clip_grad_norm, precision=args.precision, channels_last=args.channels_last,
        compile=args.compile, freeze_backbone_epochs=args.freeze_backbone_epochs, seed=args.seed)


def check_inputs(cfg: TrainConfig, args: argparse.Namespace):
    """Everything checkable before Ray starts; returns the dataset index (cached for the workers).
    Raises ConfigError / DataError naming the flag or file at fault."""
    from datasets.index import build_index
    from trainer.launch import ConfigError, validate_config

    validate_config(cfg)
    if args.workers < 1:
        raise ConfigError("--workers", f"got {args.workers}; it must be an integer >= 1")
    if args.cpus_per_worker <= 0:
        raise ConfigError("--cpus-per-worker", f"got {args.cpus_per_worker}; it must be > 0")
    if args.gpus_per_worker is not None and args.gpus_per_worker < 0:
        raise ConfigError("--gpus-per-worker", f"got {args.gpus_per_worker}; it must be >= 0")
    index = build_index(cfg.data)
    per_worker = len(index.train) // args.workers
    if per_worker < cfg.batch_size:
        raise ConfigError("--batch-size", f"{cfg.batch_size} is more than the {per_worker} training videos each of "
                                          f"the {args.workers} worker(s) gets; lower --batch-size or --workers")
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


def run(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """Start Ray, fit, print the best checkpoint. Inputs must have been checked."""
    from trainer.launch import build_torch_trainer, init_ray

    init_ray(address=args.address)
    use_gpu, resources = _resources(args)
    name = args.name or time.strftime("vidtune-train-%Y%m%d-%H%M%S")
    callback, close = _epoch_printer(cfg.epochs)
    trainer = build_torch_trainer(cfg, num_workers=args.workers, use_gpu=use_gpu, resources_per_worker=resources,
                                  name=name, storage_path=args.storage, callbacks=[callback])
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
    from trainer.launch import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    try:
        index = check_inputs(cfg, args)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(index.summary(), flush=True)
    return run(cfg, args)


if __name__ == "__main__":
    sys.exit(main())
