"""The train/val split of a dataset that does not give one: stratified per class and
deterministic for a seed (each file ranked by a hash of the seed and its relative path)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from vidtune.datasets.config import DataConfig
from vidtune.datasets.records import VideoItem
from vidtune.errors import DataError


def unsplit(pairs: list[tuple[Path, int]], cfg: DataConfig, *, root: Path,
            class_names: dict[int, str]) -> list[VideoItem]:
    """Items with the split still to draw (split ""), after the checks that need no probing."""
    check_split(pairs, val_fraction=cfg.val_fraction, root=root, class_names=class_names)
    return sorted((VideoItem(p, lab, "") for p, lab in pairs), key=lambda it: str(it.path))


def check_split(pairs: list[tuple[Path, int]], *, val_fraction: float, root: Path,
                class_names: dict[int, str] | None) -> None:
    """DataError unless `val_fraction` is in (0, 1) and every class has 2 videos or more (one
    for each side)."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError("val_fraction (--val-fraction) must be between 0 and 1 (exclusive); "
                        f"got {val_fraction}")
    names = class_names or {}
    for label in sorted(set(names) | {lab for _, lab in pairs}):
        n = sum(lab == label for _, lab in pairs)
        if n < 2:
            raise DataError(f"class {names.get(label, label)!r} in {root} has only {n} video"
                            f"{'' if n == 1 else 's'}; at least 2 are needed (one for training, one for "
                            "validation)")


def stratified_split(pairs: list[tuple[Path, int]], *, val_fraction: float, seed: int, root: Path,
                     class_names: dict[int, str] | None = None) -> list[VideoItem]:
    """Split (path, label) pairs into train/val with `val_fraction` of each class in val.

    Deterministic for `seed`: each file is ranked by a hash of (seed, its path relative to
    `root`), so the split does not depend on listing order or machine, and adding (or leaving
    out) one file moves at most one other file between train and val. Every class (of `pairs`,
    and of `class_names` when given) gets at least one video on each side, else DataError.
    """
    check_split(pairs, val_fraction=val_fraction, root=root, class_names=class_names)
    items: list[VideoItem] = []
    for label in sorted({lab for _, lab in pairs}):
        paths = [p for p, lab in pairs if lab == label]
        ranked = sorted(paths, key=lambda p: _rank(seed, p, root))
        n_val = min(max(1, round(len(paths) * val_fraction)), len(paths) - 1)
        items += [VideoItem(p, label, "val") for p in ranked[:n_val]]
        items += [VideoItem(p, label, "train") for p in ranked[n_val:]]
    return sorted(items, key=lambda it: str(it.path))


def _rank(seed: int, path: Path, root: Path) -> str:
    try:
        rel = path.relative_to(root).as_posix()
    except ValueError:
        rel = path.as_posix()
    return hashlib.sha1(f"{seed}\0{rel}".encode()).hexdigest()
