"""Links in a data folder: each real folder and video is read once, with the label of the path
it was first reached by; a link back up the tree, a loop or a second link is named and not
followed; one video under two classes or two splits is an error naming both paths.

Discovery never opens a video, so the files are a few placeholder bytes.
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import VideoIndex
from vidtune.datasets.layouts import discover
from vidtune.errors import DataError


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def class_folders(root: Path, n: int = 16) -> Path:
    for name in ("Violence", "NonViolence"):
        for i in range(n):
            touch(root / name / f"{name[:3]}_{i:02d}.mp4")
    return root


def per_class(disc) -> Counter:
    return Counter(disc.class_names[it.label] for it in disc.items)


def test_a_link_to_the_parent_and_a_loop_add_nothing_and_are_named(tmp_path):
    """The issue's tree: 32 videos, `Violence/up -> ..` and a loop `a -> b -> a`: 32 videos,
    each labelled by its own class folder, and one note per link not followed."""
    root = class_folders(tmp_path / "data")
    os.symlink("..", root / "Violence" / "up")
    (root / "Violence" / "a").mkdir()
    (root / "Violence" / "b").mkdir()
    os.symlink("../b", root / "Violence" / "a" / "to_b")
    os.symlink("../a", root / "Violence" / "b" / "to_a")
    os.symlink("loop2", root / "NonViolence" / "loop1")     # a link cycle: leads nowhere
    os.symlink("loop1", root / "NonViolence" / "loop2")
    disc = discover(DataConfig(root=str(root), layout="class_folders"))
    assert per_class(disc) == {"Violence": 16, "NonViolence": 16}
    assert len({it.path.resolve() for it in disc.items}) == 32
    assert all(it.path.parent.name == disc.class_names[it.label] for it in disc.items)
    notes = "\n".join(disc.links)
    assert f"{root / 'Violence' / 'up'}: a link back to {root.resolve()}" in notes
    assert "the same folder as" in notes and "to_a" in notes       # the loop closes once, named
    assert f"{root / 'NonViolence' / 'loop1'}: a link that leads nowhere" in notes
    assert "loop2" in notes and len(disc.links) == 5   # up, a/to_b, b/to_a, loop1, loop2


def test_the_index_summary_names_every_link_not_followed(tmp_path):
    root = class_folders(tmp_path / "data")
    os.symlink("..", root / "Violence" / "up")
    disc = discover(DataConfig(root=str(root), layout="class_folders"))
    index = VideoIndex(disc.layout, disc.class_names, [], [], [], root, links=disc.links)
    summary = index.summary()
    assert "Links not followed (1; each folder and video is read once):" in summary
    assert f"  {root / 'Violence' / 'up'}: a link back to" in summary


def test_a_second_link_to_the_same_video_in_its_class_is_read_once(tmp_path):
    root = class_folders(tmp_path / "data")
    os.symlink("Vio_00.mp4", root / "Violence" / "again.mp4")
    elsewhere = touch(tmp_path / "store" / "extra.mp4")            # kept elsewhere, linked in: used
    os.symlink(elsewhere, root / "Violence" / "extra.mp4")
    disc = discover(DataConfig(root=str(root), layout="class_folders"))
    assert per_class(disc) == {"Violence": 17, "NonViolence": 16}
    assert disc.links == [f"{root / 'Violence' / 'again.mp4'}: the same video as "
                          f"{root / 'Violence' / 'Vio_00.mp4'}, read already: not used twice"]


def test_a_link_across_classes_is_an_error_naming_both_paths(tmp_path):
    root = class_folders(tmp_path / "data")
    os.symlink("../NonViolence", root / "Violence" / "more")
    with pytest.raises(DataError) as e:
        discover(DataConfig(root=str(root), layout="class_folders"))
    message = str(e.value)
    assert str(root / "Violence" / "more") in message and str(root / "NonViolence") in message
    assert "needs one label" in message


def test_one_video_in_both_splits_is_an_error_naming_both_paths(tmp_path):
    root = tmp_path / "rwf"
    for split in ("train", "val"):
        for name in ("Fight", "NonFight"):
            for i in range(4):
                touch(root / split / name / f"{split}_{name}_{i}.avi")
    os.symlink(root / "train" / "Fight" / "train_Fight_0.avi", root / "val" / "Fight" / "leak.avi")
    with pytest.raises(DataError) as e:
        discover(DataConfig(root=str(root), layout="rwf2000"))
    message = str(e.value)
    assert str(root / "val" / "Fight" / "leak.avi") in message
    assert str(root / "train" / "Fight" / "train_Fight_0.avi") in message and "needs one split" in message
