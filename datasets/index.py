"""Probe every video of a dataset once, keep the ones that decode, cache the result.

`build_index(cfg)` runs `layouts.discover`, probes each new or changed file in worker processes
(each probe under `cfg.probe_timeout_s`: decord can hang or crash on a broken file and cannot be
interrupted in-process, so a stuck worker is killed and replaced), leaves out files that cannot
be used (listed with the reason), and caches the probe results keyed by path, size and mtime.

Check a dataset before a long search:  vidtune index ROOT
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vidtune.datasets.cli import add_dataset_arguments, dataset_config, progress_printer, read_options
from vidtune.datasets.config import DataConfig
from vidtune.datasets.duplicates import HASH, find_duplicates
from vidtune.datasets.folder_walk import OWN_FILE_PREFIX
from vidtune.datasets.layouts import discover
from vidtune.datasets.probe import probe_video, run_pool
from vidtune.datasets.records import DroppedVideo, VideoInfo
from vidtune.errors import DataError
from vidtune.flags import ConfigError, add_flags, flag_specs, option

log = logging.getLogger(__name__)

CACHE_VERSION = 1
CACHE_FILE = OWN_FILE_PREFIX + ".json"   # in the dataset folder, hidden from discovery
_MAX_LISTED = 25                         # dropped files named in one error message
_PROBE_KEYS = ("num_frames", "claimed_frames", "fps", "width", "height")



def _probe_files(paths: list[Path], *, timeout_s: float, workers: int,
                 progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Probe result per path, with pool failures turned into {"error": reason}."""
    done = [0]

    def on_done(_: int) -> None:
        done[0] += 1
        if progress:
            progress(done[0], len(paths))

    outcomes = run_pool(probe_video, [(str(p),) for p in paths], timeout_s=timeout_s,
                        workers=workers, on_done=on_done)
    results = []
    for kind, value in outcomes:
        if kind == "ok":
            results.append(value)
        elif kind == "timeout":
            results.append({"error": f"probe timed out after {timeout_s:g}s (the decoder hangs on this "
                                     "file; re-encode it, or raise --probe-timeout-s)",
                            "timeout_s": timeout_s})
        elif kind == "crashed":
            results.append({"error": f"the decoder crashed on this file (worker exit code {value})"})
        else:
            results.append({"error": f"probe failed: {value}"})
    return results


# ---------------------------------------------------------------------------------------------
# the cache: {"version": 1, "entries": {key: {"size", "mtime_ns", "probe"}}}

def cache_paths(cfg: DataConfig, root: Path) -> list[Path]:
    """Where the index cache is read and written, in order of preference."""
    digest = hashlib.sha1(str(root).encode()).hexdigest()[:16]
    if cfg.cache_dir:
        return [Path(cfg.cache_dir).expanduser() / f"index-{digest}.json"]
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vidtune"
    return [root / CACHE_FILE, home / f"index-{digest}.json"]


def _cache_key(path: Path, root: Path) -> str:
    # Relative keys let the cache travel with a dataset folder that is moved or mounted elsewhere.
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable index cache %s (%s)", path, e)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _write_cache(candidates: list[Path], entries: dict[str, dict], root: Path) -> Path | None:
    """Merge `entries` into the first writable cache file, atomically; None if none is writable."""
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Another process (a Ray worker) may have written since we read: keep its entries.
            merged = {k: v for k, v in _read_cache(path).items() if (root / k).exists()}
            merged.update(entries)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"version": CACHE_VERSION, "root": str(root), "entries": merged}, f)
                os.replace(tmp, path)   # atomic: readers see the old or the new file, never half
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            return path
        except OSError as e:
            log.info("cannot write the index cache %s (%s)", path, e)
    log.warning("index cache not written (tried %s)", ", ".join(map(str, candidates)))
    return None


# ---------------------------------------------------------------------------------------------
# the index

@dataclass(frozen=True)
class VideoIndex:
    """The usable videos of a dataset, per split, and the ones left out with the reason."""

    layout: str
    class_names: dict[int, str]          # {1: violent class name, 0: the other}
    train: list[VideoInfo]
    val: list[VideoInfo]
    dropped: list[DroppedVideo]
    root: Path | None = None             # dataset folder; paths in the summary are relative to it
    manifest: Path | None = None         # the CSV manifest (csv layout)
    skipped: dict[str, int] = field(default_factory=dict)       # non-video files: reason -> count
    overstated: list[tuple[Path, int, int]] = field(default_factory=list)  # (path, claimed, decoding)
    probed: int = 0                      # files probed in this build
    cached: int = 0                      # files whose probe came from the cache
    cache_path: Path | None = None
    links: list[str] = field(default_factory=list)   # each link in the data folder not followed, and why
    hashed: int = 0                      # files whose content was hashed in this build (datasets.duplicates)
    duplicates: list[str] = field(default_factory=list)  # each hard link or copy used once, and of what

    def _rel(self, p: Path) -> str:
        return _relative(p, self.root)

    def summary(self) -> str:
        """A human-readable report: layout, counts per split and class, every dropped file."""
        names = [self.class_names[1], self.class_names[0]]
        where = f", manifest {self._rel(self.manifest)}" if self.manifest else ""
        lines = [f"Dataset {self.root}  (layout {self.layout}{where})",
                 f"Violent class (label 1): {names[0]}; other class (label 0): {names[1]}", ""]
        width = max(8, *(len(n) + 2 for n in names))
        lines.append("split".ljust(7) + "".join(n.rjust(width) for n in names) + "total".rjust(8))
        for split, infos in (("train", self.train), ("val", self.val)):
            counts = Counter(v.label for v in infos)
            lines.append(split.ljust(7) + str(counts[1]).rjust(width) + str(counts[0]).rjust(width)
                         + str(len(infos)).rjust(8))
        usable = self.train + self.val
        if usable:
            frames = [v.num_frames for v in usable]
            sizes = Counter(f"{v.width}x{v.height}" for v in usable).most_common(3)
            fps = statistics.median(v.fps for v in usable)
            lines.append(f"\nFrames per video min/median/max {min(frames)}/{int(statistics.median(frames))}/"
                         f"{max(frames)}, median {fps:.3g} fps, sizes "
                         + ", ".join(f"{s} ({n})" for s, n in sizes))
        total = len(usable) + len(self.dropped)
        if self.dropped:
            lines.append(f"\nDropped {len(self.dropped)} of {_plural(total, 'video')} "
                         "(left out; the rest are used):")
            lines += [f"  {self._rel(d.path)}: {d.reason}" for d in self.dropped]
        if self.overstated:
            verb = "decodes" if len(self.overstated) == 1 else "decode"
            lines.append(f"\n{_plural(len(self.overstated), 'video')} {verb} fewer frames than the "
                         "container claims (the decodable count is used):")
            lines += [f"  {self._rel(p)}: {n} of {claimed} frames" for p, claimed, n in self.overstated]
        if self.skipped:
            lines.append("\nSkipped (not used): " + ", ".join(
                f"{n} " + (what if n == 1 else re.sub(r"\b(file|row)\b", r"\1s", what, count=1))
                for what, n in sorted(self.skipped.items())))
        if self.links:
            lines.append(f"\nLinks not followed ({len(self.links)}; each folder and video is read once):")
            lines += [f"  {note}" for note in self.links]
        if self.duplicates:
            lines.append(f"\nVideos found twice, used once ({len(self.duplicates)}; hard links and identical "
                         "copies):")
            lines += [f"  {note}" for note in self.duplicates]
        where = f" ({self.cache_path})" if self.cache_path else " (cache off)"
        hashed = f", {self.hashed} hashed to find copies" if self.hashed else ""
        lines.append(f"\nProbed {_plural(self.probed, 'video')}, {self.cached} from the cache{hashed}{where}")
        return "\n".join(lines)


def _relative(p: Path, root: Path | None) -> str:
    try:
        return p.relative_to(root).as_posix() if root else str(p)
    except ValueError:
        return str(p)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _check_options(cfg: DataConfig, workers: int | None) -> int:
    if cfg.min_frames < 1:
        raise DataError(f"min_frames (--min-frames) must be at least 1; got {cfg.min_frames}")
    if not cfg.probe_timeout_s > 0:
        raise DataError(f"probe_timeout_s (--probe-timeout-s) must be positive; got {cfg.probe_timeout_s}")
    if workers is not None and workers < 1:
        raise DataError(f"workers (--workers) must be at least 1; got {workers}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return workers or min(cores, 8)


def build_index(cfg: DataConfig, *, workers: int | None = None, use_cache: bool = True,
                progress: Callable[[int, int], None] | None = None) -> VideoIndex:
    """Discover, probe (new or changed files only, `workers` processes) and check a dataset.

    Unreadable files and files with fewer than `cfg.min_frames` decodable frames are left out
    and listed in `.dropped`; a DataError is raised only when a split or class ends up empty
    (naming the files dropped from it and why). Where vidtune makes the split (class folders, a
    manifest without a split column) it is drawn after probing, over the usable videos only.
    `progress(done, total)` is called per probe.
    """
    n_workers = _check_options(cfg, workers)
    disc = discover(cfg)
    candidates = cache_paths(cfg, disc.root) if use_cache else []
    cache: dict[str, dict] = {}
    read_from = None
    for path in candidates:
        cache = _read_cache(path)
        if cache:
            read_from = path
            break
    probes: dict[Path, dict] = {}
    stats: dict[Path, os.stat_result] = {}
    todo: list[Path] = []
    for item in disc.items:
        try:
            stats[item.path] = os.stat(item.path)
        except OSError as e:
            probes[item.path] = {"error": f"file not found ({e.strerror})"}
    # One video, one place: hard links and identical copies, before anything is probed
    dups = find_duplicates(disc.items, stats, place=functools.partial(_place, disc),
                           cached_hash=lambda p, st: _cached_hash(cache.get(_cache_key(p, disc.root)), st))
    left_out = {}      # the copies and links left out: only their hashes are cached
    if len(dups.items) < len(disc.items):
        disc = dataclasses.replace(disc, items=dups.items)
        kept = {it.path for it in dups.items}
        left_out = {p: st for p, st in stats.items() if p not in kept}
        stats = {p: st for p, st in stats.items() if p in kept}
    for item in disc.items:
        st = stats.get(item.path)
        if st is None:
            continue
        hit = cache.get(_cache_key(item.path, disc.root))
        if (_valid_entry(hit) and hit["size"] == st.st_size and hit["mtime_ns"] == st.st_mtime_ns
                and hit["probe"].get("timeout_s", cfg.probe_timeout_s) >= cfg.probe_timeout_s):
            probes[item.path] = hit["probe"]
        else:
            todo.append(item.path)
    cached = len(probes) - sum(p not in stats for p in probes)
    if todo:
        for path, result in zip(todo, _probe_files(todo, timeout_s=cfg.probe_timeout_s,
                                                   workers=n_workers, progress=progress), strict=True):
            probes[path] = result
    cache_path = None
    if candidates and (todo or not cache or dups.hashed):
        fresh = {_cache_key(p, disc.root): {"size": stats[p].st_size, "mtime_ns": stats[p].st_mtime_ns,
                                            "probe": probes[p],
                                            **({HASH: dups.hashes[p]} if p in dups.hashes else {})}
                 for p in stats}
        fresh.update({_cache_key(p, disc.root): {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                                 HASH: dups.hashes[p]}
                      for p, st in left_out.items() if p in dups.hashes})
        cache_path = _write_cache(candidates, fresh, disc.root)
    elif candidates:
        cache_path = read_from
    for note in dups.notes:
        log.warning("%s", note)
    return _assemble(disc, probes, cfg, probed=len(todo), cached=cached, cache_path=cache_path,
                     hashed=dups.hashed, duplicates=dups.notes)


def _place(disc, item) -> str:
    """Where `item` sits as the user sees it: `train/Fight`, or `Violence` before the split."""
    name = disc.class_names[item.label]
    return f"{item.split}/{name}" if item.split else name


def _cached_hash(entry: Any, st: os.stat_result) -> str | None:
    """The content hash a cache entry holds for this very file (same size and mtime), else None."""
    if not isinstance(entry, dict):
        return None
    digest = entry.get(HASH)
    if (entry.get("size"), entry.get("mtime_ns")) != (st.st_size, st.st_mtime_ns):
        return None
    return digest if isinstance(digest, str) else None


def _valid_entry(entry: Any) -> bool:
    """A cache entry as written by this version (a hand-edited or foreign file is re-probed)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("probe"), dict):
        return False
    probe = entry["probe"]
    return ("size" in entry and "mtime_ns" in entry
            and (isinstance(probe.get("error"), str) or all(k in probe for k in _PROBE_KEYS)))


def _assemble(disc, probes: dict[Path, dict], cfg: DataConfig, **counts) -> VideoIndex:
    usable: dict[Path, dict] = {}
    dropped: list[DroppedVideo] = []
    overstated = []
    item_of = {item.path: item for item in disc.items}
    for item in disc.items:
        r = probes[item.path]
        if "error" in r:
            dropped.append(DroppedVideo(item.path, r["error"]))
        elif r["num_frames"] < cfg.min_frames:
            dropped.append(DroppedVideo(item.path, f"only {r['num_frames']} frames decode, fewer than "
                                                   f"min_frames={cfg.min_frames} (--min-frames)"))
        else:
            usable[item.path] = r
            if r["num_frames"] < r["claimed_frames"]:
                overstated.append((item.path, r["claimed_frames"], r["num_frames"]))
    if not disc.split_given:
        _check_enough_to_split(disc, usable, dropped, item_of)
    infos: list[VideoInfo] = []
    # Where vidtune makes the split it is drawn here, over the usable videos only.
    for item in disc.split_usable(usable):
        r = usable[item.path]
        fps = r["fps"]
        infos.append(VideoInfo(item.path, item.label, item.split, r["num_frames"], fps, r["width"],
                               r["height"], r["num_frames"] / fps if fps > 0 else 0.0))
    index = VideoIndex(disc.layout, disc.class_names, [v for v in infos if v.split == "train"],
                       [v for v in infos if v.split == "val"], dropped, disc.root, disc.manifest,
                       disc.skipped, overstated, **counts, links=disc.links)
    _check_no_empty_cell(index, disc, item_of)
    return index


def _check_enough_to_split(disc, usable: dict[Path, dict], dropped: list[DroppedVideo],
                           item_of: dict) -> None:
    """DataError when a class has fewer than 2 usable videos to split, naming the files dropped from it."""
    for label, name in disc.class_names.items():
        n = sum(item_of[p].label == label for p in usable)
        if n >= 2:
            continue
        lost = [d for d in dropped if item_of[d.path].label == label]
        raise DataError(f"only {n} usable {name} video{'' if n == 1 else 's'} left in "
                        f"{disc.manifest or disc.root}; at least 2 are needed (one for training, one for "
                        f"validation); {len(lost)} {'was' if len(lost) == 1 else 'were'} dropped:\n"
                        + _listing(lost, disc.root))


def _listing(lost: list[DroppedVideo], root: Path | None) -> str:
    """The dropped files (relative to `root`) with their reasons, and what to do about them."""
    listed = "\n".join(f"  {_relative(d.path, root)}: {d.reason}" for d in lost[:_MAX_LISTED])
    more = f"\n  ... and {len(lost) - _MAX_LISTED} more" if len(lost) > _MAX_LISTED else ""
    hints = ["replace or re-encode these files"]
    if any("min_frames" in d.reason for d in lost):
        hints.append("lower --min-frames")
    if any(d.reason.startswith("file not found") for d in lost):
        hints.append("fix the paths (relative to the manifest's folder)")
    return f"{listed}{more}\n" + ", or ".join(hints)


def _check_no_empty_cell(index: VideoIndex, disc, item_of: dict) -> None:
    """DataError when a (split, class) has no usable video, naming the files dropped from it."""
    infos = index.train + index.val
    dropped = index.dropped
    for split in ("train", "val"):
        for label, name in disc.class_names.items():
            if any(v.split == split and v.label == label for v in infos):
                continue
            lost = [d for d in dropped if item_of[d.path].split == split and item_of[d.path].label == label]
            if not lost:
                raise DataError(f"no {name} videos in the {split} split of {disc.manifest or disc.root}: "
                                f"add some (both classes are needed in train and val)")
            raise DataError(f"no usable {name} videos left in the {split} split of "
                            f"{disc.manifest or disc.root}: all {len(lost)} were dropped:\n"
                            + _listing(lost, index.root))


# ---------------------------------------------------------------------------------------------
# CLI

@dataclass(frozen=True)
class IndexOptions:
    """The index CLI's own flags (the dataset's are `add_dataset_arguments`', the index cache's
    folder is `DataConfig.cache_dir`). Named --index-*: --cache-dir / --no-cache are the clip
    cache's everywhere else."""

    workers: int | None = option(None, flag="--workers", metavar="N", ge=1,
                                 help="probe worker processes (default: the number of CPU cores, at most 8)")
    index_cache: bool = option(True, flag="--no-index-cache",
                               help="probe every file again and do not read or write the index cache")


INDEX_CLI_FLAGS = tuple(flag_specs(IndexOptions))
INDEX_CACHE_DIR_FLAG = tuple(s for s in flag_specs(DataConfig) if s.path == "cache_dir")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vidtune index",
        description="Find and check the videos of a dataset before a long search: prints the layout, "
                    "counts per split and class, and every file left out with the reason. Exits 1 "
                    "(with the reason) when the data cannot be used.")
    add_dataset_arguments(p)
    add_flags(p, INDEX_CACHE_DIR_FLAG + INDEX_CLI_FLAGS, group_of=lambda s: "index", suppress=False)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = read_options(IndexOptions, INDEX_CLI_FLAGS, args)
        cfg = dataset_config(args, cache_dir=args.cache_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        index = build_index(cfg, workers=opts.workers, use_cache=opts.index_cache,
                            progress=progress_printer("probe", sys.stderr))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(index.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
