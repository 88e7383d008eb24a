"""Discovery of videos and labels: RWF-2000, class folders, CSV manifests, positive class, split.

Discovery never opens a video, so most files here are a few placeholder bytes.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from vidtune.datasets.config import DataConfig
from vidtune.datasets.labels import is_negative_name, is_positive_name, resolve_positive
from vidtune.datasets.layouts import discover
from vidtune.datasets.splitting import stratified_split
from vidtune.errors import DataError


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def make_class_folders(root: Path, names=("Violence", "NonViolence"), n=10, ext=".mp4") -> Path:
    for name in names:
        for i in range(n):
            touch(root / name / f"{name[:3]}_{i:02d}{ext}")
    return root


def counts(disc, items=None) -> Counter:
    return Counter((it.split, disc.class_names[it.label]) for it in (disc.items if items is None else items))


def drawn(disc, leave_out=()):
    """The items with their split, as the index draws it when every file but `leave_out` probes fine."""
    return disc.split_usable({it.path for it in disc.items} - set(leave_out))


# ---------------------------------------------------------------------------------------------
# RWF-2000

def test_rwf2000_found_with_any_case_extensions_odd_names_and_skipped_files(tmp_path):
    root = tmp_path / "RWF-2000"
    for split, n in (("train", 3), ("val", 2)):
        for cls in ("Fight", "NonFight"):
            for i in range(n):
                touch(root / split / cls / f"{cls}_{i}.avi")
    touch(root / "train" / "Fight" / "UPPER CASE.AVI")
    touch(root / "train" / "Fight" / "caméra nº7 (copie).Mp4")
    touch(root / "val" / "NonFight" / "監視 カメラ.mkv")
    touch(root / "val" / "NonFight" / "clip.MOV")
    touch(root / "val" / "Fight" / "clip.webm")
    touch(root / "train" / "Fight" / ".DS_Store")
    touch(root / "train" / "Fight" / "._clip.avi")              # macOS resource fork: hidden
    touch(root / "train" / "NonFight" / "notes.txt")
    touch(root / "train" / "NonFight" / ".thumbs" / "a.jpg")
    touch(root / "README.md")

    disc = discover(DataConfig(root=str(root)))

    assert disc.layout == "rwf2000"
    assert disc.class_names == {1: "Fight", 0: "NonFight"}
    assert counts(disc) == {("train", "Fight"): 5, ("train", "NonFight"): 3,
                            ("val", "Fight"): 3, ("val", "NonFight"): 4}
    assert disc.split_given and drawn(disc) == disc.items   # the given split is kept as it is
    assert drawn(disc, [root / "val" / "Fight" / "clip.webm"]) == [
        it for it in disc.items if it.path.name != "clip.webm"]
    names = {it.path.name for it in disc.items}
    assert {"UPPER CASE.AVI", "caméra nº7 (copie).Mp4", "監視 カメラ.mkv", "clip.MOV"} <= names
    assert all(it.path.is_file() for it in disc.items)
    assert all(it.label == (1 if it.path.parent.name == "Fight" else 0) for it in disc.items)
    assert disc.skipped == {"hidden file": 2, ".txt file": 1, "file in a hidden folder": 1,
                            "file outside the class folders (in ROOT)": 1}
    assert discover(DataConfig(root=str(root), layout="rwf2000")).items == disc.items


def test_rwf2000_missing_val_folder_is_an_error(tmp_path):
    make_class_folders(tmp_path / "train", ("Fight", "NonFight"), n=2)
    with pytest.raises(DataError, match=r"no val/ folder.*--layout class_folders"):
        discover(DataConfig(root=str(tmp_path)))


def test_rwf2000_class_names_must_match_between_splits(tmp_path):
    make_class_folders(tmp_path / "train", ("Fight", "NonFight"), n=2)
    make_class_folders(tmp_path / "val", ("Violence", "NonViolence"), n=2)
    with pytest.raises(DataError, match="class folders differ") as e:
        discover(DataConfig(root=str(tmp_path)))
    assert "Violence" in str(e.value) and "NonFight" in str(e.value)


def test_explicit_rwf2000_on_class_folders_says_what_is_expected(tmp_path):
    make_class_folders(tmp_path)
    with pytest.raises(DataError, match=r"--layout rwf2000: .* has no train/ folder; expected"):
        discover(DataConfig(root=str(tmp_path), layout="rwf2000"))


# ---------------------------------------------------------------------------------------------
# class folders and the split

def test_class_folders_stratified_split_is_stable_for_a_seed(tmp_path):
    root = make_class_folders(tmp_path / "rlvs", n=20)
    for i in range(10):   # the violent class is larger: stratification keeps both shares
        touch(root / "Violence" / f"extra {i}.MP4")

    disc_a = discover(DataConfig(root=str(root), val_fraction=0.2, split_seed=0))
    disc_b = discover(DataConfig(root=str(root), layout="class_folders", val_fraction=0.2, split_seed=0))
    disc_c = discover(DataConfig(root=str(root), val_fraction=0.2, split_seed=1))

    # Discovery leaves the split to draw: the index draws it after probing (over usable files).
    assert disc_a.layout == "class_folders" and disc_a.class_names == {1: "Violence", 0: "NonViolence"}
    assert not disc_a.split_given and {it.split for it in disc_a.items} == {""}
    a, b, c = drawn(disc_a), drawn(disc_b), drawn(disc_c)
    assert counts(disc_a, a) == {("train", "Violence"): 24, ("val", "Violence"): 6,
                                 ("train", "NonViolence"): 16, ("val", "NonViolence"): 4}
    assert a == b == drawn(discover(DataConfig(root=str(root), val_fraction=0.2, split_seed=0)))
    val_a = {it.path for it in a if it.split == "val"}
    val_c = {it.path for it in c if it.split == "val"}
    assert counts(disc_c, c) == counts(disc_a, a) and val_a != val_c
    half = discover(DataConfig(root=str(root), val_fraction=0.5))
    assert counts(half, drawn(half))[("val", "NonViolence")] == 10


def test_small_class_still_gets_one_val_video_and_a_single_video_class_is_an_error(tmp_path):
    make_class_folders(tmp_path, ("Fight", "NonFight"), n=2)
    disc = discover(DataConfig(root=str(tmp_path), val_fraction=0.1))
    assert counts(disc, drawn(disc)) == {(s, c): 1 for s in ("train", "val") for c in ("Fight", "NonFight")}
    with pytest.raises(DataError, match=r"class 'Fight' .* has only 1 video; at least 2"):
        drawn(disc, [tmp_path / "Fight" / "Fig_00.mp4"])     # as when the index drops one of the two
    (tmp_path / "Fight" / "Fig_01.mp4").unlink()
    with pytest.raises(DataError, match=r"class 'Fight' .* has only 1 video; at least 2"):
        discover(DataConfig(root=str(tmp_path)))


def seed_putting_in_val(disc, path: Path) -> int:
    """A split seed for which the split drawn over *all* files (the old way) puts `path` in val."""
    pairs = [(it.path, it.label) for it in disc.items]
    return next(seed for seed in range(200)
                if any(it.path == path and it.split == "val"
                       for it in stratified_split(pairs, val_fraction=0.2, seed=seed, root=disc.root)))


def test_split_is_drawn_over_the_usable_videos_only(tmp_path):
    """A class of 3 videos, one broken: drawn over all 3, the broken one could take the only val
    place; drawn over the 2 usable ones, each side gets a usable video."""
    make_class_folders(tmp_path, ("Fight", "NonFight"), n=3)
    broken = tmp_path / "Fight" / "Fig_01.mp4"
    seed = seed_putting_in_val(discover(DataConfig(root=str(tmp_path))), broken)
    disc = discover(DataConfig(root=str(tmp_path), val_fraction=0.2, split_seed=seed))
    items = drawn(disc, [broken])
    assert broken not in {it.path for it in items}
    assert counts(disc, items) == {("train", "Fight"): 1, ("val", "Fight"): 1,
                                   ("train", "NonFight"): 2, ("val", "NonFight"): 1}
    assert drawn(disc, [broken]) == items          # same seed, same usable files: same split


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_adding_or_leaving_out_a_file_moves_at_most_one_other_file(tmp_path, seed):
    """The rank of a file is a hash of (seed, its relative path): a new file (or one the probe
    drops) takes or frees one place in its class, so at most one other file changes sides."""
    root = make_class_folders(tmp_path, n=12)

    def sides(leave_out=()):
        disc = discover(DataConfig(root=str(root), val_fraction=0.25, split_seed=seed))
        return {it.path: it.split for it in drawn(disc, leave_out)}

    before = sides()
    moved_total = 0
    for i in range(8):                                 # class sizes 13..20: n_val changes on the way
        touch(root / "Violence" / f"new {i}.mp4")
        after = sides()
        moved = [p for p in before if after[p] != before[p]]
        assert len(moved) <= 1, moved
        moved_total += len(moved)
        before = after
    assert moved_total < 8                             # mostly nothing moves
    for gone in list(before)[:10]:                     # a file dropped at probing: the same bound
        after = sides([gone])
        assert sum(after[p] != before[p] for p in after) <= 1


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_val_fraction_out_of_range_is_an_error(tmp_path, fraction):
    make_class_folders(tmp_path)
    with pytest.raises(DataError, match=rf"--val-fraction.*got {fraction}"):
        discover(DataConfig(root=str(tmp_path), val_fraction=fraction))


def test_lone_wrapper_folder_is_stepped_into(tmp_path):
    make_class_folders(tmp_path / "Real Life Violence Dataset")
    disc = discover(DataConfig(root=str(tmp_path)))
    assert disc.layout == "class_folders" and disc.root == (tmp_path / "Real Life Violence Dataset").resolve()


# ---------------------------------------------------------------------------------------------
# positive class

@pytest.mark.parametrize("names, positive", [
    (["Fight", "NonFight"], "Fight"),
    (["Violence", "NonViolence"], "Violence"),
    (["violent", "non_violent"], "violent"),
    (["fights", "no_fight"], "fights"),
    (["Assault", "normal"], "Assault"),
    (["FIGHT", "Non-Fight"], "FIGHT"),
    (["Crime", "Normal"], "Crime"),          # negative recognised, the other one is violent
    (["fight", "dance"], "fight"),           # positive recognised, the other need not be
])
def test_positive_class_is_inferred_from_common_names(names, positive):
    labels = resolve_positive(names, None, where="X")
    assert [n for n, lab in labels.items() if lab == 1] == [positive]


def test_name_rules():
    assert is_positive_name("Violent_Videos") and not is_positive_name("NonViolence")
    assert is_negative_name("no fight") and is_negative_name("NotViolent") and not is_negative_name("Fight")


@pytest.mark.parametrize("names", [["cats", "dogs"], ["Fight", "Violence"]])
def test_ambiguous_classes_name_the_folders_and_the_flag(tmp_path, names):
    make_class_folders(tmp_path, names, n=3)
    with pytest.raises(DataError) as e:
        discover(DataConfig(root=str(tmp_path)))
    msg = str(e.value)
    assert all(repr(n) in msg for n in names) and "--positive-class" in msg and str(tmp_path) in msg


def test_positive_class_override_exact_and_case_insensitive(tmp_path):
    make_class_folders(tmp_path, ("cats", "dogs"), n=3)
    for given in ("dogs", "DOGS"):
        disc = discover(DataConfig(root=str(tmp_path), positive_class=given))
        assert disc.class_names == {1: "dogs", 0: "cats"}
        assert all((it.label == 1) == (it.path.parent.name == "dogs") for it in disc.items)
    # An override wins over the name rules too.
    make_class_folders(tmp_path / "rwf", ("Fight", "NonFight"), n=3)
    disc = discover(DataConfig(root=str(tmp_path / "rwf"), positive_class="NonFight"))
    assert disc.class_names[1] == "NonFight"


def test_unknown_positive_class_lists_the_classes(tmp_path):
    make_class_folders(tmp_path, n=3)
    with pytest.raises(DataError,
                       match=r"--positive-class 'Fight' is not one of .*'NonViolence', 'Violence'"):
        discover(DataConfig(root=str(tmp_path), positive_class="Fight"))


# ---------------------------------------------------------------------------------------------
# CSV manifest

def write_csv(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_csv_with_split_column_paths_relative_to_its_folder(tmp_path):
    for name in ("a.mp4", "b.mp4", "c.avi", "d é.avi"):
        touch(tmp_path / "clips" / name)
    csv_file = write_csv(tmp_path / "lists" / "mine.csv",
                         "Path,Label,Split\n../clips/a.mp4,Fight,train\n../clips/b.mp4,NonFight,TRAIN\n"
                         "../clips/c.avi,Fight,val\n../clips/d é.avi,NonFight,validation\n"
                         "../clips/a.mp4,Fight,train\n")
    disc = discover(DataConfig(root=str(csv_file)))
    assert disc.layout == "csv" and disc.manifest == csv_file.resolve()
    assert disc.class_names == {1: "Fight", 0: "NonFight"}
    got = {(it.path.name, it.label, it.split) for it in disc.items}
    assert got == {("a.mp4", 1, "train"), ("b.mp4", 0, "train"), ("c.avi", 1, "val"), ("d é.avi", 0, "val")}
    assert all(it.path.is_file() for it in disc.items)
    assert disc.skipped == {"duplicate manifest row": 1}


@pytest.mark.parametrize("rows, what", [("a.mp4,Fight\na.mp4,NonFight\n", "labels"),
                                        ("a.mp4,Fight,train\n./a.mp4,Fight,val\n", "splits")])
def test_csv_rows_that_contradict_each_other_are_named(tmp_path, rows, what):
    """Two rows for one video with different labels (or splits) were made one, silently."""
    for name in ("a.mp4", "b.mp4"):
        touch(tmp_path / name)
    header = "path,label,split\n" if "train" in rows else "path,label\n"
    extra = "b.mp4,NonFight,train\n" if "train" in rows else "b.mp4,NonFight\n"
    csv_file = write_csv(tmp_path / "m.csv", header + extra + rows)
    with pytest.raises(DataError) as e:
        discover(DataConfig(root=str(csv_file)))
    msg = str(e.value)
    expected = f"{csv_file.resolve()}: lines 3 and 4 list the same video with different {what}"
    assert msg.startswith(expected), msg
    first, second = rows.splitlines()
    assert f"line 3: {first}" in msg and f"line 4: {second}" in msg


def test_csv_folder_without_split_column_numeric_labels_stratified(tmp_path):
    rows = []
    for i in range(10):
        touch(tmp_path / "v" / f"{i}.mp4")
        rows.append(f"v/{i}.mp4,{i % 2}")
    write_csv(tmp_path / "manifest.csv", "path,label\n" + "\n".join(rows) + "\n")
    touch(tmp_path / "other.csv", b"a,b\n1,2\n")    # manifest.csv wins over other CSVs

    disc = discover(DataConfig(root=str(tmp_path), val_fraction=0.4))
    assert disc.layout == "csv" and disc.class_names == {1: "1", 0: "0"} and not disc.split_given
    assert counts(disc, drawn(disc)) == {("train", "1"): 3, ("val", "1"): 2,
                                         ("train", "0"): 3, ("val", "0"): 2}
    assert all(it.label == int(it.path.stem) % 2 for it in disc.items)
    assert drawn(discover(DataConfig(root=str(tmp_path), layout="csv", val_fraction=0.4))) == drawn(disc)
    # Drawn over the usable rows only: 4 usable of label 1 -> 2 in val (0.4 of 4, rounded).
    assert counts(disc, drawn(disc, [tmp_path / "v" / "1.mp4"]))[("val", "1")] == 2


def test_csv_windows_paths_and_auto_detected_single_csv(tmp_path):
    touch(tmp_path / "sub" / "x.mp4")
    touch(tmp_path / "sub" / "y.mp4")
    write_csv(tmp_path / "labels.csv", "path,label,split\nsub\\x.mp4,violent,train\nsub\\y.mp4,calm,val\n")
    disc = discover(DataConfig(root=str(tmp_path)))
    assert disc.layout == "csv" and {it.path.name for it in disc.items} == {"x.mp4", "y.mp4"}
    assert disc.class_names == {1: "violent", 0: "calm"}


@pytest.mark.parametrize("text, match", [
    ("file,label\na.mp4,Fight\n", r"header must name the columns path,label.*missing path"),
    ("path,label\n", r"lists no videos"),
    ("path,label,split\na.mp4,Fight,test\nb.mp4,NonFight,val\n",
     r"line 2: split 'test' must be train or val"),
    ("path,label,split\na.mp4,Fight,train\nb.mp4,NonFight,\n", r"line 3: empty split"),
    ("path,label\na.mp4,\n", r"line 2: empty path or label"),
    ("path,label\na.mp4,Fight\nb.mp4,Fight\n", r"one label \(Fight\)"),
    ("path,label\na.mp4,x\nb.mp4,y\nc.mp4,z\n", r"3 labels"),
])
def test_bad_manifest_names_the_csv_and_the_problem(tmp_path, text, match):
    csv_file = write_csv(tmp_path / "m.csv", text)
    with pytest.raises(DataError, match=match) as e:
        discover(DataConfig(root=str(csv_file)))
    assert str(csv_file) in str(e.value)


def test_csv_layout_on_a_folder_with_several_csvs_asks_for_the_file(tmp_path):
    write_csv(tmp_path / "a.csv", "path,label\n")
    write_csv(tmp_path / "b.csv", "path,label\n")
    with pytest.raises(DataError, match=r"several CSV files \(a.csv, b.csv\).*pass the manifest file itself"):
        discover(DataConfig(root=str(tmp_path), layout="csv"))


# ---------------------------------------------------------------------------------------------
# bad input

def test_missing_folder_names_the_path(tmp_path):
    with pytest.raises(DataError, match=rf"{tmp_path / 'nope'} does not exist"):
        discover(DataConfig(root=str(tmp_path / "nope")))


def test_empty_folder_says_where_to_put_videos(tmp_path):
    (tmp_path / ".hidden").mkdir()
    with pytest.raises(DataError, match=rf"{tmp_path} is empty: put the videos in it"):
        discover(DataConfig(root=str(tmp_path)))


def test_one_class_only_lists_the_folders(tmp_path):
    make_class_folders(tmp_path, ("Violence",), n=3)
    (tmp_path / "NonViolence").mkdir()
    (tmp_path / "NonViolence" / "readme.txt").write_text("x")
    with pytest.raises(DataError, match=r"videos of only one class \(class folders: NonViolence/ "
                                        r"\(0 videos\), Violence/ \(3 videos\)\)"):
        discover(DataConfig(root=str(tmp_path)))


def test_three_classes_and_loose_videos_are_errors(tmp_path):
    make_class_folders(tmp_path / "three", ("Fight", "NonFight", "Riot"), n=2)
    with pytest.raises(DataError, match=r"3 class folders with videos .*CSV manifest"):
        discover(DataConfig(root=str(tmp_path / "three")))
    touch(tmp_path / "loose" / "a.mp4")
    touch(tmp_path / "loose" / "b.mp4")
    with pytest.raises(DataError, match=r"no class folders; the 2 videos directly in it need to be sorted"):
        discover(DataConfig(root=str(tmp_path / "loose")))


def test_root_that_is_not_a_csv_and_unknown_layout(tmp_path):
    f = touch(tmp_path / "clip.mp4")
    with pytest.raises(DataError, match=rf"{f} is a file but not a .csv manifest"):
        discover(DataConfig(root=str(f)))
    with pytest.raises(DataError,
                       match=r"unknown layout 'folders' \(--layout\); choose one of auto, rwf2000"):
        discover(DataConfig(root=str(tmp_path), layout="folders"))
