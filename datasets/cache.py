"""A node-local cache of decoded frames: decode each video once, read its frames every epoch after.

Decoding with decord costs far more than reading stored frames, which every epoch of every trial
would otherwise do for every video (BENCHMARKS.md, `bench.data_loading`, has the clips/s and disk
per frame of each format). The first read of a video decodes *all* its frames at the decode
size (H x W) into an entry (jpeg or raw; files in `datasets.cache_layout`); later reads, in any
epoch, trial or search on this node, take the frames from it. Every frame is kept because the
train jitter starts its window anywhere: one entry serves every window, stride and clip length.
The entry key holds the source's size and mtime, so a changed file is decoded again (the old
entry stays until the cache is cleared; no eviction beyond the budget rule).

Formats: `auto` picks jpeg when training runs on GPUs: the loader ships JPEG bytes
(VideoClipDataset(encoded=True)), the device decodes them, and a budget holds 12-20x more videos
than raw. On the CPU, where the loader must decode, it picks raw, the fastest to read.

Concurrency: an entry is written into ``ROOT/.tmp-*`` and renamed into place; readers only open
published entries, so no process sees half an entry. No fsync: after a power loss a truncated
entry reads as damaged, which is a miss (with a warning) and is written again.

Integrity: an entry holds the crc32 of its frames file, checked on a process's first read of it
(reads the whole file; BENCHMARKS.md has the cost), trusted on later reads. A damaged entry is a
miss: a warning names the video, which is decoded again into a new entry (`repairs` counts them).

Budget (`max_gb`): before writing, the root is listed and an entry that would take the cache past
the budget is not written: that video is decoded with decord on every read, as without a cache.
Writers that check at the same moment can each overshoot the budget by the entry they write.

Fill before a search:  vidtune cache ROOT --model mvit_v2_s  (`vidtune.datasets.cache_cli`)
(or at any size:  vidtune cache ROOT --height 224 --width 224)
"""
from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vidtune.datasets.cache_layout import (
    FORMATS,
    META_FILE,
    check_crc32,
    discard,
    entry_key,
    folder_bytes,
    load_meta,
    publish,
    read_jpeg,
    read_raw,
    update_sizes,
    write_entry,
)
from vidtune.datasets.config import CLIP_CACHE_FORMATS, DataConfig
from vidtune.datasets.decode import decode_jpeg_frames, read_frames
from vidtune.datasets.records import VideoInfo
from vidtune.errors import DataError

log = logging.getLogger(__name__)

_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, RuntimeError)  # what a damaged entry raises


FORMAT_CHOICES = CLIP_CACHE_FORMATS   # "auto" and the stored FORMATS


def resolve_format(fmt: str, *, on_gpu: bool) -> str:
    """The stored format for `fmt` (auto | jpeg | raw): auto is jpeg when training on a GPU
    (decoded there), else raw (the fastest read on a CPU); see the module doc."""
    if fmt == "auto":
        return "jpeg" if on_gpu else "raw"
    if fmt not in FORMATS:
        raise DataError(f"clip cache format {fmt!r} (--cache-format): use one of {', '.join(FORMAT_CHOICES)}")
    return fmt


def default_root() -> Path:
    """$XDG_CACHE_HOME/vidtune/clips, else ~/.cache/vidtune/clips."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "vidtune" / "clips"


class FrameCache:
    """Decoded frames of whole videos, stored once per (file version, decode size, format).

    Picklable: a DataLoader worker gets its own copy (its own view of the usage and of entries
    found over budget); entries themselves are shared through the file system.
    """

    def __init__(self, root: str | Path, *, format: str = "jpeg",
                 max_gb: float = DataConfig.clip_cache_max_gb):
        if format not in FORMATS:
            raise DataError(f"clip cache format {format!r} (--cache-format): use one of {', '.join(FORMATS)}")
        if not max_gb >= 0:   # 0 writes nothing (every read decodes); --no-cache skips the cache entirely
            raise DataError(f"clip cache budget {max_gb} GB (--cache-max-gb): must be a number >= 0")
        self.root = Path(root).expanduser()
        self.format = format
        self.max_bytes = int(max_gb * 1e9)
        self._sizes: dict[str, int] = {}    # published entry -> bytes on disk, as last listed
        self._meta: dict[str, dict] = {}     # meta.json of entries read: published entries never change
        self._verified: set[str] = set()     # entries whose checksum this process checked (or wrote)
        self._uncached: set[str] = set()     # entries over budget (or unwritable) in this process
        self._told_unchecked = False         # the one warning about entries without a checksum was given
        self.repairs = 0                     # damaged entries this process found and decoded again

    @classmethod
    def from_config(cls, cfg: DataConfig, *, on_gpu: bool = False) -> FrameCache | None:
        """The cache `cfg` asks for, or None when `cfg.clip_cache` is False. Touches no file.
        `on_gpu`: training runs on a GPU (resolves the `auto` format)."""
        if not cfg.clip_cache:
            return None
        root = cfg.clip_cache_dir or default_root()
        fmt = resolve_format(cfg.clip_cache_format, on_gpu=on_gpu)
        return cls(root, format=fmt, max_gb=cfg.clip_cache_max_gb)

    @classmethod
    def for_this_machine(cls, cfg: DataConfig) -> FrameCache | None:
        """`from_config` with the `auto` format resolved for this machine (jpeg when it has a GPU)."""
        return cls.from_config(cfg, on_gpu=torch.cuda.is_available())

    def __repr__(self) -> str:
        return f"FrameCache({str(self.root)!r}, format={self.format!r}, max_gb={self.max_bytes / 1e9:g})"

    def entry_path(self, info: VideoInfo, *, height: int, width: int) -> Path:
        """Where the entry of `info`'s current file version lives (published or not)."""
        return self.root / entry_key(info.path, self.format, height, width)

    # ------------------------------------------------------------------------------- reading
    def read(self, info: VideoInfo, indices: Sequence[int], *, height: int, width: int,
             encoded: bool = False) -> tuple[np.ndarray | list[torch.Tensor], bool]:
        """Frames `indices` of `info.path` at `height` x `width`, and whether the cache had them.

        Returns ``(frames, hit)``: frames a uint8 ndarray ``T x H x W x 3`` (RGB), or, when
        `encoded` and the entry is jpeg, a list of T 1-D uint8 tensors (each frame's JPEG bytes;
        `datasets.video.clips_to_device` decodes them). A miss decodes the whole video, writes
        its entry (unless over budget) and returns decoded frames as the entry holds them.
        Raises DataError ``Failed to read video {path}: ...`` when the video cannot be decoded.
        """
        indices = [int(i) for i in indices]
        key = entry_key(info.path, self.format, height, width)
        if key in self._uncached:
            return read_frames(info.path, indices, height=height, width=width), False
        frames = self._read_entry(info, key, indices, encoded)
        if frames is not None:
            return frames, True
        _, _, _, frames = self._fill(info, key, height, width, indices)
        return frames, False

    def _read_entry(self, info: VideoInfo, key: str, indices: list[int], encoded: bool):
        """The frames from a published entry; None when there is none (or it was damaged, or
        has no checksum: then it is removed). The checksum is checked when frames are asked."""
        entry = self.root / key
        try:
            meta = self._meta.get(key) or load_meta(entry, self.format)
            if meta is None:
                return None
            if "crc32" not in meta:
                return self._unchecked(entry)
            self._meta[key] = meta
            n = meta["num_frames"]
            if not indices:
                return np.empty((0, meta["height"], meta["width"], 3), np.uint8)
            if not 0 <= min(indices) <= max(indices) < n:
                raise ValueError(f"frames {min(indices)}..{max(indices)} asked, the entry holds {n}")
            if key not in self._verified:
                check_crc32(entry, meta, self.format)
                self._verified.add(key)
            if self.format == "raw":
                return read_raw(entry, meta, indices)
            jpegs = read_jpeg(entry, meta, indices)
            return jpegs if encoded else decode_jpeg_frames(jpegs, "cpu").numpy()
        except FileNotFoundError:
            if not (entry / META_FILE).exists():   # removed meanwhile (cache cleared, rewritten)
                self._meta.pop(key, None)
                self._verified.discard(key)
                return None
            return self._damaged(info, entry, "frames file missing")
        except _READ_ERRORS as e:
            return self._damaged(info, entry, f"{type(e).__name__}: {e}")

    def _damaged(self, info: VideoInfo, entry: Path, reason: str) -> None:
        log.warning("clip cache entry of %s is damaged (%s); decoding the video again and rewriting "
                    "the entry %s", info.path, reason, entry)
        self.repairs += 1
        self._meta.pop(entry.name, None)
        self._verified.discard(entry.name)
        discard(entry, self.root)
        return None

    def _unchecked(self, entry: Path) -> None:
        if not self._told_unchecked:
            self._told_unchecked = True
            log.warning("clip cache %s holds entries without a checksum (written by an older vidtune); "
                        "each is decoded and written again once", self.root)
        discard(entry, self.root)
        return None

    # ------------------------------------------------------------------------------- writing
    def fill(self, info: VideoInfo, *, height: int, width: int) -> bool:
        """Make sure `info`'s entry exists (decoding and writing it if needed); True when it does.

        False when it would take the cache past its budget (or cannot be written). Raises
        DataError when the video cannot be decoded."""
        return self.fill_status(info, height=height, width=width)[0] in ("written", "cached")

    def has(self, info: VideoInfo, *, height: int, width: int) -> bool:
        """Whether a readable entry of `info`'s current file version is published (no decoding;
        DataError when the file cannot be stat'ed)."""
        key = entry_key(info.path, self.format, height, width)
        self._meta.pop(key, None)        # look on disk, not at what this process saw earlier
        return self._read_entry(info, key, [], False) is not None   # the checksum waits for a read

    def fill_status(self, info: VideoInfo, *, height: int, width: int) -> tuple[str, int, int]:
        """`fill` with the details: (outcome, bytes written, frames written); outcome is one of
        written | cached | over_budget | unwritable."""
        key = entry_key(info.path, self.format, height, width)
        if key not in self._uncached and self.has(info, height=height, width=width):
            return "cached", 0, 0
        outcome, size, frames, _ = self._fill(info, key, height, width, [])
        return outcome, size, frames

    def _fill(self, info: VideoInfo, key: str, height: int, width: int, want: list[int]):
        """Decode `info` into a new entry. Returns (outcome, bytes, frames written, frames `want`)."""
        n = int(info.num_frames)

        def decoded() -> np.ndarray:   # the clip straight from the video, as without a cache
            if not want:
                return np.empty((0, height, width, 3), np.uint8)
            return read_frames(info.path, want, height=height, width=width)

        # raw: the entry's exact size; jpeg: unknown before encoding, so only a full cache stops it.
        estimate = n * height * width * 3 if self.format == "raw" else 1
        if key in self._uncached or self.usage_bytes() + estimate > self.max_bytes:
            self._uncached.add(key)
            return "over_budget", 0, 0, decoded()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=self.root))
        except OSError as e:
            return self._unwritable(key, e) + (decoded(),)
        try:
            picked = write_entry(tmp, info, height, width, self.format, want)
            size = folder_bytes(tmp)
            if self.usage_bytes() + size > self.max_bytes:
                self._uncached.add(key)
                return "over_budget", 0, 0, picked
            if publish(tmp, self.root / key):
                outcome = "written"
                self._sizes[key] = size
                self._verified.add(key)      # its checksum was just taken from what was written
            else:
                outcome, size, n = "cached", 0, 0    # another process published it first: keep theirs
        except DataError:
            raise
        except OSError as e:    # disk full, permissions: train on without caching this video
            return self._unwritable(key, e) + (decoded(),)
        finally:
            if tmp.exists():
                discard(tmp, self.root)
        # Read back through the entry, so a clip is the same whether it was a hit or a miss.
        stored = self._read_entry(info, key, want, False) if want else None
        return outcome, size, n, picked if stored is None else stored

    def _unwritable(self, key: str, e: OSError) -> tuple[str, int, int]:
        if not self._uncached:
            log.warning("clip cache %s cannot be written (%s); decoding without it", self.root, e)
        self._uncached.add(key)
        return "unwritable", 0, 0

    def usage_bytes(self) -> int:
        """Bytes of the published entries under the root (listed now; sizes read once per entry)."""
        update_sizes(self.root, self._sizes)
        return sum(self._sizes.values())

