"""The clip cache: exact frames, invalidation, atomic publication, budget, damage, counters, CLI."""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import decord
import numpy as np
import pytest
import torch

import vidtune.datasets.cache as cache_module
from vidtune.datasets.cache import FrameCache, default_root, resolve_format
from vidtune.datasets.cache_cli import main
from vidtune.datasets.cache_fill import fill_cache
from vidtune.datasets.cache_layout import FRAMES_FILE, META_FILE, check_crc32, file_crc32, load_meta
from vidtune.datasets.config import DataConfig
from vidtune.datasets.decode import read_frames
from vidtune.datasets.records import VideoInfo
from vidtune.datasets.video import VideoClipDataset, build_loader, clips_to_device, collate_clips
from vidtune.errors import DataError
from vidtune.trainer.commands import fill_cache as fill_cache_cli
from vidtune.trainer.models.registry import get_spec

REPO_ROOT = Path(__file__).resolve().parents[1]
SIZE = dict(height=32, width=32)
# JPEG quality 90 on these 32 x 32 frames: the mean abs difference to the decoded frames, per
# pixel and channel in 0..255, stays under this (measured ~1.5-2.5).
JPEG_MEAN_ABS_TOLERANCE = 4.0


def probe(path: Path, label: int, split: str = "train") -> VideoInfo:
    vr = decord.VideoReader(str(path), num_threads=1)
    h, w = vr[0].shape[:2]
    return VideoInfo(path=path, label=label, split=split, num_frames=len(vr), fps=vr.get_avg_fps(),
                     width=w, height=h, duration_s=len(vr) / vr.get_avg_fps())


@pytest.fixture
def videos(synthetic_root, tmp_path) -> list[VideoInfo]:
    """3 Fight + 2 NonFight .mp4 videos (45 frames, 112 px) copied to a folder tests may change."""
    out = []
    for name, label, n in (("Fight", 1, 3), ("NonFight", 0, 2)):
        for src in sorted((synthetic_root / "train" / name).glob("*_*.mp4"))[:n]:
            dst = tmp_path / "videos" / f"{name} {src.name}"
            dst.parent.mkdir(exist_ok=True)
            shutil.copy(src, dst)
            out.append(probe(dst, label))
    return out


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


@pytest.mark.parametrize("fmt", ["raw", "jpeg"])
def test_cached_clip_equals_the_decoded_clip_and_every_frame_is_served(videos, tmp_path, fmt):
    cache = FrameCache(tmp_path / "cache", format=fmt, max_gb=1)
    v = videos[0]
    clip = [3, 5, 7, 9]
    first, hit = cache.read(v, clip, **SIZE)
    assert not hit and first.shape == (4, 32, 32, 3) and first.dtype == np.uint8
    again, hit = cache.read(v, clip, **SIZE)
    assert hit and np.array_equal(again, first)           # a miss returns what the entry holds
    every = list(range(v.num_frames))
    cached, hit = cache.read(v, every, **SIZE)             # any window, any stride: one entry
    assert hit and len(entries(cache.root)) == 1
    decoded = read_frames(v.path, every, **SIZE)
    if fmt == "raw":
        assert np.array_equal(cached, decoded)
    else:
        assert np.abs(cached.astype(np.int16) - decoded).mean() < JPEG_MEAN_ABS_TOLERANCE
    meta = json.loads((entries(cache.root)[0] / META_FILE).read_text())
    assert meta["num_frames"] == v.num_frames == 45 and meta["format"] == fmt
    assert (meta["height"], meta["width"], meta["source"]) == (32, 32, str(v.path.resolve()))


def test_a_changed_file_gets_a_new_entry(videos, tmp_path):
    cache = FrameCache(tmp_path / "cache", format="raw", max_gb=1)
    v, other = videos[0], videos[1]
    cache.read(v, [0, 1], **SIZE)
    old = cache.entry_path(v, **SIZE)
    st = os.stat(v.path)
    os.utime(v.path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))      # touched
    assert cache.entry_path(v, **SIZE) != old
    assert cache.read(v, [0, 1], **SIZE)[1] is False                           # decoded again
    shutil.copy(other.path, v.path)                                            # rewritten
    frames, hit = cache.read(v, [0, 1], **SIZE)
    assert not hit and np.array_equal(frames, read_frames(other.path, [0, 1], **SIZE))
    assert len(entries(cache.root)) == 3 and old.exists()   # old entries stay until cleared


def _writer(root: str, infos: list[VideoInfo], barrier, results) -> None:
    cache = FrameCache(root, format="jpeg", max_gb=1)
    barrier.wait()
    results.put([cache.fill_status(v, **SIZE)[0] for v in infos])


def _reader(root: str, infos: list[VideoInfo], expected: list[np.ndarray], stop, results) -> None:
    """Poll: every entry that is visible must read whole and right, never half written."""
    cache = FrameCache(root, format="jpeg", max_gb=1)
    by_entry = {cache.entry_path(v, **SIZE).name: (v, e) for v, e in zip(infos, expected, strict=True)}
    checked, problems = 0, []
    while not stop.is_set() or checked == 0:
        for entry in entries(Path(root)):
            v, exp = by_entry[entry.name]
            frames, hit = cache.read(v, range(v.num_frames), **SIZE)
            checked += 1
            if not hit or not np.array_equal(frames, exp):
                problems.append(f"{entry.name}: hit={hit}")
    results.put((checked, problems))


def test_concurrent_writers_never_expose_half_an_entry(videos, tmp_path):
    root = str(tmp_path / "cache")
    reference = FrameCache(tmp_path / "reference", format="jpeg", max_gb=1)
    expected = [reference.read(v, range(v.num_frames), **SIZE)[0] for v in videos]
    ctx = multiprocessing.get_context("fork")
    barrier, stop, results, seen = ctx.Barrier(3), ctx.Event(), ctx.Queue(), ctx.Queue()
    # Three writers fill the same five entries at once (two in the same order, so that they race
    # to publish every entry), a fourth process reads whatever is published.
    writers = [ctx.Process(target=_writer, args=(root, videos[k:] + videos[:k], barrier, results))
               for k in (0, 0, 2)]
    reader = ctx.Process(target=_reader, args=(root, videos, expected, stop, seen))
    reader.start()
    for p in writers:
        p.start()
    outcomes = [results.get(timeout=120) for _ in writers]
    stop.set()
    checked, problems = seen.get(timeout=120)
    for p in writers + [reader]:
        p.join(30)
        assert p.exitcode == 0
    assert problems == [] and checked > 0
    assert all(o in ("written", "cached") for run in outcomes for o in run)
    assert sum(o == "written" for run in outcomes for o in run) == len(videos)   # one publication each
    assert len(entries(Path(root))) == len(videos)
    assert not [p for p in Path(root).iterdir() if p.name.startswith(".")]     # no leftovers


def test_the_budget_holds_and_reads_past_it_are_correct_misses(videos, tmp_path):
    entry_bytes = 45 * 32 * 32 * 3 + 1000            # a raw entry: frames + meta.json, roughly
    cache = FrameCache(tmp_path / "cache", format="raw", max_gb=2.5 * entry_bytes / 1e9)
    for v in videos:
        frames, hit = cache.read(v, [0, 10, 20], **SIZE)
        assert not hit and np.array_equal(frames, read_frames(v.path, [0, 10, 20], **SIZE))
    assert len(entries(cache.root)) == 2
    assert cache.usage_bytes() <= cache.max_bytes
    for v in videos:
        frames, hit = cache.read(v, [1, 2], **SIZE)
        assert hit == (cache.entry_path(v, **SIZE).exists())
        assert np.array_equal(frames, read_frames(v.path, [1, 2], **SIZE))
    assert not cache.fill(videos[-1], **SIZE) and cache.fill(videos[0], **SIZE)
    assert cache.fill_status(videos[-1], **SIZE) == ("over_budget", 0, 0)
    # Another process sees the same usage and writes nothing more.
    assert not FrameCache(cache.root, format="raw", max_gb=cache.max_bytes / 1e9).fill(videos[-1], **SIZE)
    assert len(entries(cache.root)) == 2


def test_a_zero_budget_writes_nothing(videos, tmp_path):
    cache = FrameCache(tmp_path / "cache", format="jpeg", max_gb=0)
    for _ in range(2):
        frames, hit = cache.read(videos[0], [2, 3], **SIZE)
        assert not hit and np.array_equal(frames, read_frames(videos[0].path, [2, 3], **SIZE))
    assert not cache.fill(videos[1], **SIZE) and entries(cache.root) == []


def damage_body(entry: Path, fmt: str, fill: str) -> None:
    """Overwrite every frame's bytes with random bytes or zeros, keeping the size, the .npy header
    and each JPEG's start and end markers: what size, shape and header checks let through."""
    meta = json.loads((entry / META_FILE).read_text())
    target = entry / FRAMES_FILE[fmt]
    data = bytearray(target.read_bytes())
    if fmt == "raw":
        spans = [(len(data) - meta["num_frames"] * 32 * 32 * 3, len(data))]
    else:
        spans = [(a + 2, b - 2) for a, b in zip(meta["offsets"], meta["offsets"][1:], strict=False)]
    rng = np.random.default_rng(0)
    for a, b in spans:
        data[a:b] = (rng.integers(0, 256, b - a, dtype=np.uint8).tobytes() if fill == "random"
                     else bytes(b - a))
    target.write_bytes(data)
    assert load_meta(entry, fmt) is not None and len(data) == meta["bytes"]   # the header checks pass


@pytest.mark.parametrize("fmt,damage", [("raw", "truncate"), ("jpeg", "truncate"), ("jpeg", "meta"),
                                        ("raw", "random"), ("raw", "zeros"), ("jpeg", "random"),
                                        ("jpeg", "zeros")])
def test_a_damaged_entry_is_a_miss_and_is_written_again(videos, tmp_path, caplog, fmt, damage):
    cache = FrameCache(tmp_path / "cache", format=fmt, max_gb=1)
    v = videos[0]
    good, _ = cache.read(v, [4, 8], **SIZE)
    entry = cache.entry_path(v, **SIZE)
    if damage in ("random", "zeros"):
        damage_body(entry, fmt, damage)
    else:
        target = entry / (FRAMES_FILE[fmt] if damage == "truncate" else META_FILE)
        with open(target, "r+b") as f:
            f.truncate(target.stat().st_size // 2)
    fresh = FrameCache(cache.root, format=fmt, max_gb=1)     # as another epoch's worker would
    with caplog.at_level(logging.WARNING, logger="vidtune.datasets.cache"):
        # encoded: a jpeg entry's bytes go to the device undecoded, so only the checksum stands guard
        frames, hit = fresh.read(v, [4, 8], encoded=True, **SIZE)
    assert not hit and np.array_equal(frames, good) and fresh.repairs == 1
    assert str(v.path) in caplog.text and "damaged" in caplog.text and str(entry) in caplog.text
    if fmt == "raw":
        assert np.array_equal(frames, read_frames(v.path, [4, 8], **SIZE))    # a fresh decode
    assert json.loads((entry / META_FILE).read_text())["crc32"] == file_crc32(entry / FRAMES_FILE[fmt])
    assert fresh.read(v, [4, 8], **SIZE)[1]                  # rewritten: a hit again
    again = FrameCache(cache.root, format=fmt, max_gb=1)
    frames, hit = again.read(v, [4, 8], **SIZE)
    assert hit and np.array_equal(frames, good) and again.repairs == 0


def test_an_intact_entry_is_checked_once_per_process_and_not_rewritten(videos, tmp_path, monkeypatch):
    checks = []
    monkeypatch.setattr(cache_module, "check_crc32", lambda *a: checks.append(a[0]) or check_crc32(*a))
    writer = FrameCache(tmp_path / "cache", format="raw", max_gb=1)
    v = videos[0]
    good, _ = writer.read(v, [1, 2], **SIZE)
    assert writer.read(v, [3, 4], **SIZE)[1] and checks == []     # the writer took the checksum itself
    entry = writer.entry_path(v, **SIZE)
    before = [os.stat(entry / name).st_ino for name in (".", META_FILE, FRAMES_FILE["raw"])]
    reader = FrameCache(writer.root, format="raw", max_gb=1)
    for _ in range(3):                                           # three epochs of one loader worker
        frames, hit = reader.read(v, [1, 2], **SIZE)
        assert hit and np.array_equal(frames, good)
    assert checks == [entry] and reader.repairs == 0
    assert [os.stat(entry / name).st_ino for name in (".", META_FILE, FRAMES_FILE["raw"])] == before


def test_an_entry_without_a_checksum_is_written_again_once(videos, tmp_path, caplog):
    cache = FrameCache(tmp_path / "cache", format="jpeg", max_gb=1)
    v = videos[0]
    good, _ = cache.read(v, [0, 5], **SIZE)
    entry = cache.entry_path(v, **SIZE)
    meta = json.loads((entry / META_FILE).read_text())
    del meta["crc32"]                                            # as the version before checksums wrote it
    (entry / META_FILE).write_text(json.dumps(meta))
    fresh = FrameCache(cache.root, format="jpeg", max_gb=1)
    with caplog.at_level(logging.WARNING, logger="vidtune.datasets.cache"):
        frames, hit = fresh.read(v, [0, 5], **SIZE)
    assert not hit and np.array_equal(frames, good) and fresh.repairs == 0    # an upgrade, not damage
    assert "without a checksum" in caplog.text
    assert "crc32" in json.loads((entry / META_FILE).read_text())
    assert FrameCache(cache.root, format="jpeg", max_gb=1).read(v, [0, 5], **SIZE)[1]


def test_a_broken_video_is_replaced_by_a_same_class_clip_and_counted(videos, tmp_path, caplog):
    cache = FrameCache(tmp_path / "cache", format="jpeg", max_gb=1)
    ds = VideoClipDataset(videos, num_frames=4, frame_stride=2, train=False, cache=cache, **SIZE)
    expected, _ = ds[1]                                      # the next Fight video
    videos[0].path.write_bytes(b"\x00garbage" * 64)
    with caplog.at_level(logging.WARNING, logger="vidtune.datasets.video"):
        clip, label = ds[0]
    assert label == 1 and torch.equal(clip, expected)
    assert ds.failures == 1 and str(videos[0].path) in caplog.text
    assert (ds.reads, ds.cache_hits) == (3, 1)               # ds[1] miss, ds[0] fails, then hits ds[1]
    assert len(entries(cache.root)) == 1                     # nothing written for the broken file


def test_hits_and_reads_are_counted_across_loader_workers(videos, tmp_path):
    cache = FrameCache(tmp_path / "cache", format="jpeg", max_gb=1)
    ds = VideoClipDataset(videos, num_frames=4, frame_stride=2, train=True, cache=cache, **SIZE)
    loader = build_loader(ds, batch_size=2, train=False, num_workers=2, pin_memory=False)
    epochs = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        assert sum(len(y) for _, y in loader) == len(videos)
        epochs.append((ds.reads, ds.cache_hits))
    n = len(videos)
    assert epochs[0] == (n, 0)                   # first epoch: all misses (each video once)
    assert epochs[1] == (2 * n, n)               # second: all hits (persistent workers, shared counts)


def test_repairs_are_counted_across_loader_workers(videos, tmp_path):
    cache = FrameCache(tmp_path / "cache", format="raw", max_gb=1)
    filled = VideoClipDataset(videos, num_frames=4, frame_stride=2, train=False, cache=cache, **SIZE)
    expected = [filled[i][0] for i in range(len(videos))]
    for v, fill in ((videos[1], "zeros"), (videos[3], "random")):
        damage_body(cache.entry_path(v, **SIZE), "raw", fill)
    ds = VideoClipDataset(videos, num_frames=4, frame_stride=2, train=False, **SIZE,
                          cache=FrameCache(cache.root, format="raw", max_gb=1))
    loader = build_loader(ds, batch_size=1, train=False, num_workers=2, pin_memory=False)
    for epoch in range(2):
        clips = [clip[0] for clip, _ in loader]
        assert all(torch.equal(c, e) for c, e in zip(clips, expected, strict=True))
        assert (ds.cache_repairs, ds.cache_hits) == (2, (epoch + 1) * len(videos) - 2)
    assert filled.cache_repairs == 0


def test_encoded_items_decode_to_the_same_frames(videos, tmp_path):
    cache = FrameCache(tmp_path / "cache", format="jpeg", max_gb=1)
    plain = VideoClipDataset(videos, num_frames=4, frame_stride=2, train=False, cache=cache, **SIZE)
    encoded = VideoClipDataset(videos, num_frames=4, frame_stride=2, train=False, cache=cache, encoded=True,
                               **SIZE)
    first, _ = encoded[0]                        # a miss: decoded tensor even when encoded
    assert isinstance(first, torch.Tensor) and torch.equal(first, plain[0][0])
    expected = torch.stack([plain[i][0] for i in range(len(videos))])     # fills every entry
    items = [encoded[i] for i in range(len(videos))]
    assert all(isinstance(clip, list) and len(clip) == 4 and clip[0].dim() == 1 for clip, _ in items)
    items[1] = plain[1]                          # a mixed batch: one decoded item among JPEG ones
    clips, labels = collate_clips(items)
    assert isinstance(clips, list) and labels.tolist() == [v.label for v in videos]
    out = clips_to_device(clips, "cpu")
    assert out.dtype == torch.uint8 and out.shape == (5, 4, 32, 32, 3) and torch.equal(out, expected)
    loader = build_loader(encoded, batch_size=5, train=False, num_workers=0, pin_memory=False)
    batch, _ = next(iter(loader))
    assert loader.collate_fn is collate_clips and torch.equal(clips_to_device(batch, "cpu"), expected)
    tensors, _ = collate_clips([plain[0], plain[1]])
    assert torch.equal(clips_to_device(tensors, "cpu"), expected[:2])   # all decoded: stacked as usual


def test_from_config_and_default_folder(tmp_path, monkeypatch):
    assert FrameCache.from_config(DataConfig(clip_cache=False)) is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert FrameCache.from_config(DataConfig()).root == tmp_path / "vidtune" / "clips" == default_root()
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_root() == Path.home() / ".cache" / "vidtune" / "clips"
    cache = FrameCache.from_config(DataConfig(clip_cache_dir=str(tmp_path / "c"), clip_cache_format="raw",
                                              clip_cache_max_gb=0.5))
    assert (cache.root, cache.format, cache.max_bytes) == (tmp_path / "c", "raw", 500_000_000)
    assert not (tmp_path / "c").exists()                  # made on the first write only
    for bad, flag in ((dict(clip_cache_format="png"), "--cache-format"),
                      (dict(clip_cache_max_gb=-1), "--cache-max-gb"),
                      (dict(clip_cache_max_gb=float("nan")), "--cache-max-gb")):
        with pytest.raises(ValueError, match=flag):
            FrameCache.from_config(DataConfig(**bad))


@pytest.mark.slow     # two process pools (~6 s each to start: spawn + torch import)
def test_fill_cache_reports_written_cached_and_failed(videos, tmp_path):
    cache = FrameCache(tmp_path / "cache", format="jpeg", max_gb=1)
    videos[4].path.write_bytes(b"not a video")
    report = fill_cache(videos, cache=cache, workers=2, **SIZE)
    assert (report.written, report.cached, report.over_budget) == (4, 0, 0)
    assert [p for p, _ in report.failed] == [videos[4].path] and "Failed to read video" in report.failed[0][1]
    assert report.frames_written == 4 * 45 and report.bytes_written == cache.usage_bytes() > 0
    again = fill_cache(videos[:4], cache=cache, workers=1, **SIZE)
    assert (again.written, again.cached, again.bytes_written) == (0, 4, 0)
    assert "0 entries" in again.summary(cache) and "4 already cached" in again.summary(cache)
    # A damaged entry found while filling is counted, decoded again and said
    meta = cache.entry_path(videos[1], **SIZE) / META_FILE
    meta.write_text(meta.read_text()[:10])
    repaired = fill_cache(videos[:4], cache=cache, workers=1, **SIZE)
    assert (repaired.written, repaired.cached, repaired.repaired) == (1, 3, 1)
    assert "1 damaged entries found and decoded again" in repaired.summary(cache)


@pytest.mark.parametrize("argv,flag", [
    (["--height", "0", "--width", "32"], "--height: got 0"),
    (["--height", "32", "--width", "-1"], "--width: got -1"),
    (["--model", "no_such_model"], "--model no_such_model"),
    (["--model", "tiny", "--height", "32"], "--model"),
    (["--height", "32"], "--width"),
    (["--height", "32", "--width", "32", "--cache-max-gb", "0"], "--cache-max-gb"),
    (["--height", "32", "--width", "32", "--workers", "0"], "--workers"),
    (["--height", "32", "--width", "32", "--format", "png"], "--format"),
])
def test_cli_bad_input_exits_2_naming_the_flag(tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path), "--cache-dir", str(tmp_path / "c"), *argv])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_cli_model_needs_trainer_fill_cache_which_looks_it_up(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    argv = [str(tmp_path / "empty"), "--cache-dir", str(tmp_path / "c")]
    with pytest.raises(SystemExit) as exc:      # the data layer does not know the models
        main([*argv, "--model", "tiny"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "vidtune cache --model tiny" in err and "--height" in err and "--width" in err

    asked = []
    assert main([*argv, "--model", "m"], clip_size_of=lambda name: asked.append(name) or (32, 32)) == 1
    assert asked == ["m"]                       # looked up, then the empty dataset is refused

    spec = get_spec("tiny")
    assert fill_cache_cli.clip_size("tiny") == (spec.height, spec.width)
    assert fill_cache_cli.main([*argv, "--model", "tiny"]) == 1
    with pytest.raises(SystemExit) as exc:
        fill_cache_cli.main([*argv, "--model", "no_such_model"])
    assert exc.value.code == 2 and "--model no_such_model" in capsys.readouterr().err


def test_cli_unusable_dataset_exits_1(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--height", "32", "--width", "32",
                 "--cache-dir", str(tmp_path / "c")]) == 1
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.slow
def test_cli_fills_the_cache_then_finds_it_filled(synthetic_root, tmp_path):
    root = tmp_path / "data"
    for split, name in (("train", "Fight"), ("train", "NonFight"), ("val", "Fight"), ("val", "NonFight")):
        (root / split / name).mkdir(parents=True)
        for src in sorted((synthetic_root / split / name).iterdir())[:2]:
            shutil.copy(src, root / split / name / src.name)
    cmd = [sys.executable, "-m", "vidtune.datasets.cache_cli", str(root), "--height", "32", "--width", "32",
           "--cache-dir", str(tmp_path / "clips"), "--workers", "2"]
    first = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "wrote 8 entries" in first.stdout and "per frame" in first.stdout
    assert len(entries(tmp_path / "clips")) == 8
    assert "8/8" in first.stderr                              # progress (plain lines: not a terminal)
    second = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0
    assert "wrote 0 entries" in second.stdout and "8 already cached" in second.stdout


def test_auto_format_is_jpeg_on_gpus_and_raw_on_the_cpu(tmp_path):
    cfg = DataConfig(root=str(tmp_path), clip_cache_dir=str(tmp_path / "c"))
    assert cfg.clip_cache_format == "auto"
    assert FrameCache.from_config(cfg, on_gpu=True).format == "jpeg"     # the GPU decodes the JPEG bytes
    assert FrameCache.from_config(cfg, on_gpu=False).format == "raw"     # the loader decodes: raw is faster
    assert resolve_format("jpeg", on_gpu=False) == "jpeg"                # an explicit choice stays
    with pytest.raises(DataError, match="--cache-format"):
        resolve_format("png", on_gpu=False)
    assert FrameCache.from_config(DataConfig(clip_cache=False)) is None
