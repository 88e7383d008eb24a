"""Fill the clip cache ahead (`datasets.cache`): decode many videos in parallel worker processes.

The processes are `datasets.probe.run_pool`'s: spawned, so they are safe to start from a process
holding torch or Ray threads, and killable, so a decoder that hangs on a file costs one timeout.

This module does not import `datasets.cache` (whose CLI imports this one): it takes the cache as
a `FillableCache`, and each pool process builds its own from the cache's class, root, format and
budget.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from vidtune.datasets.probe import run_pool
from vidtune.datasets.records import VideoInfo
from vidtune.errors import DataError


class FillableCache(Protocol):
    """What filling needs of a clip cache (`datasets.cache.FrameCache` has it): where it is, its
    stored format, its budget, and per video whether an entry exists and filling one."""

    root: Path
    format: str                        # stored format: jpeg | raw
    max_bytes: int                     # disk budget
    repairs: int                       # damaged entries this cache object found (and discarded) so far

    def has(self, info: VideoInfo, *, height: int, width: int) -> bool:
        """Whether a readable entry of `info` at `height` x `width` is published."""

    def fill_status(self, info: VideoInfo, *, height: int, width: int) -> tuple[str, int, int]:
        """Make sure the entry exists: (written | cached | over_budget | unwritable, bytes, frames)."""

    def usage_bytes(self) -> int:
        """Bytes of the published entries."""


@dataclass
class FillReport:
    """What `fill_cache` did: counts per outcome, the failures with their reasons, bytes written."""

    written: int = 0                   # entries decoded and written now
    cached: int = 0                    # entries that were already there
    over_budget: int = 0               # not written: the cache would pass --cache-max-gb (or is unwritable)
    repaired: int = 0                  # entries found damaged, decoded again (counted in `written` too)
    # (video, reason): training replaces these by another video of the same class
    failed: list[tuple[Path, str]] = field(default_factory=list)
    bytes_written: int = 0
    frames_written: int = 0
    seconds: float = 0.0

    def summary(self, cache: FillableCache) -> str:
        """A few human-readable lines: outcome counts, disk cost per video and frame, usage."""
        lines = [f"Clip cache {cache.root} ({cache.format}): wrote {self.written} entries "
                 f"({self.bytes_written / 1e9:.3f} GB) in {self.seconds:.1f} s; {self.cached} already cached"
                 + (f"; {self.over_budget} not written (over the {cache.max_bytes / 1e9:g} GB budget, "
                    "these are decoded on every read)" if self.over_budget else "")
                 + (f"; {self.repaired} damaged entries found and decoded again" if self.repaired else "")]
        if self.written:
            lines.append(f"Disk per video {self.bytes_written / self.written / 1e6:.2f} MB, per frame "
                         f"{self.bytes_written / self.frames_written / 1e3:.1f} KB")
        if self.failed:
            lines.append(f"{len(self.failed)} videos failed to decode (training replaces them by another "
                         "video of the same class):")
            lines += [f"  {p}: {reason}" for p, reason in self.failed]
        lines.append(f"Cache usage {cache.usage_bytes() / 1e9:.3f} of {cache.max_bytes / 1e9:g} GB")
        return "\n".join(lines)


_WORKER_CACHES: dict[tuple, FillableCache] = {}   # per pool process: keeps its usage view between tasks


def _fill_task(cache_type: Callable[..., FillableCache], root: str, fmt: str, max_bytes: int,
               info: VideoInfo, height: int, width: int) -> tuple[str, int, int, int]:
    """In a pool process: fill `info`'s entry through this process's cache of (type, root, format,
    budget); (outcome, bytes, frames, damaged entries found). The class travels by reference, not
    the parent's cache with every meta.json it read."""
    key = (cache_type, root, fmt, max_bytes)
    cache = _WORKER_CACHES.get(key)
    if cache is None:
        cache = _WORKER_CACHES[key] = cache_type(root, format=fmt, max_gb=max_bytes / 1e9)
    before = cache.repairs
    return (*cache.fill_status(info, height=height, width=width), cache.repairs - before)


def fill_cache(videos: list[VideoInfo], *, height: int, width: int, cache: FillableCache,
               workers: int | None = None, progress: Callable[[int, int], None] | None = None,
               timeout_s: float = 600.0) -> FillReport:
    """Decode every video of `videos` into `cache` at `height` x `width`, in `workers` processes
    (default: one per core, at most 8; each decodes with one thread). A video whose decode takes
    over `timeout_s` has its worker killed and is reported as failed. `progress(done, total)`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = workers or min(cores, 8)
    t0 = time.perf_counter()
    report = FillReport()
    repairs_before = cache.repairs
    todo = []
    for v in videos:   # entries already there are counted here: no worker processes (seconds to start)
        try:
            cached = cache.has(v, height=height, width=width)
        except DataError:
            cached = False        # a missing file: the worker reports why
        if cached:
            report.cached += 1
        else:
            todo.append(v)
    report.repaired = cache.repairs - repairs_before   # a damaged entry is a miss: filled below
    done = [report.cached]

    def on_done(_: int) -> None:
        done[0] += 1
        if progress:
            progress(done[0], len(videos))

    tasks = [(type(cache), str(cache.root), cache.format, cache.max_bytes, v, height, width) for v in todo]
    outcomes = (run_pool(_fill_task, tasks, timeout_s=timeout_s, workers=workers, on_done=on_done)
                if todo else [])
    if progress and not todo:
        progress(len(videos), len(videos))
    for video, (kind, value) in zip(todo, outcomes, strict=True):
        if kind == "ok":
            outcome, size, frames, repaired = value
            report.repaired += repaired
            key = "over_budget" if outcome == "unwritable" else outcome
            setattr(report, key, getattr(report, key) + 1)
            report.bytes_written += size
            report.frames_written += frames
        elif kind == "timeout":
            report.failed.append((video.path, f"decoding took longer than {timeout_s:g} s; "
                                              "its worker was killed"))
        elif kind == "crashed":
            report.failed.append((video.path, f"the decoder crashed (worker exit code {value})"))
        else:
            report.failed.append((video.path, str(value).removeprefix("DataError: ")))
    report.seconds = time.perf_counter() - t0
    return report
