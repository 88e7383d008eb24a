"""Find the videos of a dataset and their labels: RWF-2000, class folders or a CSV manifest.

Nothing here opens a video; `datasets.index` probes what `discover` returns.

Layouts (`DataConfig.layout`):
- ``rwf2000``: ``ROOT/{train,val}/{Fight,NonFight}/*.avi`` (any two class folders; the split is given).
- ``class_folders``: ``ROOT/Violence/*.mp4``, ``ROOT/NonViolence/*.mp4`` (any two class folders);
  a stratified train/val split is made, deterministic for `split_seed`.
- ``csv``: a manifest ``path,label[,split]`` with paths relative to the CSV's folder. ROOT is the
  CSV file itself, or a folder holding ``manifest.csv`` or exactly one ``*.csv``.
- ``auto``: ``train/`` + ``val/`` -> rwf2000; else a manifest CSV -> csv; else class_folders.

Where the split is not given (class_folders, csv without a split column) `discover` leaves the
items' split empty and `Discovery.split_usable` draws it later, over the videos that probing
found usable only: a broken file cannot take the only validation place of a small class.
"""
from __future__ import annotations

import csv
import os
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path, PureWindowsPath

from vidtune.datasets.config import LAYOUT_CHOICES, DataConfig
from vidtune.datasets.folder_walk import OWN_FILE_PREFIX, VIDEO_EXTENSIONS, FolderWalk
from vidtune.datasets.labels import names_by_label, resolve_positive
from vidtune.datasets.records import VideoItem
from vidtune.datasets.splitting import stratified_split, unsplit
from vidtune.errors import DataError

LAYOUTS = LAYOUT_CHOICES
TRAIN_DIR_NAMES = ("train",)
VAL_DIR_NAMES = ("val", "valid", "validation")
MANIFEST_NAME = "manifest.csv"

_SPLIT_ALIASES = {"train": "train", "training": "train", "val": "val", "valid": "val",
                  "validation": "val"}


@dataclass(frozen=True)
class Discovery:
    """What `discover` found on disk, before any video is opened."""

    layout: str                                  # rwf2000 | class_folders | csv
    items: list[VideoItem]                       # sorted by path; label 1 = violent; split "" if not given
    class_names: dict[int, str]                  # e.g. {1: "Fight", 0: "NonFight"}
    root: Path                                   # the dataset folder (the CSV's folder for csv)
    manifest: Path | None = None                 # the CSV file (csv layout only)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> number of files not used
    # Set where vidtune makes the split (class_folders, csv without a split column): the items'
    # split is then "" until `split_usable` draws it over the usable videos.
    val_fraction: float | None = None
    split_seed: int = 0
    links: list[str] = field(default_factory=list)   # each link not followed, and why (FolderWalk)

    @property
    def split_given(self) -> bool:
        """True when the split comes from the folders or the manifest (every item has one)."""
        return self.val_fraction is None

    def counts(self) -> dict[tuple[str, int], int]:
        """Number of items per (split, label); split "" where it is still to be drawn."""
        return dict(Counter((it.split, it.label) for it in self.items))

    def split_usable(self, usable: Collection[Path]) -> list[VideoItem]:
        """The items whose path is in `usable` (sorted by path), each with its split.

        A given split is kept as it is. Otherwise the stratified split (`stratified_split`,
        `val_fraction`, `split_seed`) is drawn over these items only, so the files left out
        (broken, too short) take no place in it. DataError when a class has fewer than 2.
        """
        keep = [it for it in self.items if it.path in usable]
        if self.split_given:
            return keep
        return stratified_split([(it.path, it.label) for it in keep], val_fraction=self.val_fraction,
                                seed=self.split_seed, root=self.root, class_names=self.class_names)


def discover(cfg: DataConfig) -> Discovery:
    """Find every video under `cfg.root` with its label and split.

    Raises DataError (naming the path and what to do) for a missing or empty folder, an unknown
    layout, a layout that does not match what is on disk, other than two classes, a class with
    too few videos for a split, or a violent class that cannot be told apart.
    """
    if cfg.layout not in LAYOUTS:
        raise DataError(f"unknown layout {cfg.layout!r} (--layout); choose one of {', '.join(LAYOUTS)}")
    if not str(cfg.root):
        raise DataError("no dataset given: pass the folder holding your videos (or a CSV manifest) as ROOT")
    root = Path(cfg.root).expanduser().resolve()
    if not root.exists():
        raise DataError(f"dataset path {root} does not exist: pass the folder holding your videos "
                        "(or a CSV manifest file)")
    layout = cfg.layout
    if root.is_file():
        if root.suffix.lower() != ".csv":
            raise DataError(f"{root} is a file but not a .csv manifest: pass the dataset folder, "
                            "or a CSV with columns path,label[,split]")
        if layout not in ("auto", "csv"):
            raise DataError(f"{root} is a CSV file but --layout is {layout!r}: use --layout csv or auto")
        return _discover_csv(root, cfg)
    if not any(not p.name.startswith(".") for p in root.iterdir()):
        raise DataError(f"dataset folder {root} is empty: put the videos in it, e.g. "
                        f"{root}/Violence/*.mp4 and {root}/NonViolence/*.mp4 "
                        "(see docs/data.md)")
    root = _unwrap(root)
    if layout == "auto":
        layout = _detect_layout(root)
    if layout == "rwf2000":
        return _discover_rwf2000(root, cfg)
    if layout == "csv":
        return _discover_csv(_find_manifest(root, required=True), cfg)
    return _discover_class_folders(root, cfg)


# ---------------------------------------------------------------------------------------------
# layout detection

def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _is_video(p: Path) -> bool:
    return p.suffix.lower() in VIDEO_EXTENSIONS and not p.name.startswith(".") and p.is_file()


def _unwrap(root: Path) -> Path:
    """Step into a lone wrapper folder, as Kaggle archives unpack (`Real Life Violence Dataset/`)."""
    for _ in range(3):
        entries = [p for p in root.iterdir() if not p.name.startswith(".")]
        dirs = [p for p in entries if p.is_dir()]
        if len(dirs) != 1 or len(entries) != 1:
            return root
        (only,) = dirs
        inner = [p for p in only.iterdir() if not p.name.startswith(".")]
        # A lone class or split folder is a mistake to report, not a wrapper to step into.
        if any(_is_video(p) for p in inner) or _split_name(only.name) is not None:
            return root
        root = only
    return root


def _split_name(name: str) -> str | None:
    low = name.lower()
    if low in TRAIN_DIR_NAMES:
        return "train"
    if low in VAL_DIR_NAMES:
        return "val"
    return None


def _split_dirs(root: Path) -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for d in _visible_dirs(root):
        split = _split_name(d.name)
        if split:
            found.setdefault(split, []).append(d)
    return found


def _detect_layout(root: Path) -> str:
    if _split_dirs(root):
        return "rwf2000"
    if _find_manifest(root, required=False) is not None:
        return "csv"
    return "class_folders"


def _find_manifest(root: Path, *, required: bool) -> Path | None:
    """The manifest of a folder: manifest.csv, else its only *.csv (auto: only one that has path,label)."""
    csvs = sorted(p for p in root.iterdir()
                  if p.is_file() and p.suffix.lower() == ".csv" and not p.name.startswith("."))
    named = [p for p in csvs if p.name.lower() == MANIFEST_NAME]
    if named:
        return named[0]
    if not required:
        csvs = [p for p in csvs if {"path", "label"} <= set(_csv_header(p))]
    if len(csvs) == 1:
        return csvs[0]
    if not required:
        return None
    if not csvs:
        raise DataError(f"--layout csv: no CSV manifest in {root}; write {root / MANIFEST_NAME} with "
                        "columns path,label[,split] or pass the CSV file itself as ROOT")
    raise DataError(f"--layout csv: {root} holds several CSV files ({', '.join(p.name for p in csvs)}) "
                    f"and no {MANIFEST_NAME}; pass the manifest file itself as ROOT")


def _csv_header(path: Path) -> list[str]:
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            return [h.strip().lower() for h in next(csv.reader(f), [])]
    except (OSError, UnicodeDecodeError, csv.Error):
        return []


# ---------------------------------------------------------------------------------------------
# scanning folders

def _count_loose_files(folder: Path, skipped: Counter, where: str) -> None:
    for p in folder.iterdir():
        if not p.is_file() or p.name.startswith(OWN_FILE_PREFIX):
            continue
        skipped["hidden file" if p.name.startswith(".") else f"file outside the class folders ({where})"] += 1


def _discover_class_folders(root: Path, cfg: DataConfig) -> Discovery:
    walk = FolderWalk()
    skipped = walk.skipped
    found = {d.name: walk.scan(d, d.name) for d in _visible_dirs(root)}
    _count_loose_files(root, skipped, "in ROOT")
    classes = _two_classes(found, root, "class_folders", f"{root}/<class>/*.mp4")
    labels = resolve_positive(list(classes), cfg.positive_class, where=str(root))
    pairs = [(p, labels[name]) for name, paths in classes.items() for p in paths]
    items = unsplit(pairs, cfg, root=root, class_names=names_by_label(labels))
    return Discovery("class_folders", items, names_by_label(labels), root, None, dict(skipped),
                     val_fraction=cfg.val_fraction, split_seed=cfg.split_seed, links=walk.links)


def _discover_rwf2000(root: Path, cfg: DataConfig) -> Discovery:
    splits = _split_dirs(root)
    walk = FolderWalk()
    skipped = walk.skipped
    _count_loose_files(root, skipped, "in ROOT")
    tree = f"{root}/{{train,val}}/{{Fight,NonFight}}/*.avi"
    for split in ("train", "val"):
        dirs = splits.get(split, [])
        if not dirs:
            raise DataError(f"--layout rwf2000: {root} has no {split}/ folder; expected {tree} "
                            "(or use --layout class_folders and let vidtune make the split)")
        if len(dirs) > 1:
            raise DataError(f"{root} has several {split} folders ({', '.join(d.name for d in dirs)}); "
                            "keep one")
    per_split: dict[str, dict[str, list[Path]]] = {}
    for split in ("train", "val"):
        sdir = splits[split][0]
        per_split[split] = {d.name: walk.scan(d, f"{sdir.name}/{d.name}") for d in _visible_dirs(sdir)}
        _count_loose_files(sdir, skipped, f"in {sdir.name}/")
        per_split[split] = _two_classes(per_split[split], sdir, "rwf2000", tree)
    train_names, val_names = sorted(per_split["train"]), sorted(per_split["val"])
    if [n.lower() for n in train_names] != [n.lower() for n in val_names]:
        raise DataError(f"class folders differ between {splits['train'][0]} ({', '.join(train_names)}) and "
                        f"{splits['val'][0]} ({', '.join(val_names)}): use the same two names in both")
    labels = resolve_positive(train_names, cfg.positive_class, where=str(splits["train"][0]))
    by_lower = {n.lower(): lab for n, lab in labels.items()}
    items = [VideoItem(p, by_lower[name.lower()], split)
             for split in ("train", "val") for name, paths in per_split[split].items() for p in paths]
    items.sort(key=lambda it: str(it.path))
    return Discovery("rwf2000", items, names_by_label(labels), root, None, dict(skipped), links=walk.links)


def _two_classes(found: dict[str, list[Path]], where: Path, layout: str, tree: str) -> dict[str, list[Path]]:
    """The two class folders of `found` (name -> videos), or a DataError saying what is wrong."""
    with_videos = {n: v for n, v in found.items() if v}
    listing = ", ".join(f"{n}/ ({len(v)} videos)" for n, v in sorted(found.items())) or "none"
    if len(with_videos) == 2:
        return with_videos
    if not found:
        loose = [p.name for p in where.iterdir() if _is_video(p)]
        hint = (f"; the {len(loose)} videos directly in it need to be sorted into two class folders "
                "(or listed in a CSV manifest)") if loose else ""
        raise DataError(f"{where} has no class folders{hint}; expected {tree} ({layout} layout)")
    if len(with_videos) < 2:
        what = "no videos" if not with_videos else "videos of only one class"
        raise DataError(f"{where} holds {what} (class folders: {listing}); a violence classifier needs "
                        f"two classes with videos ({', '.join(sorted(VIDEO_EXTENSIONS))}), e.g. {tree}")
    raise DataError(f"{where} has {len(with_videos)} class folders with videos ({listing}); vidtune "
                    "trains a two-class (violent / not violent) model: keep two folders, or write a CSV "
                    "manifest (path,label[,split]) that maps them to two labels")


# ---------------------------------------------------------------------------------------------
# CSV manifest

def _discover_csv(manifest: Path, cfg: DataConfig) -> Discovery:
    rows = _read_manifest(manifest)
    base = manifest.parent
    seen: dict[Path, tuple[int, str, str, str]] = {}   # path -> its first row (line, raw path, label, split)
    entries: list[tuple[Path, str, str]] = []
    skipped: Counter = Counter()
    for line, raw_path, label, split in rows:
        path = _manifest_path(base, raw_path)
        first = seen.get(path)
        if first is not None:
            if (first[2], first[3]) != (label, split):
                # Keeping either row would train on a label (or split) the other row contradicts.
                what = "labels" if first[2] != label else "splits"
                raise DataError(f"{manifest}: lines {first[0]} and {line} list the same video with "
                                f"different {what}: line {first[0]}: {first[1]},{first[2]}"
                                f"{',' + first[3] if first[3] else ''}; line {line}: {raw_path},{label}"
                                f"{',' + split if split else ''}; keep one of the two rows")
            skipped["duplicate manifest row"] += 1
            continue
        seen[path] = (line, raw_path, label, split)
        entries.append((path, label, split))
    names = sorted({label for _, label, _ in entries})
    if len(names) != 2:
        what = "one label" if len(names) == 1 else f"{len(names)} labels"
        raise DataError(f"{manifest}: the label column holds {what} ({', '.join(names)}); vidtune needs "
                        "exactly two (violent / not violent, as class names or 1/0)")
    positive = cfg.positive_class
    if positive is None and set(names) == {"0", "1"}:
        positive = "1"
    labels = resolve_positive(names, positive, where=str(manifest))
    splits = {split for _, _, split in entries}
    if splits == {""}:
        items = unsplit([(p, labels[lab]) for p, lab, _ in entries], cfg, root=base,
                         class_names=names_by_label(labels))
        return Discovery("csv", items, names_by_label(labels), base, manifest, dict(skipped),
                         val_fraction=cfg.val_fraction, split_seed=cfg.split_seed)
    items = sorted((VideoItem(p, labels[lab], split) for p, lab, split in entries),
                   key=lambda it: str(it.path))
    return Discovery("csv", items, names_by_label(labels), base, manifest, dict(skipped))


def _read_manifest(manifest: Path) -> list[tuple[int, str, str, str]]:
    """Rows (line number, path, label, split or "") of a manifest, checked cell by cell."""
    try:
        with manifest.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = [h.strip().lower() for h in next(reader, [])]
            missing = [c for c in ("path", "label") if c not in header]
            if missing:
                raise DataError(f"{manifest}: the header must name the columns path,label[,split]; found "
                                f"{','.join(header) or 'an empty file'} (missing {', '.join(missing)})")
            col = {name: header.index(name) for name in ("path", "label", "split") if name in header}
            raw = [(reader.line_num, r) for r in reader if any(c.strip() for c in r)]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"cannot read the manifest {manifest}: {e}; save it as UTF-8 CSV") from e
    if not raw:
        raise DataError(f"{manifest} lists no videos: add one row per video (path,label[,split])")
    rows = []
    for line, r in raw:
        cells = {name: (r[i].strip() if i < len(r) else "") for name, i in col.items()}
        if not cells["path"] or not cells["label"]:
            raise DataError(f"{manifest} line {line}: empty path or label; every row needs both")
        split = cells.get("split", "")
        if split:
            if split.lower() not in _SPLIT_ALIASES:
                raise DataError(f"{manifest} line {line}: split {split!r} must be train or val "
                                "(or leave the column out to let vidtune make the split)")
            split = _SPLIT_ALIASES[split.lower()]
        rows.append((line, cells["path"], cells["label"], split))
    blank = [line for line, _, _, split in rows if not split]
    if "split" in col and blank and len(blank) < len(rows):
        raise DataError(f"{manifest} line {blank[0]}: empty split; fill in train or val on every row, "
                        "or on none to let vidtune make the split")
    return rows


def _manifest_path(base: Path, raw: str) -> Path:
    p = Path(raw)
    if "\\" in raw and os.sep == "/" and not (base / p).exists():
        p = Path(*PureWindowsPath(raw).parts)   # a manifest written on Windows
    return (p if p.is_absolute() else base / p).resolve()
