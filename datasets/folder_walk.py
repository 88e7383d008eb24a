"""Walk a dataset's class folders once: every real folder and every video file is read once,
whatever links lead to it.

Links are followed (a dataset may keep its videos elsewhere and link them in), but by their real
path, so that a folder linked back up the tree (`Violence/up -> ..`), a loop (`a -> b -> a`) or a
second link to a folder or video already read adds nothing. Each link not followed is noted, for
the index summary to name. A folder or video reached under two labels or two splits (a link
from `Violence/` into `NonViolence/`, one file in `train/` and `val/`) is a `DataError` naming
both paths: its label or split would be a guess, and a video in both splits inflates the score.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from vidtune.errors import DataError

VIDEO_EXTENSIONS = frozenset({".avi", ".mp4", ".mkv", ".mov", ".webm"})
# Files vidtune writes into a dataset folder itself; never counted as skipped.
OWN_FILE_PREFIX = ".vidtune-index"


@dataclass
class FolderWalk:
    """One discovery's record of what it has read: {real path: (path first reached by, where)}
    for folders and videos, the files it skipped (reason -> count) and a note per link it did not
    follow. `where` names a class folder as the user sees it: `Violence`, or `train/Fight`."""

    dirs: dict[Path, tuple[Path, str]] = field(default_factory=dict)
    videos: dict[Path, tuple[Path, str]] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)
    links: list[str] = field(default_factory=list)

    def scan(self, folder: Path, where: str) -> list[Path]:
        """Every video under the class folder `folder` (recursive, links followed once, sorted by
        path), labelled `where`; other files are counted in `skipped`."""
        if not self._enter(folder, where, inside=None):
            return []
        videos = []
        for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
            here = Path(dirpath)
            hidden = sum(len(fs) for d in dirnames if d.startswith(".") for _, _, fs in os.walk(here / d))
            if hidden:
                self.skipped["file in a hidden folder"] += hidden
            inside = here.resolve()
            dirnames[:] = [d for d in sorted(dirnames)
                           if not d.startswith(".") and self._enter(here / d, where, inside)]
            for name in sorted(filenames):      # sorted: which of two links is "first" is fixed
                video = self._video(here / name, where)
                if video is not None:
                    videos.append(video)
        return sorted(videos)

    def _enter(self, path: Path, where: str, inside: Path | None) -> bool:
        """Whether to read the folder `path` (reached from the real folder `inside`): no when it
        is `inside` itself or a folder that holds it (a link back up the tree) or was read
        already under the same `where`; DataError when it was read under another."""
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):    # a link loop, or a link to nothing
            self.links.append(f"{path}: a link that leads nowhere (a loop or a missing target): not followed")
            return False
        if inside is not None and inside.is_relative_to(real):
            self.links.append(f"{path}: a link back to {real}, a folder it is inside of: not followed")
            return False
        if real in self.dirs:
            first, first_where = self.dirs[real]
            self._same_place(path, first, real, where, first_where, "folder")
            self.links.append(f"{path}: the same folder as {first}, read already: not followed again")
            return False
        self.dirs[real] = (path, where)
        return True

    def _video(self, p: Path, where: str) -> Path | None:
        """`p` if it is a video file read for the first time; else None, counted or noted."""
        name = p.name
        if name.startswith(OWN_FILE_PREFIX):
            return None
        if name.startswith("."):
            self.skipped["hidden file"] += 1
        elif p.is_symlink() and not p.exists():   # os.walk lists a looping or broken link as a file
            self.links.append(f"{p}: a link that leads nowhere (a loop or a missing target): not followed")
        elif p.suffix.lower() not in VIDEO_EXTENSIONS:
            self.skipped[f"{p.suffix.lower()} file" if p.suffix else "file without extension"] += 1
        elif not p.is_file():
            self.skipped["non-regular file"] += 1
        else:
            real = p.resolve()
            if real not in self.videos:
                self.videos[real] = (p, where)
                return p
            first, first_where = self.videos[real]
            self._same_place(p, first, real, where, first_where, "video")
            self.links.append(f"{p}: the same video as {first}, read already: not used twice")
        return None

    @staticmethod
    def _same_place(path: Path, first: Path, real: Path, where: str, first_where: str, what: str) -> None:
        if where == first_where:
            return
        split = where.split("/")[0] != first_where.split("/")[0] and "/" in where
        raise DataError(f"{path} and {first} are the same {what} ({real}), reached under "
                        f"{where}/ and {first_where}/: a video needs one "
                        f"{'split' if split else 'label'}; remove the link (or the copy) from one of them")
