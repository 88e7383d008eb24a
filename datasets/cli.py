"""What the data CLIs share (`vidtune index`, `python -m vidtune.datasets.cache_cli`, and the
trainer's `predict` and `batch_probe`): the dataset's positional ROOT and layout flags, reading a
CLI's own option dataclass from its parsed flags, and the progress line of a long pass."""
from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO, TypeVar

from tqdm import tqdm

from vidtune.datasets.config import DataConfig
from vidtune.flags import FlagSpec, add_flags, build, check_bounds, flag_specs

_PLAIN_EVERY_S = 2.0        # progress off a terminal: a line this often, not one per file
T = TypeVar("T")

# The DataConfig fields the indexing CLIs expose (declared once in datasets.config).
INDEX_FIELDS = ("layout", "positive_class", "val_fraction", "split_seed", "min_frames", "probe_timeout_s")
INDEX_FLAGS = tuple(s for s in flag_specs(DataConfig) if s.path in INDEX_FIELDS)


def add_dataset_arguments(p: argparse.ArgumentParser) -> None:
    """The dataset's positional ROOT and layout flags, shared by the CLIs that index a dataset
    (the flags generated from `DataConfig`'s declarations, as in the search and trainer.commands.train)."""
    p.add_argument("root", help="dataset folder (RWF-2000 or class-folder layout) or a CSV manifest file")
    add_flags(p, INDEX_FLAGS, group_of=lambda s: "dataset", suppress=False)


def dataset_config(args: argparse.Namespace, **more: Any) -> DataConfig:
    """The DataConfig of the flags `add_dataset_arguments` added (plus `more` fields); bounds are
    checked (ConfigError naming the flag)."""
    cfg = DataConfig(root=args.root, **{name: getattr(args, name) for name in INDEX_FIELDS}, **more)
    check_bounds(cfg, INDEX_FLAGS)
    return cfg


def read_options(cls: type[T], specs: Sequence[FlagSpec], args: argparse.Namespace) -> T:
    """The frozen dataclass `cls` of a CLI's own flags (`specs`, added with `add_flags(...,
    suppress=False)`) from the parsed `args`; bounds checked (ConfigError naming the flag)."""
    opts = build(cls, {s.path: getattr(args, s.path) for s in specs})
    check_bounds(opts, specs)
    return opts


def progress_printer(desc: str, stream: TextIO) -> Callable[[int, int], None]:
    """`progress(done, total)` of the indexing and cache CLIs: on a terminal a tqdm bar redrawn
    in place; elsewhere (a log file, CI) tqdm's meter as a plain line every `_PLAIN_EVERY_S`
    seconds and at the end, so a log holds lines instead of carriage returns."""
    if stream.isatty():
        bar: list[tqdm] = []

        def redraw(done: int, total: int) -> None:
            if not bar:
                bar.append(tqdm(total=total, desc=desc, unit="video", file=stream, dynamic_ncols=True))
            bar[0].update(done - bar[0].n)
            if done >= total:
                bar[0].close()
        return redraw
    start, last = time.monotonic(), [-math.inf]

    def line(done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total or now - last[0] >= _PLAIN_EVERY_S:
            last[0] = now
            meter = tqdm.format_meter(done, total, now - start, prefix=desc, unit="video", ascii=True)
            print(meter, file=stream, flush=True)
    return line
