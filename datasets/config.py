"""Typed configuration of the data layer (one frozen dataclass; a dict only at the Ray boundary).

Each field is declared once with its flag, help and bounds (`vidtune.flags.option`): the CLIs
(`vidtune train`, `vidtune search`, `vidtune index`) and the search's
config file are generated from these declarations.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from vidtune.flags import option

LAYOUT_CHOICES = ("auto", "rwf2000", "class_folders", "csv")

# The clip cache's stored formats (datasets.cache) and `auto`, which picks one for the device.
CLIP_CACHE_FORMATS = ("auto", "jpeg", "raw")


@dataclass(frozen=True)
class DataConfig:
    """Where the videos are and how clips are cut from them.

    `num_frames`, `height` and `width` default to None, meaning "the model's input size"
    (see `trainer.models.registry.ModelSpec`); set them to override.
    """

    root: str = option("", flag="--data", metavar="PATH", help="dataset folder (RWF-2000 or class folders) "
                       "or CSV manifest; the search without it runs the embedded demo on generated videos")
    layout: str = option("auto", flag="--layout", choices=LAYOUT_CHOICES,
                         help="how the videos are organised; auto detects it from what is on disk")
    positive_class: str | None = option(None, flag="--positive-class", metavar="NAME",
                                        help="name of the violent class, label 1 "
                                        "(default: inferred, e.g. Fight)")
    val_fraction: float = option(0.2, flag="--val-fraction", metavar="F", gt=0, lt=1,
                                 help="share of each class held out for validation when the layout "
                                 "gives no split")
    split_seed: int = option(0, flag="--split-seed", metavar="N",
                             help="seed of that stratified train/val split (same seed, same split)")
    num_frames: int | None = option(None, flag="--num-frames", metavar="T", ge=1,
                                    help="frames per clip (default: the model's)")
    frame_stride: int = option(2, flag="--frame-stride", metavar="K", ge=1,
                               help="take every K-th frame (shrunk for videos too short for it)")
    height: int | None = option(None, flag="--height", metavar="PX", ge=1,
                                help="frame height after decoding (default: the model's)")
    width: int | None = option(None, flag="--width", metavar="PX", ge=1,
                               help="frame width after decoding (default: the model's)")
    min_frames: int = option(8, flag="--min-frames", metavar="N", ge=1,
                             help="videos that decode fewer frames are left out at indexing")
    loader_workers: int | None = option(None, flag="--loader-workers", metavar="N", ge=0,
                                        help="DataLoader processes per training worker (default: "
                                        "one fewer than the CPUs it holds, --cpus-per-worker, at least 2; "
                                        "on a GPU all but its 1-2 torch threads, at least 4 where its "
                                        "node has the cores)")
    probe_timeout_s: float = option(30.0, flag="--probe-timeout-s", metavar="S", gt=0,
                                    help="seconds allowed to probe one file "
                                    "(decord can hang on broken files)")
    cache_dir: str | None = option(None, flag="--index-cache-dir", metavar="DIR",
                                   help="where the dataset index (probe results) is cached "
                                   "(default: ROOT/.vidtune-index.json if writable, else ~/.cache/vidtune)")
    clip_cache: bool = option(True, flag="--no-cache", help="decode every clip from the video files on every "
                              "read (no decode-once clip cache)")
    clip_cache_dir: str | None = option(None, flag="--cache-dir", metavar="DIR",
                                        help="node-local folder of the decode-once clip cache (default "
                                        "~/.cache/vidtune/clips; vidtune cache fills it ahead)")
    # RWF-2000 (300k frames) at 224 px takes ~4 GB as jpeg, 45 GB raw
    clip_cache_max_gb: float = option(50.0, flag="--cache-max-gb", metavar="GB", ge=0,
                                      help="clip cache disk budget; past it the rest is decoded on "
                                      "every read")
    clip_cache_format: str = option("auto", flag="--cache-format", choices=CLIP_CACHE_FORMATS,
                                    help="how cached frames are stored: jpeg (~12 KB a 224 px frame, decoded "
                                    "on the GPU), raw uint8 (150 KB, fastest on a CPU), or auto: jpeg when "
                                    "training on GPUs, else raw (default auto)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown data option(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)
