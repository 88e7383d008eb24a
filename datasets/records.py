"""Plain records passed between the data modules (discovery -> index -> Dataset)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VIOLENT = 1       # label of the positive (violent) class
NON_VIOLENT = 0


@dataclass(frozen=True)
class VideoItem:
    """A video found on disk, before it is probed."""

    path: Path
    label: int        # 1 = violent, 0 = not
    split: str        # "train" | "val"


@dataclass(frozen=True)
class VideoInfo:
    """A video that was probed and can be used."""

    path: Path
    label: int
    split: str
    num_frames: int   # frames that really decode (may be fewer than the container claims)
    fps: float
    width: int
    height: int
    duration_s: float


@dataclass(frozen=True)
class DroppedVideo:
    """A video left out at indexing, with the reason (shown to the user)."""

    path: Path
    reason: str
