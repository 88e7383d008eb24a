"""Typed configuration of the data layer (one frozen dataclass; a dict only at the Ray boundary)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


# The clip cache's stored formats (datasets.cache) and `auto`, which picks one for the device.
CLIP_CACHE_FORMATS = ("auto", "jpeg", "raw")


@dataclass(frozen=True)
class DataConfig:
    """Where the videos are and how clips are cut from them.

    `num_frames`, `height` and `width` default to None, meaning "the model's input size"
    (see `trainer.models.ModelSpec`); set them to override.
    """

    root: str = ""                      # dataset folder, or a CSV manifest file
    layout: str = "auto"                # auto | rwf2000 | class_folders | csv
    positive_class: str | None = None   # name of the violent class; None = inferred (Fight, Violence, ...)
    val_fraction: float = 0.2           # share held out for val when the layout gives no split
    split_seed: int = 0                 # seed of that stratified split (same seed, same split)
    num_frames: int | None = None       # T frames per clip; None = the model's
    frame_stride: int = 2               # take every k-th frame; shrunk for short videos
    height: int | None = None           # decode-time resize; None = the model's
    width: int | None = None
    min_frames: int = 8                 # videos that decode fewer frames are dropped at indexing
    loader_workers: int = 2             # DataLoader worker processes per training worker
    probe_timeout_s: float = 30.0       # per-file probe limit (decord can hang on broken files)
    cache_dir: str | None = None        # index cache; None = ROOT/.vidtune-index.json if writable, else ~/.cache/vidtune
    clip_cache: bool = True             # decode each video once into a node-local frame cache (datasets.cache)
    clip_cache_dir: str | None = None   # its folder; None = $XDG_CACHE_HOME/vidtune/clips, else ~/.cache/vidtune/clips
    clip_cache_max_gb: float = 50.0     # disk budget; RWF-2000 (300k frames) at 224 px takes ~4 GB as jpeg, 45 GB raw
    clip_cache_format: str = "auto"     # auto | jpeg | raw; auto: jpeg when training on GPUs, else raw (datasets/cache.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DataConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown data option(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)
