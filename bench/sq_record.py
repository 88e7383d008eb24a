"""Record a learning-curve table: a grid of trainings (batch size x learning rate x seed), every
epoch scored, with the project's own run builder (`trainer.training.run`) outside Ray.

The table (JSON, written atomically after every run, so a killed record continues where it
stopped) holds per run and epoch `val_acc`, `val_loss`, `train_s` (the training pass), `eval_s`
(the rest of the epoch: validation and its scoring), `clips_per_s` (training clips per second),
and `start_s` per run (building data loaders, model and optimizer); plus the machine, versions,
dataset and model. `bench.sq_replay` replays it.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import ray
import torch
from tqdm import tqdm

from bench.common import machine_facts
from vidtune.datasets.cache import FrameCache
from vidtune.datasets.cache_fill import fill_cache
from vidtune.datasets.index import VideoIndex, build_index
from vidtune.trainer.models.registry import get_spec
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.metrics import reduce_epoch
from vidtune.trainer.training.run import TRAINED, build_run, place_model, run_epoch

TABLE_FORMAT = 1


@dataclass(frozen=True)
class Grid:
    """What is trained: every (batch size, lr, seed), each for `epochs` epochs."""

    batch_sizes: tuple[int, ...]
    lrs: tuple[float, ...]          # log-spaced (`log_grid`), plus any added by hand (sorted)
    seeds: tuple[int, ...]
    epochs: int

    def runs(self) -> list[tuple[int, float, int]]:
        """(batch_size, lr, seed) in recording order: seed-major, so a stopped record has whole seeds."""
        return [(b, lr, s) for s in self.seeds for b in self.batch_sizes for lr in self.lrs]

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "lrs": list(self.lrs), "seeds": list(self.seeds),
                "epochs": self.epochs}


def log_grid(lo: float, hi: float, points: int) -> tuple[float, ...]:
    """`points` learning rates from `lo` to `hi`, evenly spaced in log, rounded to 3 significant digits."""
    values = np.geomspace(lo, hi, points) if points > 1 else np.array([lo])
    return tuple(float(f"{v:.3g}") for v in values)


def run_key(batch_size: int, lr: float, seed: int) -> str:
    return f"b{batch_size}-lr{lr:g}-s{seed}"


# A trainer: (config, index) -> per epoch a dict of val_acc, val_loss, train_s, eval_s, clips_per_s
# (a run that diverges or runs out of memory stops yielding). Tests pass a fake one.
Trainer = Callable[[TrainConfig, VideoIndex], Iterator[dict[str, float]]]


def train_run(cfg: TrainConfig, index: VideoIndex) -> Iterator[dict[str, float]]:
    """One training run on the CPU with `trainer.training.run`: its build time first (`{"start_s": s}`),
    then one row per epoch; stops early when an epoch diverges or runs out of memory."""
    started = time.perf_counter()
    run = build_run(cfg, index, device=torch.device("cpu"))
    place_model(run)
    yield {"start_s": time.perf_counter() - started}
    for epoch in range(1, cfg.epochs + 1):
        t0 = time.perf_counter()
        result = run_epoch(run, epoch)
        wall = time.perf_counter() - t0
        if result.outcome != TRAINED:
            yield {"outcome": result.outcome}
            return
        m = reduce_epoch(result.stats, result.eval_out)
        yield {"val_acc": m["val_acc"], "val_loss": m["val_loss"], "train_loss": m["train_loss"],
               "train_s": m["epoch_time_s"], "eval_s": max(0.0, wall - m["epoch_time_s"]),
               "clips_per_s": m["clips_per_s"]}


def versions() -> dict[str, str]:
    return {"python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
            "optuna": optuna.__version__, "numpy": np.__version__}


def dataset_facts(index: VideoIndex, root: str) -> dict[str, Any]:
    """Where the videos are, how many per split, and the generator's settings when generated."""
    facts: dict[str, Any] = {"root": root, "train_videos": len(index.train), "val_videos": len(index.val)}
    meta = Path(root) / "synthetic.json"
    if meta.is_file():
        facts["synthetic"] = json.loads(meta.read_text())
    return facts


def write_atomically(path: Path, doc: dict[str, Any]) -> None:
    """Write `doc` as JSON to `path` through a temporary file and a rename: a kill leaves the old
    table or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def open_table(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    """The table at `path` to continue (its finished runs kept), or a new one. A table recorded
    with another grid, model or training config is refused rather than mixed."""
    if not path.exists():
        return {**header, "runs": []}
    table = json.loads(path.read_text())
    for key in ("grid", "model", "train"):
        if table.get(key) != header[key]:
            raise SystemExit(f"{path}: recorded with another {key} ({table.get(key)} vs {header[key]}); "
                             "pass another --out or delete it (--reuse it to keep its runs)")
    return table


def reusable_runs(path: Path, header: dict[str, Any], grid: Grid) -> list[dict[str, Any]]:
    """The runs of an earlier table at `path` that belong to `grid`, to copy instead of training
    them again (a denser or narrower grid over the same data). Refused unless the model, the
    training config, the epoch count and the dataset are the same: a run is only the same run
    when everything but its (batch size, lr, seed) is."""
    if not path.is_file():
        raise SystemExit(f"--reuse {path}: no such table")
    old = json.loads(path.read_text())
    for what, mine, theirs in (("model", header["model"], old.get("model")),
                               ("training config", header["train"], old.get("train")),
                               ("epochs", grid.epochs, old.get("grid", {}).get("epochs")),
                               ("dataset", _dataset_identity(header), _dataset_identity(old))):
        if mine != theirs:
            raise SystemExit(f"--reuse {path}: recorded with another {what} ({theirs} vs {mine}); "
                             "its runs are not this grid's")
    wanted = {run_key(*r) for r in grid.runs()}
    return [{**run, "reused_from": str(path)} for run in old.get("runs", []) if run["key"] in wanted]


def _dataset_identity(doc: dict[str, Any]) -> Any:
    """What makes two tables' datasets the same: the split sizes and the generator's settings
    (the folder may have moved)."""
    facts = doc.get("dataset")
    if facts is None:
        return None
    return {k: v for k, v in facts.items() if k != "root"}


def train_row(trainer: Trainer, cfg: TrainConfig, index: VideoIndex,
              on_epoch: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """One run of the grid as the table stores it: its key, settings, outcome, start and epochs."""
    row: dict[str, Any] = {"key": run_key(cfg.batch_size, cfg.lr, cfg.seed), "batch_size": cfg.batch_size,
                           "lr": cfg.lr, "seed": cfg.seed, "outcome": TRAINED, "start_s": 0.0, "epochs": []}
    for step in trainer(cfg, index):
        if "start_s" in step:
            row["start_s"] = step["start_s"]
        elif "outcome" in step:
            row["outcome"] = step["outcome"]
        else:
            row["epochs"].append({"epoch": len(row["epochs"]) + 1, **step})
            if on_epoch is not None:
                on_epoch(row)
    return row


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)


def record(base: TrainConfig, index: VideoIndex, grid: Grid, out: str | Path, *,
           trainer: Trainer = train_run, header: dict[str, Any] | None = None,
           progress: bool = True, reuse: str | Path | None = None, jobs: int = 1,
           threads: int = 1) -> dict[str, Any]:
    """Train every run of `grid` not yet in the table at `out`, writing the table after each.

    `reuse`: an earlier table whose matching runs are copied first (`reusable_runs`). `jobs` > 1
    trains that many runs at once, each in its own process with `threads` torch threads (the
    trainer must then be a module-level function); the table is still written by this process
    alone, after each run, so a kill loses only the runs in flight."""
    path = Path(out)
    header = {"format": TABLE_FORMAT, "model": base.model, "grid": grid.to_dict(),
              "train": _train_facts(base), **(header or {})}
    table = open_table(path, header)
    done = {r["key"] for r in table["runs"]}
    if reuse is not None:
        copied = [r for r in reusable_runs(Path(reuse), header, grid) if r["key"] not in done]
        table["runs"].extend(copied)
        done |= {r["key"] for r in copied}
        write_atomically(path, table)
        if progress:
            print(f"reused {len(copied)} run(s) from {reuse}")
    todo = [base.with_overrides(batch_size=b, lr=lr, seed=s, epochs=grid.epochs)
            for b, lr, s in grid.runs() if run_key(b, lr, s) not in done]
    bar = tqdm(total=len(grid.runs()) * grid.epochs, initial=len(done) * grid.epochs, unit="epoch",
               disable=not progress, desc="record")

    def finished(row: dict[str, Any], epochs_shown: int) -> None:
        bar.update(grid.epochs - epochs_shown)
        table["runs"].append(row)
        write_atomically(path, table)

    def shown(row: dict[str, Any]) -> None:
        bar.update(1)
        bar.set_postfix(run=row["key"], val_acc=f"{row['epochs'][-1]['val_acc']:.3f}")

    if jobs <= 1:
        for cfg in todo:
            row = train_row(trainer, cfg, index, on_epoch=shown)
            finished(row, len(row["epochs"]))
    else:
        # spawn, not fork: a forked child of a process that has used torch's thread pool can hang
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init, initargs=(threads,)) as pool:
            futures = [pool.submit(train_row, trainer, cfg, index) for cfg in todo]
            try:
                for future in as_completed(futures):
                    row = future.result()
                    finished(row, 0)
                    bar.set_postfix(run=row["key"], val_acc=f"{row['epochs'][-1]['val_acc']:.3f}"
                                    if row["epochs"] else row["outcome"])
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)   # the finished runs are written
                raise
    bar.close()
    return table


def _train_facts(base: TrainConfig) -> dict[str, Any]:
    """The training settings every run shares (the searched and per-run ones left out)."""
    d = base.to_dict()
    for key in ("batch_size", "lr", "seed", "epochs"):
        d.pop(key)
    d["data"] = {k: v for k, v in d["data"].items() if k in ("num_frames", "frame_stride", "height", "width")}
    return d


def prepare(root: str, model: str, *, loader_workers: int, cache_dir: str | None) -> tuple[TrainConfig,
                                                                                         VideoIndex]:
    """The base config (raw clip cache, filled ahead so no run's first epoch pays for decoding)
    and the dataset's index."""
    data_kw: dict[str, Any] = dict(root=root, loader_workers=loader_workers, clip_cache_format="raw")
    if cache_dir:
        data_kw["clip_cache_dir"] = cache_dir
    base = TrainConfig(model=model).with_overrides(data=replace(TrainConfig().data, **data_kw))
    index = build_index(base.data)
    cache = FrameCache.from_config(base.data, on_gpu=False)
    if cache is not None:
        spec = get_spec(model)
        fill_cache(list(index.train) + list(index.val), height=spec.height, width=spec.width, cache=cache)
    return base, index


def header_for(root: str, index: VideoIndex, command: Sequence[str], threads: int,
               jobs: int = 1) -> dict[str, Any]:
    return {"command": " ".join(command),
            "machine": {**machine_facts(), "torch_threads": threads, "jobs_at_once": jobs},
            "versions": versions(), "dataset": dataset_facts(index, root),
            "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S")}
