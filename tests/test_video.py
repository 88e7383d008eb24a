"""VideoClipDataset and build_loader: decoded frames, clip sampling, failures, batching."""
from __future__ import annotations

import json
import logging
import pickle
import re
import runpy
import shutil
from pathlib import Path

import decord
import numpy as np
import pytest
import torch
from torchvision.io import encode_jpeg

from vidtune.datasets.decode import read_frames
from vidtune.datasets.records import VideoInfo
from vidtune.datasets.synthetic import write_video
from vidtune.datasets.video import (
    VideoClipDataset,
    build_loader,
    clips_to_device,
    collate_clips,
    sample_indices,
)
from vidtune.errors import DataError
from vidtune.flags import ConfigError
from vidtune.trainer.ray_setup.launch import check_batch_sizes

SMALL = dict(num_frames=4, frame_stride=2, height=32, width=32)


def probe(path: Path, label: int, split: str = "train") -> VideoInfo:
    """A VideoInfo straight from decord (the index module does this for real data)."""
    vr = decord.VideoReader(str(path), num_threads=1)
    h, w = vr[0].shape[:2]
    return VideoInfo(path=path, label=label, split=split, num_frames=len(vr), fps=vr.get_avg_fps(),
                     width=w, height=h, duration_s=len(vr) / vr.get_avg_fps())


def infos(root: Path, split: str = "train") -> list[VideoInfo]:
    out = []
    for name, label in (("Fight", 1), ("NonFight", 0)):
        out += [probe(p, label, split) for p in sorted((root / split / name).iterdir())]
    return out


def ramp_video(path: Path, frames: int, size: int = 32) -> Path:
    """Flat grey frames whose level encodes the frame number (frame k = 10 + 20 k)."""
    clip = np.stack([np.full((size, size, 3), 10 + 20 * k, np.uint8) for k in range(frames)])
    write_video(path, clip, fps=10)
    return path


def frame_numbers(clip: torch.Tensor) -> list[int]:
    return [round((float(f.float().mean()) - 10) / 20) for f in clip]


@pytest.fixture(scope="module")
def train_infos(synthetic_root) -> list[VideoInfo]:
    return infos(synthetic_root, "train")


@pytest.fixture
def small_copy(synthetic_root, tmp_path) -> list[VideoInfo]:
    """3 Fight + 2 NonFight videos copied to a temporary folder that tests may damage."""
    out = []
    for name, label, n in (("Fight", 1, 3), ("NonFight", 0, 2)):
        for src in sorted((synthetic_root / "train" / name).iterdir())[:n]:
            dst = tmp_path / f"{name} {src.name}"
            shutil.copy(src, dst)
            out.append(probe(dst, label))
    return out


def test_item_is_uint8_clip_of_the_requested_size_and_the_right_frames(train_infos):
    ds = VideoClipDataset(train_infos, num_frames=8, frame_stride=2, height=64, width=48, train=False)
    assert len(ds) == len(train_infos) == 38
    for i in (0, len(ds) - 1):
        clip, label = ds[i]
        assert clip.dtype == torch.uint8 and clip.shape == (8, 64, 48, 3)
        assert isinstance(label, int) and label == train_infos[i].label
        # 45 frames, span 15: the centred window starts at 15.
        np.testing.assert_array_equal(ds.clip_indices(i), np.arange(15, 30, 2))
        reader = decord.VideoReader(str(train_infos[i].path), num_threads=1)
        whole = reader.get_batch(list(range(15, 30, 2))).asnumpy()
        resized = torch.nn.functional.interpolate(torch.from_numpy(whole).permute(0, 3, 1, 2).float(),
                                                  size=(64, 48), mode="bilinear", antialias=True)
        assert (clip.permute(0, 3, 1, 2).float() - resized).abs().mean() < 6   # same frames, resized


def test_decoded_frames_are_the_written_frames(tmp_path):
    path = ramp_video(tmp_path / "ramp é 01.mp4", 12)
    ds = VideoClipDataset([probe(path, 1)], num_frames=12, frame_stride=1, height=32, width=32, train=False)
    clip, _ = ds[0]
    expected = torch.from_numpy(np.stack([np.full((32, 32, 3), 10 + 20 * k, np.uint8) for k in range(12)]))
    assert (clip.int() - expected.int()).abs().max() <= 3        # H.264 rounding on flat frames
    assert frame_numbers(clip) == list(range(12))


def test_mp4_and_avi_and_odd_names_all_read(train_infos):
    picked = {}
    for i, v in enumerate(train_infos):
        kind = "odd" if not v.path.name.isascii() or " " in v.path.name else v.path.suffix
        picked.setdefault(kind, i)
    assert set(picked) == {".mp4", ".avi", "odd"}
    ds = VideoClipDataset(train_infos, train=False, **SMALL)
    for i in picked.values():
        assert ds[i][0].shape == (4, 32, 32, 3)
    assert ds.failures == 0


def test_train_jitters_per_epoch_reproducibly_and_val_is_centred(train_infos):
    train = VideoClipDataset(train_infos, num_frames=8, frame_stride=2, height=32, width=32, train=True,
                             seed=1)
    starts = []
    for epoch in range(8):
        train.set_epoch(epoch)
        idx = train.clip_indices(0)
        assert np.all(np.diff(idx) == 2) and idx[0] >= 0 and idx[-1] < 45
        starts.append(int(idx[0]))
    assert len(set(starts)) > 3                                   # the window moves between epochs
    again = VideoClipDataset(train_infos, num_frames=8, frame_stride=2, height=32, width=32, train=True,
                             seed=1)
    again.set_epoch(5)
    assert int(again.clip_indices(0)[0]) == starts[5]             # same (seed, epoch, index), same window
    assert len({int(again.clip_indices(i)[0]) for i in range(10)}) > 3   # items differ within an epoch
    val = VideoClipDataset(train_infos, num_frames=8, frame_stride=2, height=32, width=32, train=False,
                           seed=1)
    seen = set()
    for epoch in range(3):
        val.set_epoch(epoch)
        seen.add(tuple(val.clip_indices(0)))
    assert seen == {tuple(range(15, 30, 2))}


@pytest.mark.parametrize("n,t,stride,expected", [
    (45, 8, 2, list(range(15, 30, 2))),         # room to spare: centred
    (15, 8, 2, list(range(0, 15, 2))),          # exactly one window
    (10, 8, 4, list(range(1, 9))),              # shorter than T*stride: stride shrinks to 1, centred
    (22, 8, 4, list(range(0, 22, 3))),          # stride shrinks to 3
    (5, 8, 2, [0, 1, 1, 2, 2, 3, 3, 4]),        # fewer than T frames: repeated, spread evenly
    (1, 4, 2, [0, 0, 0, 0]),
    (30, 1, 4, [14]),
])
def test_sample_indices_never_leave_the_video(n, t, stride, expected):
    assert sample_indices(n, t, stride, None).tolist() == expected
    rng = np.random.default_rng(0)
    for _ in range(20):
        idx = sample_indices(n, t, stride, rng)
        assert len(idx) == t and idx.min() >= 0 and idx.max() < n and np.all(np.diff(idx) >= 0)


def test_short_videos_give_t_frames_without_error(tmp_path):
    ten = probe(ramp_video(tmp_path / "ten.mp4", 10), 1)
    five = probe(ramp_video(tmp_path / "five.avi", 5), 1)
    for train in (False, True):
        ds = VideoClipDataset([ten, five], num_frames=8, frame_stride=4, height=32, width=32, train=train)
        a, _ = ds[0]
        b, _ = ds[1]
        assert a.shape == b.shape == (8, 32, 32, 3)
        assert np.all(np.diff(frame_numbers(a)) == 1)             # stride shrank to 1
        assert frame_numbers(b) == [0, 1, 1, 2, 2, 3, 3, 4]        # repeated frames, in order
    assert ds.failures == 0


def test_deleted_or_garbage_file_is_replaced_by_same_class_and_counted(small_copy, caplog):
    ds = VideoClipDataset(small_copy, train=False, **SMALL)
    expected_for_0 = ds.read(1)                                   # the next Fight video
    small_copy[0].path.unlink()
    with caplog.at_level(logging.WARNING, logger="vidtune.datasets.video"):
        clip, label = ds[0]
    assert label == 1 and torch.equal(clip, expected_for_0)
    assert ds.failures == 1
    assert str(small_copy[0].path) in caplog.text and "Failed to read video" in caplog.text

    small_copy[3].path.write_bytes(b"\x00garbage" * 64)          # a NonFight file overwritten
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vidtune.datasets.video"):
        clip, label = ds[3]
    assert label == 0 and torch.equal(clip, ds.read(4))
    assert ds.failures == 2 and str(small_copy[3].path) in caplog.text


def test_every_video_of_a_class_failing_raises_naming_the_files(small_copy):
    ds = VideoClipDataset(small_copy, train=True, **SMALL)
    for v in small_copy[3:]:
        v.path.unlink()
    with pytest.raises(DataError, match="every video of class 0") as exc:
        ds[4]
    for v in small_copy[3:]:
        assert str(v.path) in str(exc.value)
    assert ds.failures == 2
    assert ds[0][1] == 1                                          # the other class still reads


def test_failures_in_loader_workers_reach_the_training_process(small_copy):
    small_copy[1].path.unlink()
    ds = VideoClipDataset(small_copy, train=False, **SMALL)
    loader = build_loader(ds, batch_size=2, train=False, num_workers=2, pin_memory=False)
    labels = torch.cat([y for _, y in loader])
    assert labels.tolist() == [1, 1, 1, 0, 0]
    assert ds.failures == 1                                       # counted in a worker, read here


@pytest.mark.parametrize("workers", [0, 2])
def test_build_loader_batch_shapes_and_drop_last(train_infos, workers):
    ds = VideoClipDataset(train_infos[:10], train=True, **SMALL)
    train = build_loader(ds, batch_size=4, train=True, num_workers=workers, pin_memory=False)
    batches = list(train)
    assert len(batches) == 2                                      # 10 clips, drop_last: 4 + 4
    for clips, labels in batches:
        assert clips.shape == (4, 4, 32, 32, 3) and clips.dtype == torch.uint8
        assert labels.shape == (4,) and labels.dtype == torch.int64
    assert train.persistent_workers == (workers > 0)
    val = build_loader(VideoClipDataset(train_infos[:10], train=False, **SMALL), batch_size=4, train=False,
                       num_workers=workers, pin_memory=False)
    assert [len(y) for _, y in val] == [4, 4, 2]                  # val keeps every clip


def test_jitter_is_reproducible_across_workers_and_epoch_reaches_persistent_workers(train_infos):
    def run(workers: int) -> list[torch.Tensor]:
        ds = VideoClipDataset(train_infos[:8], train=True, seed=3, **SMALL)
        # In order (train=False loader) so that only the Dataset's own randomness is compared.
        loader = build_loader(ds, batch_size=4, train=False, num_workers=workers, pin_memory=False)
        out = []
        for epoch in range(3):
            ds.set_epoch(epoch)
            out.append(torch.cat([x for x, _ in loader]))
        return out

    single, multi = run(0), run(2)
    for a, b in zip(single, multi, strict=True):
        assert torch.equal(a, b)          # same clips whichever process decodes them, every epoch
    assert not torch.equal(single[1], single[2])


def test_train_order_is_shuffled_and_reproducible(train_infos):
    def order(seed: int) -> list[list[int]]:
        ds = VideoClipDataset(train_infos, train=True, **SMALL)
        loader = build_loader(ds, batch_size=4, train=True, num_workers=0, pin_memory=False, seed=seed)
        return [list(loader.sampler) for _ in range(2)]

    a = order(0)
    assert a == order(0) and a != order(1)
    assert a[0] != a[1] and a[0] != sorted(a[0])      # a new permutation each epoch


def test_a_given_sampler_orders_the_batches(train_infos):
    """The loader is built once with its (distributed) sampler: train keeps drop_last, val every clip."""
    ds = VideoClipDataset(train_infos, train=True, **SMALL)
    picked = list(range(len(ds)))[::-1][:5]
    loader = build_loader(ds, batch_size=2, train=True, num_workers=0, pin_memory=False, sampler=picked)
    assert list(loader.sampler) == picked and len(loader) == 2          # 5 clips -> 2 full batches
    val = build_loader(ds, batch_size=2, train=False, num_workers=0, pin_memory=False, sampler=picked)
    assert len(val) == 3


def test_read_frames_resizes_where_decord_cannot(train_infos):
    # decord 0.6 fails to resize to a 48 px width from this source; read_frames falls back.
    path = train_infos[0].path
    frames = read_frames(path, [0, 1], height=64, width=48)
    assert frames.shape == (2, 64, 48, 3) and frames.dtype == np.uint8
    assert abs(float(frames.mean()) - float(read_frames(path, [0, 1]).mean())) < 3


def test_read_frames_errors_name_the_file(tmp_path):
    missing = tmp_path / "gone é.mp4"
    with pytest.raises(DataError, match=re.escape(f"Failed to read video {missing}: file not found")):
        read_frames(missing, [0])
    junk = tmp_path / "junk.avi"
    junk.write_bytes(b"not a video")
    with pytest.raises(DataError, match=re.escape(f"Failed to read video {junk}")):
        read_frames(junk, [0], height=32, width=32)
    short = ramp_video(tmp_path / "short.mp4", 3)
    with pytest.raises(DataError, match=re.escape(f"Failed to read video {short}")):
        read_frames(short, [0, 7])


def test_bad_dataset_and_loader_arguments(train_infos):
    with pytest.raises(DataError, match="no videos"):
        VideoClipDataset([], train=True, **SMALL)
    with pytest.raises(ValueError, match="num_frames=0"):
        VideoClipDataset(train_infos, num_frames=0, frame_stride=1, height=32, width=32, train=True)
    with pytest.raises(ValueError, match="frame_stride=-1"):
        VideoClipDataset(train_infos, num_frames=4, frame_stride=-1, height=32, width=32, train=True)
    with pytest.raises(ValueError, match="seed=-2"):
        VideoClipDataset(train_infos, train=True, seed=-2, **SMALL)
    with pytest.raises(ValueError, match="set_epoch"):
        VideoClipDataset(train_infos, train=True, **SMALL).set_epoch(-1)
    broken = [VideoInfo(**{**train_infos[0].__dict__, "num_frames": 0})]
    with pytest.raises(DataError, match=re.escape(str(train_infos[0].path))):
        VideoClipDataset(broken, train=True, **SMALL)
    ds = VideoClipDataset(train_infos[:3], train=True, **SMALL)
    # The one batch-size check (on the driver): drop_last would leave no batch.
    with pytest.raises(ConfigError, match="batch size 4 is more than the 3 training videos"):
        check_batch_sizes((4,), len(ds), 1, flag="--batch-size", workers_flag="--workers")
    with pytest.raises(ValueError, match="batch_size=0"):
        build_loader(ds, batch_size=0, train=False, num_workers=0, pin_memory=False)
    with pytest.raises(ValueError, match="num_workers=-1"):
        build_loader(ds, batch_size=1, train=False, num_workers=-1, pin_memory=False)


def test_dataset_pickles_outside_worker_start(train_infos):
    ds = VideoClipDataset(train_infos[:2], train=True, **SMALL)
    ds.set_epoch(4)
    ds[1]
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.epoch == 4 and copy.failures == 0 and len(copy) == 2
    assert (copy.reads, copy.cache_hits) == (1, 0)               # the counts at pickling time
    assert copy[0][0].shape == (4, 32, 32, 3)
    assert (copy.reads, ds.reads) == (2, 1)                      # fresh counters, not shared


def test_reads_are_counted_without_a_cache_and_the_loader_collates_as_before(small_copy):
    small_copy[1].path.unlink()
    ds = VideoClipDataset(small_copy, train=False, **SMALL)
    loader = build_loader(ds, batch_size=5, train=False, num_workers=0, pin_memory=False)
    assert loader.collate_fn is not collate_clips                # only encoded datasets need it
    clips, _ = next(iter(loader))
    assert isinstance(clips, torch.Tensor) and clips.shape == (5, 4, 32, 32, 3)
    assert (ds.reads, ds.cache_hits, ds.failures) == (6, 0, 1)  # the failed read and its replacement
    assert torch.equal(clips_to_device(clips, "cpu"), clips)


@pytest.mark.slow
def test_data_loading_bench_prints_its_table(capsys, tmp_path):
    bench = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bench" / "data_loading.py"),
                           run_name="bench")
    report = tmp_path / "bench.json"
    assert bench["main"](["--quick", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith("64")]
    assert [r[2] for r in rows] == ["Dataset[i]", "DataLoader,", "DataLoader,"]
    assert all(float(r[-2]) > 0 for r in rows)                   # clips/s measured
    assert "jpeg warm" in out and "raw warm" in out and "KB/frame" in out
    data = json.loads(report.read_text())
    readers = {r["reader"] for r in data["rows"] if r["table"] == "cache"}
    assert {"decord", "jpeg warm", "raw warm", "DataLoader 1w, decord",
            "raw first read (checks crc32)"} <= readers
    assert data["ratios"]["warm_cache_vs_decord"] > 0 and set(data["disk"]) == {"jpeg", "raw"}
    assert data["ratios"]["first_read_vs_decord"] > 0 and "first read of a raw entry" in out


@pytest.mark.gpu
def test_jpeg_frames_are_decoded_on_the_gpu_like_on_the_cpu():
    """A mixed batch (one decoded clip, two of JPEG frames) lands on the GPU in batch order, its
    JPEG frames decoded there (nvJPEG) to what the CPU decoder gives."""
    device = torch.device("cuda", torch.cuda.current_device())
    # smooth frames (max 249): decoders agree closely
    ramp = torch.arange(32, dtype=torch.uint8).mul(3)
    frames = torch.stack([(ramp[:, None, None] + ramp[None, :, None] // 2 + 10 * t + torch.tensor([0, 40, 80],
                          dtype=torch.uint8)) for t in range(4)])   # T x H x W x C uint8
    jpegs = [encode_jpeg(f.permute(2, 0, 1).contiguous(), quality=95) for f in frames]
    decoded = frames.flip(1)
    batch = [jpegs, decoded, jpegs[::-1]]
    on_gpu = clips_to_device(batch, device)
    on_cpu = clips_to_device(batch, "cpu")
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == torch.uint8 and on_gpu.shape == (3, 4, 32, 32, 3)
    assert torch.equal(on_gpu[1].cpu(), decoded)                    # the decoded clip is copied as it is
    diff = (on_gpu.cpu().int() - on_cpu.int()).abs()
    assert diff.float().mean() < 1.0 and diff.max() <= 8, diff.max()
    assert torch.equal(on_gpu[2].cpu(), on_gpu[0].cpu().flip(0))   # frames stay in clip order
    assert (on_cpu[0].int() - frames.int()).abs().float().mean() < 3   # and both are the frames encoded
