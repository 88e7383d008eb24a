"""bench.search_overhead's plain side: the trials a search drew, trained one after another in one
process by the project's own loop (`trainer.training.run`, as a trial's worker builds it), without Ray,
Tune or MLflow, timed as the search's trials are. Run as `python -m bench.search_overhead
--plain-spec FILE` (its process title is what the CPU table counts as the plain side's training)."""
from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from vidtune.datasets.index import VideoIndex, build_index
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.metrics import reduce_epoch
from vidtune.trainer.training.precision import default_device, is_cuda
from vidtune.trainer.training.run import (
    TRAINED,
    Run,
    build_run,
    data_counts,
    place_model,
    run_epoch,
    save_run_checkpoint,
)
from vidtune.tune.config import searched
from vidtune.tune.config.options import base_config, parse_options
from vidtune.tune.runner import fill_clip_cache
from vidtune.tune.running.trial import trial_config


def plain_process(spec_path: str) -> int:
    """The plain side, in its own process: the trials of `spec_path` one after another; writes
    their timeline next to it (`<spec>.out.json`)."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    base = base_config(parse_options(spec["argv"]))
    index = build_index(base.data)
    print(index.summary(), flush=True)      # the same console markers as the search's
    device = default_device()
    # The clip cache filled before the first trial as the search does, its `auto` format resolved.
    base = fill_clip_cache(base, index, on_gpu=is_cuda(device))
    trials = []
    for trial in spec["trials"]:
        sampled = {p.name: trial[p.name] for p in searched.PARAMS if p.name in trial}
        row = _plain_trial(trial_config(base, sampled), index, device, spec["checkpoints"])
        trials.append({"trial_id": f"plain:{trial['trial_id']}", **row})
    out = {"trials": trials, "cache": base.data.clip_cache, "threads": torch.get_num_threads(),
           "device": str(device)}
    Path(spec_path + ".out.json").write_text(json.dumps(out))
    return 0


def _plain_trial(cfg: TrainConfig, index: VideoIndex, device: torch.device, checkpoints: str) -> dict:
    """One training built and run as a trial's worker does (`trainer.training.run`), without Ray; like a
    trial, it ends at an epoch that diverged or ran out of memory."""
    start = time.time()
    run = build_run(cfg, index, device=device)
    place_model(run)
    epochs = []
    for epoch in range(1, cfg.epochs + 1):
        row = _plain_epoch(run, epoch, checkpoints)
        if row is None:
            break
        epochs.append(row)
    reads, hits, _, _ = data_counts(run)
    del run                     # stops the persistent loader processes: part of the trial's end
    gc.collect()
    return {"batch_size": cfg.batch_size, "lr": cfg.lr, "start": start,
            "end": time.time(), "epochs": epochs, "cache_hit_frac": hits / reads if reads else None}


def _plain_epoch(run: Run, epoch: int, checkpoints: str) -> dict | None:
    """`run_epoch` and a checkpoint, timed; None when the epoch did not train to the end."""
    start = time.time()
    result = run_epoch(run, epoch)
    end = time.time()
    if result.outcome != TRAINED:
        print(f"plain: {result.outcome} in epoch {epoch} (lr {run.cfg.lr:.2e})", file=sys.stderr, flush=True)
        return None
    metrics = reduce_epoch(result.stats, result.eval_out)
    with tempfile.TemporaryDirectory(dir=checkpoints) as directory:
        save_run_checkpoint(run, directory, epoch=epoch, metrics=metrics)
    return {"epoch": epoch, "start": start, "train_s": result.stats.epoch_time_s, "end": end, "exact": True,
            "checkpoint_s": time.time() - end, "clips_per_s": metrics["clips_per_s"],
            "val_acc": metrics["val_acc"]}
