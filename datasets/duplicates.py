"""One video, one place: a file reached twice by its inode (a hard link) or by its content (an
identical copy) is found before anything is probed.

A symbolic link is resolved by the folder walk (`datasets.folder_walk`); a hard link has no
target to resolve and a copy is a file of its own, so both passed as two videos: one under
two labels is a label conflict, one in train and val a leak that inflates the score. Here:
files that share (st_dev, st_ino) are one file (no byte read); among the rest, only files whose
size another file shares can be copies, and only those are hashed (`HASH`, computed once and kept
in the index cache with the file's size and mtime: `datasets.index`). Under two labels or two
splits it is a DataError naming both paths; within one class and split the file is used once and
the summary says so.

Cost (bench/index_hashing.py): a dataset of distinct sizes hashes nothing; at worst (every file the
same size) hashing is one more pass over the bytes, about 1.5 GB/s on one core here, beside the
decoder's probe of every file.
"""
from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vidtune.datasets.records import VideoItem
from vidtune.errors import DataError

HASH = "sha256"          # hashlib's: 1.5 GB/s on one core here, blake2b 0.64 (DESIGN notes; the bench)
CHUNK_BYTES = 1 << 20


def content_hash(path: Path) -> str:
    """The file's `HASH` as hex, read in 1 MiB chunks."""
    digest = hashlib.new(HASH)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Duplicates:
    """What `find_duplicates` found: the items to keep (sorted by path, as given), a note per
    file used once, and every content hash known now (cached or computed: `hashed` of them,
    `hashed_bytes` read) for the index cache."""

    items: list[VideoItem]
    notes: list[str] = field(default_factory=list)
    hashes: dict[Path, str] = field(default_factory=dict)
    hashed: int = 0
    hashed_bytes: int = 0


def find_duplicates(items: list[VideoItem], stats: dict[Path, os.stat_result], *,
                    place: Callable[[VideoItem], str],
                    cached_hash: Callable[[Path, os.stat_result], str | None] = lambda p, st: None,
                    hash_file: Callable[[Path], str] | None = None) -> Duplicates:
    """Find hard links and identical copies among `items` (those with an entry in `stats`, their
    `os.stat`). `place(item)` names where it sits as the user sees it (`train/Fight`, `Violence`);
    `cached_hash(path, stat)` answers a hash the cache holds for this size and mtime, else None.
    DataError naming both paths when one video sits in two places; else the later path (by sort
    order) is left out with a note. `hash_file`: `content_hash` unless given."""
    hash_file = hash_file or content_hash
    found = Duplicates(items=[])
    by_inode: dict[tuple[int, int], list[VideoItem]] = defaultdict(list)
    for item in items:
        st = stats.get(item.path)
        by_inode[(st.st_dev, st.st_ino) if st else (-1, id(item))].append(item)
    firsts = [group[0] for group in by_inode.values()]
    dropped = _settle(by_inode.values(), "the same file (hard links)", "a hard link to", place, found)
    by_size: dict[int, list[VideoItem]] = defaultdict(list)
    for item in firsts:     # an empty file is no video (its probe says so), and no copy of one
        if item.path in stats and stats[item.path].st_size > 0:
            by_size[stats[item.path].st_size].append(item)
    by_content: dict[str, list[VideoItem]] = defaultdict(list)
    for group in by_size.values():
        if len(group) < 2:
            continue
        for item in group:
            st = stats[item.path]
            digest = cached_hash(item.path, st)
            if digest is None:
                digest = hash_file(item.path)
                found.hashed += 1
                found.hashed_bytes += st.st_size
            found.hashes[item.path] = digest
            by_content[digest].append(item)
    dropped |= _settle(by_content.values(), "identical copies (the same content)", "an identical copy of",
                       place, found)
    found.items = [it for it in items if it.path not in dropped]
    return found


def _settle(groups, what: str, note: str, place: Callable[[VideoItem], str], found: Duplicates) -> set[Path]:
    """For each group of one video's paths: DataError when they sit in two places, else the
    paths after the first, noted in `found`."""
    dropped: set[Path] = set()
    for group in groups:
        group = sorted(group, key=lambda it: it.path)
        first = group[0]
        for other in group[1:]:
            if (other.label, other.split) != (first.label, first.split):
                split = other.split != first.split and other.label == first.label
                why = ("one split (in two it inflates the validation score)" if split else
                       "one label (in two classes its label is a guess)")
                raise DataError(f"{other.path} and {first.path} are {what}, under {place(other)}/ and "
                                f"{place(first)}/: a video needs {why}; delete one of them, or replace it "
                                "with another video")
            found.notes.append(f"{other.path}: {note} {first.path}: used once")
            dropped.add(other.path)
    return dropped
