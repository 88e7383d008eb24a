"""The index: probing real video files in worker processes, dropping bad ones, the cache, the CLI."""
from __future__ import annotations

import json
import operator
import os
import shutil
import time
import zlib
from pathlib import Path

import av
import numpy as np
import pytest

import vidtune.datasets.index as index_mod
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index, main, run_pool
from vidtune.datasets.layouts import discover
from vidtune.datasets.splitting import stratified_split
from vidtune.errors import DataError

GOOD_FRAMES = 12


def write_video(path: Path, frames: int = GOOD_FRAMES, *, codec: str = "libx264", width: int = 64,
                height: int = 48, fps: int = 10, options: dict | None = None) -> Path:
    """A small real video of random frames (random so that damage to it cannot be concealed),
    seeded by its path: two files are two videos, not copies (datasets.duplicates finds those)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([frames, zlib.crc32(str(path).encode())])
    with av.open(str(path), "w", options=options or {}) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            img = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        container.mux(stream.encode())
    return path


def write_overstated(path: Path) -> Path:
    """An mp4 whose index (moov, at the front) claims 40 frames but whose last fifth is zeroed."""
    write_video(path, 40, options={"movflags": "faststart"})
    data = bytearray(path.read_bytes())
    cut = int(len(data) * 0.8)
    data[cut:] = bytes(len(data) - cut)
    path.write_bytes(bytes(data))
    return path


def write_audio_only(path: Path, codec: str = "aac") -> Path:
    """A media file with one audio stream (AAC or 16-bit PCM) and no video stream."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pcm = codec.startswith("pcm")
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=16000)
        stream.layout = "mono"
        for i in range(8):
            samples = rng.uniform(-0.1, 0.1, (1, 1024))
            data = (samples * 32767).astype(np.int16) if pcm else samples.astype(np.float32)
            frame = av.AudioFrame.from_ndarray(data, format="s16" if pcm else "fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, i * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


@pytest.fixture(scope="module")
def messy(tmp_path_factory) -> Path:
    """RWF-2000 layout: 8 good videos, a text file named .mp4, a 0-byte .avi, a 4-frame video,
    and an mp4 that over-states its frames."""
    root = tmp_path_factory.mktemp("messy") / "rwf"
    for split, cls, name in [("train", "Fight", "f1.mp4"), ("train", "Fight", "clip é 1.mp4"),
                             ("train", "NonFight", "n1.mp4"), ("val", "Fight", "f2.mp4"),
                             ("val", "NonFight", "n2.mp4"), ("val", "NonFight", "監視 3.mp4")]:
        write_video(root / split / cls / name)
    write_video(root / "train" / "NonFight" / "n4.AVI", codec="mpeg4")
    (root / "train" / "Fight" / "notes.mp4").write_text("this is not a video\n")
    (root / "train" / "Fight" / "empty.avi").write_bytes(b"")
    write_video(root / "train" / "NonFight" / "short.MP4", frames=4)
    write_overstated(root / "val" / "Fight" / "damaged.mp4")
    return root


def copy_of(root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(root, tmp_path / "data"))   # copy2 keeps the mtimes


def names(videos) -> set[str]:
    return {v.path.name for v in videos}


def test_good_videos_are_indexed_and_bad_ones_listed_with_reasons(messy):
    idx = build_index(DataConfig(root=str(messy)), workers=2, use_cache=False)

    assert idx.layout == "rwf2000" and idx.class_names == {1: "Fight", 0: "NonFight"}
    assert names(idx.train) == {"f1.mp4", "clip é 1.mp4", "n1.mp4", "n4.AVI"}
    assert names(idx.val) == {"f2.mp4", "n2.mp4", "監視 3.mp4", "damaged.mp4"}
    f1 = next(v for v in idx.train if v.path.name == "f1.mp4")
    assert (f1.label, f1.split, f1.num_frames, f1.fps, f1.width, f1.height) == (1, "train", 12, 10.0, 64, 48)
    assert f1.duration_s == pytest.approx(1.2)

    reasons = {d.path.name: d.reason for d in idx.dropped}
    assert set(reasons) == {"notes.mp4", "empty.avi", "short.MP4"}
    assert reasons["notes.mp4"].startswith("cannot be opened as a video")
    assert reasons["empty.avi"] == "empty file (0 bytes)"
    assert reasons["short.MP4"] == "only 4 frames decode, fewer than min_frames=8 (--min-frames)"

    damaged = next(v for v in idx.val if v.path.name == "damaged.mp4")
    (path, claimed, decodable), = idx.overstated
    assert path == damaged.path and claimed == 40 and 8 <= decodable == damaged.num_frames < 40

    text = idx.summary()
    for rel, reason in [("train/Fight/notes.mp4", reasons["notes.mp4"]),
                        ("train/Fight/empty.avi", "empty file"),
                        ("train/NonFight/short.MP4", "only 4 frames decode")]:
        assert f"  {rel}: {reason}" in text
    assert f"val/Fight/damaged.mp4: {decodable} of 40 frames" in text
    assert "(cache off)" in text and not (messy / index_mod.CACHE_FILE).exists()
    assert idx.probed == 11 and idx.cached == 0


def test_cache_hit_skips_probing_and_only_changed_files_are_probed_again(messy, tmp_path, monkeypatch):
    root = copy_of(messy, tmp_path)
    probed: list[list[str]] = []
    real = index_mod._probe_files

    def counting(paths, **kw):
        probed.append(sorted(p.name for p in paths))
        return real(paths, **kw)

    monkeypatch.setattr(index_mod, "_probe_files", counting)
    cfg = DataConfig(root=str(root))
    first = build_index(cfg, workers=2)
    assert len(probed[0]) == 11 and first.cache_path == root / index_mod.CACHE_FILE
    entries = json.loads(first.cache_path.read_text())["entries"]
    assert "train/Fight/notes.mp4" in entries and "error" in entries["train/Fight/notes.mp4"]["probe"]

    second = build_index(cfg, workers=2)
    assert len(probed) == 1, "an unchanged dataset must not be probed again (bad files included)"
    assert (second.train, second.val, second.dropped) == (first.train, first.val, first.dropped)
    assert (second.probed, second.cached) == (0, 11)

    # A lower --min-frames keeps the short video, from the cached frame count.
    assert "short.MP4" in names(build_index(DataConfig(root=str(root), min_frames=4), workers=2).train)
    assert len(probed) == 1

    write_video(root / "train" / "Fight" / "f1.mp4", frames=20)     # changed content and size
    stamp = (root / "val" / "NonFight" / "n2.mp4").stat().st_mtime_ns + 5_000_000_000
    os.utime(root / "val" / "NonFight" / "n2.mp4", ns=(stamp, stamp))  # touched: same size, new mtime
    third = build_index(cfg, workers=2)
    assert probed[1:] == [["f1.mp4", "n2.mp4"]]
    assert next(v.num_frames for v in third.train if v.path.name == "f1.mp4") == 20


def test_cache_falls_back_to_the_user_cache_when_the_dataset_folder_is_not_writable(messy, tmp_path,
                                                                                     monkeypatch):
    root = copy_of(messy, tmp_path)
    (root / index_mod.CACHE_FILE).mkdir()       # the cache file cannot be written there
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    first = build_index(DataConfig(root=str(root)), workers=2)
    assert first.cache_path.parent == tmp_path / "xdg" / "vidtune" and first.cache_path.is_file()
    assert not list((tmp_path / "xdg" / "vidtune").glob("*.tmp")), "temp file left behind"
    second = build_index(DataConfig(root=str(root)), workers=2)
    assert (second.probed, second.cached, second.cache_path) == (0, 11, first.cache_path)


def fake_pool(outcomes_by_name: dict[str, tuple], calls: list):
    def run(fn, tasks, *, timeout_s, workers, on_done=None):
        calls.append(sorted(Path(t[0]).name for t in tasks))
        fine = ("ok", {"num_frames": 12, "claimed_frames": 12, "fps": 10.0, "width": 64, "height": 48})
        return [outcomes_by_name.get(Path(t[0]).name, fine) for t in tasks]
    return run


def test_hung_and_crashed_probes_are_dropped_cached_and_retried_with_a_longer_timeout(messy, tmp_path,
                                                                                       monkeypatch):
    calls: list = []
    outcomes = {"f1.mp4": ("timeout", None), "n1.mp4": ("crashed", -11)}
    monkeypatch.setattr(index_mod, "run_pool", fake_pool(outcomes, calls))
    cfg = DataConfig(root=str(messy), cache_dir=str(tmp_path), probe_timeout_s=5)
    idx = build_index(cfg)
    reasons = {d.path.name: d.reason for d in idx.dropped}
    assert reasons["f1.mp4"].startswith("probe timed out after 5s")
    assert "--probe-timeout-s" in reasons["f1.mp4"]
    assert reasons["n1.mp4"] == "the decoder crashed on this file (worker exit code -11)"
    build_index(cfg)
    assert len(calls) == 1
    build_index(DataConfig(root=str(messy), cache_dir=str(tmp_path), probe_timeout_s=10))
    assert calls[1] == ["f1.mp4"]


def test_manifest_split_without_a_class_in_val_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(index_mod, "run_pool", fake_pool({}, []))
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.mp4").write_bytes(name.encode())
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label,split\na.mp4,Fight,train\nb.mp4,NonFight,train\nc.mp4,NonFight,val\n")
    with pytest.raises(DataError, match=rf"no Fight videos in the val split of {manifest}: add some"):
        build_index(DataConfig(root=str(manifest)), use_cache=False)
    manifest.write_text("path,label,split\na.mp4,Fight,train\nb.mp4,NonFight,train\nc.mp4,Fight,val\n"
                        "d.mp4,NonFight,val\n")
    with pytest.raises(DataError, match=r"(?s)all 1 were dropped:\n  d.mp4: file not found .*fix the paths"):
        build_index(DataConfig(root=str(manifest)), use_cache=False)
    rows = manifest.read_text()
    manifest.write_text(rows + "b.mp4,NonFight,val\n")    # one video in train and val: a leak, refused
    with pytest.raises(DataError, match=r"lines 3 and 6 list the same video with different splits"):
        build_index(DataConfig(root=str(manifest)), use_cache=False)
    manifest.write_text(rows + "b.mp4,NonFight,train\n")  # the same row twice: the first wins
    (tmp_path / "e.mp4").write_bytes(b"e")
    manifest.write_text(manifest.read_text() + "e.mp4,NonFight,val\n")
    idx = build_index(DataConfig(root=str(manifest)), use_cache=False)
    assert [(d.path.name, d.reason.split(" (")[0]) for d in idx.dropped] == [("d.mp4", "file not found")]
    assert "(layout csv, manifest m.csv)" in idx.summary()


def test_pool_kills_stuck_tasks_and_survives_crashes():
    tasks = [(time.sleep, 0.0), (time.sleep, 600.0), (os._exit, 3), (int, "x"), (len, "abc"), (abs, -2)]
    done: list[int] = []
    outcomes = run_pool(operator.call, tasks, timeout_s=3.0, workers=2, on_done=done.append)
    assert outcomes[0] == ("ok", None)
    assert outcomes[1] == ("timeout", None)
    assert outcomes[2] == ("crashed", 3)
    assert outcomes[3][0] == "error" and "ValueError" in outcomes[3][1]
    assert outcomes[4:] == [("ok", 3), ("ok", 2)]
    assert sorted(done) == list(range(len(tasks)))


def test_a_class_emptied_by_dropping_is_an_error_naming_the_files(tmp_path):
    root = tmp_path / "data"
    for split in ("train", "val"):
        write_video(root / split / "NonFight" / "ok.mp4")
    write_video(root / "train" / "Fight" / "ok.mp4")
    (root / "val" / "Fight").mkdir(parents=True)
    (root / "val" / "Fight" / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(100))
    (root / "val" / "Fight" / "zero.mp4").write_bytes(b"")
    with pytest.raises(DataError) as e:
        build_index(DataConfig(root=str(root)), workers=2, use_cache=False)
    msg = str(e.value)
    assert "no usable Fight videos left in the val split" in msg
    assert "val/Fight/broken.mp4: cannot be opened as a video" in msg
    assert "val/Fight/zero.mp4: empty file" in msg


def test_bad_options_are_errors(messy):
    for cfg, flag in [(DataConfig(root=str(messy), min_frames=0), "--min-frames"),
                      (DataConfig(root=str(messy), probe_timeout_s=0), "--probe-timeout-s")]:
        with pytest.raises(DataError, match=flag):
            build_index(cfg)
    with pytest.raises(DataError, match="--workers"):
        build_index(DataConfig(root=str(messy)), workers=0)


def test_cli_prints_the_report_and_exits_1_when_the_data_cannot_be_used(messy, tmp_path, capsys):
    assert main([str(messy), "--index-cache-dir", str(tmp_path), "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "(layout rwf2000)" in out and "Dropped 3 of 11 videos" in out
    assert "train/Fight/empty.avi: empty file (0 bytes)" in out and "train/NonFight/short.MP4: only 4" in out

    assert main([str(messy), "--index-cache-dir", str(tmp_path), "--min-frames", "13"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no usable")
    assert "fewer than min_frames=13" in err and "lower --min-frames" in err

    assert main([str(tmp_path / "missing"), "--no-index-cache"]) == 1
    assert f"{tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    assert main([str(messy), "--positive-class", "Riot", "--no-index-cache"]) == 1
    assert "'Fight', 'NonFight'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([str(messy), "--layout", "bogus"])
    assert e.value.code == 2


def test_generated_dataset_indexes_cleanly(synthetic_root, tmp_path):
    idx = build_index(DataConfig(root=str(synthetic_root), cache_dir=str(tmp_path)))
    assert idx.layout == "rwf2000" and not idx.dropped and not idx.overstated
    assert len(idx.train) + len(idx.val) == 48
    cells = {(s, c) for s in ("train", "val") for c in (0, 1)}
    assert {(v.split, v.label) for v in idx.train + idx.val} == cells


# ---------------------------------------------------------------------------------------------
# the split vidtune makes (class folders, manifest without a split column): after probing

def seed_putting_in_val(root: Path, path: Path, val_fraction: float = 0.2) -> int:
    """A --split-seed for which a split drawn over *all* files (before probing) puts `path` in val."""
    disc = discover(DataConfig(root=str(root)))
    pairs = [(it.path, it.label) for it in disc.items]
    return next(seed for seed in range(200)
                if any(it.path == path and it.split == "val"
                       for it in stratified_split(pairs, val_fraction=val_fraction, seed=seed,
                                                  root=disc.root)))


def test_a_broken_file_cannot_take_the_only_val_place_of_a_small_class(tmp_path):
    """Fight has 3 videos, one broken, and the seed is one for which a split over all 3 files gives
    the broken one the single val place: the split is drawn over the 2 usable ones instead."""
    root = tmp_path / "data"
    for cls, prefix in (("Fight", "f"), ("NonFight", "n")):
        for i in range(3):
            write_video(root / cls / f"{prefix}{i}.mp4")
    broken = root / "Fight" / "f1.mp4"
    broken.write_text("not a video\n")
    seed = seed_putting_in_val(root, broken)
    cfg = DataConfig(root=str(root), split_seed=seed, cache_dir=str(tmp_path / "cache"))

    idx = build_index(cfg, workers=2)

    assert idx.layout == "class_folders"
    dropped = [(d.path, d.reason.split(" (")[0]) for d in idx.dropped]
    assert dropped == [(broken, "cannot be opened as a video")]
    fight_val = [v.path for v in idx.val if v.label == 1]
    fight_train = [v.path for v in idx.train if v.label == 1]
    assert len(fight_val) == len(fight_train) == 1 and broken not in fight_val + fight_train
    assert (len(idx.train), len(idx.val)) == (3, 2)
    assert "Dropped 1 of 6 videos" in idx.summary()
    assert "  Fight/f1.mp4: cannot be opened as a video" in idx.summary()
    # Same seed, same split (this time from the cache); the dropped file is still listed.
    again = build_index(cfg, workers=2)
    assert again.cached == 6 and (again.train, again.val, again.dropped) == (idx.train, idx.val, idx.dropped)


def test_manifest_without_split_is_split_over_the_files_that_probe_fine(tmp_path, monkeypatch):
    monkeypatch.setattr(index_mod, "run_pool", fake_pool({"a2.mp4": ("error", "RuntimeError: boom")}, []))
    rows = []
    for label in ("a", "b"):
        for i in range(3):
            (tmp_path / f"{label}{i}.mp4").write_bytes(f"{label}{i}".encode())
            rows.append(f"{label}{i}.mp4,{'Fight' if label == 'a' else 'NonFight'}")
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label\n" + "\n".join(rows + ["a9.mp4,Fight"]) + "\n")  # a9.mp4 is missing
    for seed in range(6):
        idx = build_index(DataConfig(root=str(manifest), split_seed=seed), use_cache=False)
        assert {d.path.name for d in idx.dropped} == {"a2.mp4", "a9.mp4"}
        assert sorted((v.split, v.label) for v in idx.train + idx.val) == [
            ("train", 0), ("train", 0), ("train", 1), ("val", 0), ("val", 1)]


def test_a_class_with_fewer_than_two_usable_videos_to_split_names_the_dropped_files(tmp_path, monkeypatch):
    monkeypatch.setattr(index_mod, "run_pool", fake_pool(
        {"f1.mp4": ("crashed", -11), "f2.mp4": ("ok", {"num_frames": 3, "claimed_frames": 3, "fps": 10.0,
                                                       "width": 64, "height": 48})}, []))
    for cls, prefix in (("Fight", "f"), ("NonFight", "n")):
        for i in range(3):
            (tmp_path / cls).mkdir(exist_ok=True)
            (tmp_path / cls / f"{prefix}{i}.mp4").write_bytes(f"{cls}{prefix}{i}".encode())
    with pytest.raises(DataError) as e:
        build_index(DataConfig(root=str(tmp_path)), use_cache=False)
    msg = str(e.value)
    assert msg.startswith(f"only 1 usable Fight video left in {tmp_path}; at least 2 are needed")
    assert "2 were dropped:\n  Fight/f1.mp4: the decoder crashed" in msg
    assert "\n  Fight/f2.mp4: only 3 frames" in msg
    assert msg.endswith("replace or re-encode these files, or lower --min-frames")


# ---------------------------------------------------------------------------------------------
# reasons

@pytest.mark.parametrize("name, codec", [("sound.mp4", "aac"), ("sound.mkv", "pcm_s16le")])
def test_an_audio_only_file_is_dropped_as_having_no_video_stream(tmp_path, name, codec):
    """decord says only "cannot find video stream with wanted index: -1" (after a C++ check)."""
    root = tmp_path / "data"
    for split in ("train", "val"):
        for cls in ("Fight", "NonFight"):
            write_video(root / split / cls / "ok.mp4")
    write_audio_only(root / "train" / "Fight" / name, codec)
    idx = build_index(DataConfig(root=str(root)), workers=2, use_cache=False)
    assert [(d.path.name, d.reason) for d in idx.dropped] == [(name, "has no video stream (audio only)")]
    assert f"  train/Fight/{name}: has no video stream (audio only)" in idx.summary()

