"""The clip cache's command line: decode every video of a dataset once into the cache
(`vidtune.datasets.cache`), before a search, so that no trial pays for decoding.

    vidtune cache ROOT --model mvit_v2_s              # at a model's input size
    python -m vidtune.datasets.cache_cli ROOT --height 224 --width 224

The data layer does not know the models: `--model` is resolved by the caller's `clip_size_of`
(`vidtune cache`, i.e. `vidtune.trainer.commands.fill_cache`, passes the model registry's). The heavy
modules (torch, decord, the cache itself) are imported once the flags are checked.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from vidtune.datasets.cache_fill import fill_cache
from vidtune.datasets.cli import add_dataset_arguments, dataset_config, progress_printer, read_options
from vidtune.datasets.config import CLIP_CACHE_FORMATS, DataConfig
from vidtune.datasets.index import build_index
from vidtune.errors import DataError
from vidtune.flags import ConfigError, add_flags, flag_specs, option

PROG = "python -m vidtune.datasets.cache_cli"
MODEL_CLI = "vidtune cache"     # the same CLI with --model looked up in trainer.models.registry


@dataclass(frozen=True)
class FillOptions:
    """The cache CLI's own flags (the dataset's are `datasets.index.add_dataset_arguments`')."""

    model: str | None = option(None, flag="--model", metavar="NAME",
                               help="decode at this model's input size (trainer.models.registry names; with "
                               f"{MODEL_CLI}, which knows the models)")
    height: int | None = option(None, flag="--height", metavar="PX", ge=1,
                                help="decode height in pixels (with --width; not with --model)")
    width: int | None = option(None, flag="--width", metavar="PX", ge=1,
                               help="decode width in pixels (with --height)")
    cache_dir: str | None = option(None, flag="--cache-dir", metavar="DIR",
                                   help="clip cache folder (default: $XDG_CACHE_HOME/vidtune/clips, else "
                                   "~/.cache/vidtune/clips)")
    # > 0, unlike training's budget (where 0 means "write nothing"): filling into no room is a mistake
    cache_max_gb: float = option(DataConfig.clip_cache_max_gb, flag="--cache-max-gb", metavar="GB", gt=0,
                                 help="disk budget of the clip cache in GB; entries past it are not written")
    format: str = option(DataConfig.clip_cache_format, flag="--format", choices=CLIP_CACHE_FORMATS,
                         help="jpeg: 12-20x smaller, decoded on the GPU in training; raw: fastest on a CPU; "
                         "auto: jpeg when this machine has a GPU, else raw, as the search picks")
    workers: int | None = option(None, flag="--workers", metavar="N", ge=1,
                                 help="processes probing and decoding in parallel (default: one per core, "
                                 "at most 8)")


FILL_FLAGS = tuple(flag_specs(FillOptions))


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Decode every video of a dataset once into the clip cache, before a search, so that no "
                    "trial pays for decoding. Give the decode size (--height/--width), or, with "
                    f"{MODEL_CLI}, the model.")
    add_dataset_arguments(p)
    add_flags(p, FILL_FLAGS, group_of=lambda s: "clip cache", suppress=False)
    return p


def _decode_size(opts: FillOptions, clip_size_of: Callable[[str], tuple[int, int]] | None) -> tuple[int, int]:
    """(height, width) from --model (looked up with `clip_size_of`) or --height/--width; a
    ConfigError names the flag."""
    if opts.model is not None:
        if opts.height is not None or opts.width is not None:
            raise ConfigError("--model", "it sets the decode size: give either --model or --height/--width, "
                              "not both")
        if clip_size_of is None:   # the data layer does not know the models (trainer.models.registry does)
            raise ConfigError(f"--model {opts.model}", f"{PROG} takes the decode size from --height and "
                              f"--width; for a model's input size run {MODEL_CLI} --model {opts.model} "
                              "with the same arguments")
        try:
            return clip_size_of(opts.model)
        except ValueError as e:
            raise ConfigError(f"--model {opts.model}", str(e)) from None
    if opts.height is None or opts.width is None:
        raise ConfigError("--width" if opts.width is None else "--height",
                          "give the decode size: both --height H and --width W (or --model NAME with "
                          f"{MODEL_CLI})")
    return opts.height, opts.width


def main(argv: list[str] | None = None, *, clip_size_of: Callable[[str], tuple[int, int]] | None = None,
         prog: str = PROG) -> int:
    """The CLI. `clip_size_of(model name) -> (height, width)` resolves --model (trainer.commands.fill_cache
    passes trainer.models.registry' lookup; ValueError for an unknown name); without it --model is refused.
    Exit 0 filled, 1 the data cannot be used, 2 a bad flag."""
    p = build_parser(prog)
    args = p.parse_args(argv)
    try:
        opts = read_options(FillOptions, FILL_FLAGS, args)
        height, width = _decode_size(opts, clip_size_of)
        cfg = dataset_config(args, clip_cache_dir=opts.cache_dir, clip_cache_max_gb=opts.cache_max_gb,
                             clip_cache_format=opts.format)
    except ConfigError as e:
        p.error(str(e))
    from vidtune.datasets.cache import FrameCache  # heavy (torch: seconds): once the flags are checked

    cache = FrameCache.for_this_machine(cfg)
    try:
        index = build_index(cfg, workers=opts.workers)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    videos = index.train + index.val
    print(f"Decoding {len(videos)} videos of {index.root} at {height} x {width}", file=sys.stderr)
    report = fill_cache(videos, height=height, width=width, cache=cache, workers=opts.workers,
                        progress=progress_printer("cache", sys.stderr))
    print(report.summary(cache))
    return 0


if __name__ == "__main__":
    sys.exit(main())
