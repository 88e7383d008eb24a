"""A data folder is read once by content (datasets/duplicates.py): a hard link (found by inode, no
byte read) or an identical copy (found by a hash, kept in the index cache) under two classes or in
two splits is an error naming both paths; within one class and split it is used once, said so.
The probe is faked (these files are not videos): what is tested is what reaches it."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import vidtune.datasets.index as index_mod
from vidtune.datasets import duplicates
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index
from vidtune.errors import DataError

FINE = ("ok", {"num_frames": 12, "claimed_frames": 12, "fps": 10.0, "width": 64, "height": 48})


@pytest.fixture
def probed(monkeypatch) -> list[list[str]]:
    """The names each build handed to the probe (a fake one: every file 'decodes')."""
    calls: list[list[str]] = []

    def run(fn, tasks, *, timeout_s, workers, on_done=None):
        calls.append(sorted(Path(t[0]).name for t in tasks))
        return [FINE for _ in tasks]

    monkeypatch.setattr(index_mod, "run_pool", run)
    return calls


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The names whose content was hashed."""
    names: list[str] = []
    real = duplicates.content_hash

    def spy(path: Path) -> str:
        names.append(path.name)
        return real(path)

    monkeypatch.setattr(duplicates, "content_hash", spy)
    return names


def rwf(root: Path, n: int = 3) -> Path:
    """RWF-2000 layout, n distinct small files per (split, class), all of one size (so that every
    file is a candidate copy of every other and must be hashed: the worst case)."""
    for split in ("train", "val"):
        for cls in ("Fight", "NonFight"):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                content = f"{split[0]}{cls[0]}{i}".encode().ljust(64)
                (root / split / cls / f"{cls[0]}{i}.mp4").write_bytes(content)
    return root


def test_distinct_files_of_distinct_sizes_are_not_hashed(tmp_path, probed, hashed):
    root = tmp_path / "d"
    for split in ("train", "val"):
        for cls in ("Fight", "NonFight"):
            (root / split / cls).mkdir(parents=True)
            for i in range(3):
                (root / split / cls / f"{i}.mp4").write_bytes(b"v" * (len(split + cls) * 10 + i))
    idx = build_index(DataConfig(root=str(root)), use_cache=False)
    assert len(idx.train) + len(idx.val) == 12 and not idx.duplicates and hashed == [] and idx.hashed == 0


def test_a_hard_link_under_the_other_class_is_refused_by_inode_without_reading_it(tmp_path, probed,
                                                                                  monkeypatch):
    root = rwf(tmp_path / "d")
    (root / "train" / "Fight" / "F0.mp4").unlink()
    os.link(root / "train" / "NonFight" / "N1.mp4", root / "train" / "Fight" / "F0.mp4")

    def no_read(path: Path) -> str:
        raise AssertionError(f"{path} was read")

    monkeypatch.setattr(duplicates, "content_hash", no_read)
    for cls in ("Fight", "NonFight"):      # every other file of a size of its own: nothing to hash
        for i, p in enumerate(sorted((root / "train" / cls).iterdir())):
            if p.name not in ("F0.mp4", "N1.mp4"):
                p.write_bytes(b"y" * (200 + i + 10 * len(cls)))
    for i, p in enumerate(sorted((root / "val").rglob("*.mp4"))):
        p.write_bytes(b"z" * (300 + i))
    with pytest.raises(DataError) as e:
        build_index(DataConfig(root=str(root)), use_cache=False)
    assert str(e.value) == (
        f"{root}/train/NonFight/N1.mp4 and {root}/train/Fight/F0.mp4 are the same file (hard links), under "
        "train/NonFight/ and train/Fight/: a video needs one label (in two classes its label is a guess); "
        "delete one of them, or replace it with another video")
    assert probed == []                     # refused before any probe


def test_a_hard_link_from_train_into_val_is_a_leak_refused(tmp_path, probed):
    root = rwf(tmp_path / "d")
    os.link(root / "train" / "NonFight" / "N0.mp4", root / "val" / "NonFight" / "N9.mp4")
    with pytest.raises(DataError, match=r"/val/NonFight/N9.mp4 and .*/train/NonFight/N0.mp4 are the same "
                       r"file \(hard links\), under val/NonFight/ and train/NonFight/: a video needs one "
                       r"split \(in two it inflates the validation score\)"):
        build_index(DataConfig(root=str(root)), use_cache=False)


@pytest.mark.parametrize("to, says", [
    ("train/Fight", "under train/NonFight/ and train/Fight/: a video needs one label"),
    ("val/NonFight", "under val/NonFight/ and train/NonFight/: a video needs one split"),
])
def test_an_identical_copy_in_another_class_or_split_is_refused_naming_both(tmp_path, probed, to, says):
    root = rwf(tmp_path / "d")
    copy = root / to / "copy.mp4"
    shutil.copyfile(root / "train" / "NonFight" / "N2.mp4", copy)
    with pytest.raises(DataError) as e:
        build_index(DataConfig(root=str(root)), use_cache=False)
    message = str(e.value)
    assert str(copy) in message and f"{root}/train/NonFight/N2.mp4" in message
    assert "are identical copies (the same content)" in message and says in message
    assert message.endswith("delete one of them, or replace it with another video")


def test_class_folders_a_copy_under_the_other_class_is_refused(tmp_path, probed):
    root = tmp_path / "d"
    for cls in ("Violence", "NonViolence"):
        (root / cls).mkdir(parents=True)
        for i in range(4):
            (root / cls / f"{i}.mp4").write_bytes(f"{cls}{i}".encode().ljust(32))
    shutil.copyfile(root / "NonViolence" / "1.mp4", root / "Violence" / "x.mp4")
    with pytest.raises(DataError, match=r"/Violence/x.mp4 and .*/NonViolence/1.mp4 are identical copies "
                       r"\(the same content\), under Violence/ and NonViolence/: a video needs one label"):
        build_index(DataConfig(root=str(root)), use_cache=False)


def test_within_one_class_and_split_a_link_or_copy_is_used_once_with_a_note(tmp_path, probed, hashed,
                                                                            caplog):
    root = rwf(tmp_path / "d")
    fight = root / "train" / "Fight"
    os.link(fight / "F0.mp4", fight / "link-F0.mp4")
    shutil.copyfile(fight / "F1.mp4", fight / "copy-F1.mp4")
    cache = tmp_path / "cache"
    idx = build_index(DataConfig(root=str(root), cache_dir=str(cache)))
    used = sorted(v.path.name for v in idx.train if v.path.parent == fight)
    assert used == ["F0.mp4", "F1.mp4", "F2.mp4"]          # each once, the first path by sort order
    assert idx.duplicates == [f"{fight}/link-F0.mp4: a hard link to {fight}/F0.mp4: used once",
                              f"{fight}/copy-F1.mp4: an identical copy of {fight}/F1.mp4: used once"]
    assert "Videos found twice, used once (2; hard links and identical copies):" in idx.summary()
    assert "13 hashed to find copies" in idx.summary()
    assert any("used once" in r.getMessage() for r in caplog.records)
    assert "link-F0.mp4" not in probed[0] and "copy-F1.mp4" not in probed[0]    # never probed
    # 12 files of one size + the copy; the link shares F0's inode, so it is not read
    assert len(hashed) == 13 and idx.hashed == 13 and "link-F0.mp4" not in hashed
    entries = json.loads(next(cache.glob("index-*.json")).read_text())["entries"]
    assert entries["train/Fight/F1.mp4"][duplicates.HASH] == duplicates.content_hash(fight / "copy-F1.mp4")
    hashed.clear()
    # The next index reads every hash from the cache (kept with the file's size and mtime)
    again = build_index(DataConfig(root=str(root), cache_dir=str(cache)))
    assert hashed == [] and again.hashed == 0 and again.duplicates == idx.duplicates
    # A changed file (another size and mtime) is no copy any more
    (fight / "copy-F1.mp4").write_bytes(b"changed")
    third = build_index(DataConfig(root=str(root), cache_dir=str(cache)))
    assert hashed == [] and third.duplicates == idx.duplicates[:1]
    (fight / "copy-F1.mp4").write_bytes(b"changed".ljust(64))     # its old size, another mtime: read again
    fourth = build_index(DataConfig(root=str(root), cache_dir=str(cache)))
    assert hashed == ["copy-F1.mp4"] and fourth.duplicates == idx.duplicates[:1]
