"""The torch Dataset of video clips (decord, one reader per item, or the frame cache) and its DataLoader.

Data flow: `VideoInfo` records (from `datasets.index`) -> `VideoClipDataset[i]` decodes T frames
resized at decode time (or reads them from `datasets.cache.FrameCache`) -> `build_loader` batches
them as uint8 B x T x H x W x C -> `clips_to_device` -> on the device,
`datasets.transforms.ClipTransform` makes the float model input. With a jpeg cache and
``encoded=True``, items carry the frames' JPEG bytes and `clips_to_device` decodes them on the device.
"""
from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Sequence
from multiprocessing.context import get_spawning_popen

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from vidtune.datasets.cache import FrameCache
from vidtune.datasets.decode import (  # also imported from here: trainer.serving.predict
    decode_jpeg_frames,
    read_frames,
)
from vidtune.datasets.records import VideoInfo
from vidtune.errors import DataError

log = logging.getLogger(__name__)

# A clip as an item carries it: decoded uint8 T x H x W x C, or T JPEG files (1-D uint8 tensors).
Clip = torch.Tensor | list
# Shared with loader workers (class doc).
_COUNTERS = ("_failures", "_reads", "_cache_hits", "_cache_repairs")


def fitting_stride(num_available: int, num_frames: int, stride: int) -> int:
    """The largest stride <= `stride` at which T = `num_frames` frames fit in `num_available`
    (at least 1): the one rule for short videos, in training and in prediction."""
    if num_frames <= 1:
        return stride
    return max(1, min(stride, (num_available - 1) // (num_frames - 1)))


def sample_indices(num_available: int, num_frames: int, stride: int,
                   rng: np.random.Generator | None) -> np.ndarray:
    """T = `num_frames` frame indices (int64, ascending) into a video of `num_available` frames.

    Frames at `stride` apart; the window start is random (`rng` given: train jitter) or centred
    (`rng` None: val, the same every epoch). A video too short for the stride gets the largest
    stride that fits; one with fewer than T frames repeats frames (indices spread with linspace).
    """
    if num_available < 1:
        raise ValueError(f"cannot sample from a video with {num_available} frames")
    if num_available < num_frames:
        return np.linspace(0, num_available - 1, num_frames).round().astype(np.int64)
    stride = fitting_stride(num_available, num_frames, stride)
    span = (num_frames - 1) * stride + 1
    slack = num_available - span
    start = int(rng.integers(0, slack + 1)) if rng is not None else slack // 2
    return start + stride * np.arange(num_frames, dtype=np.int64)


class VideoClipDataset(Dataset):
    """Clips of T frames from videos, decoded with decord at the model's resolution.

    ``dataset[i] -> (clip, label)``: ``clip`` a ``torch.uint8`` tensor ``T x H x W x C`` (C = 3,
    RGB, 0..255) with T = `num_frames`, H = `height`, W = `width`; ``label`` an ``int``
    (1 = violent). Train: the window start jitters, drawn from a generator seeded by
    ``(seed, epoch, i)`` - reproducible, different each epoch (`set_epoch`), independent of which
    DataLoader worker reads the item. Val: the centred window, identical every epoch.

    A read that fails (file removed, changed or damaged after indexing) does not stop training: a
    warning names the file, the failure is counted, and the clip of another video of the same
    class is returned instead (the next one in that class's list, so the choice is
    deterministic). Only when every video of the class fails is a DataError raised, naming them.

    `cache`: read through a `datasets.cache.FrameCache` (the first read of a video decodes all its
    frames into it, later reads take them from it). `encoded` (with a jpeg cache): an item read
    from a cache entry carries ``clip`` as a list of T 1-D uint8 tensors, the frames' JPEG files,
    for `collate_clips` / `clips_to_device` to decode on the training device; a miss still gives
    a decoded tensor. The caller decides (worth it where the device decodes JPEG, i.e. a GPU).

    Counts across processes: reads happen in DataLoader worker processes, whose own attributes
    the training process never sees. So the counts live in ``multiprocessing.Value``s created
    here, before workers start; forked or spawned workers inherit them and add to the same shared
    integers. ``failures`` (failed reads; the trainer reports it per epoch as
    ``reader_failures``), ``reads`` (clip reads), ``cache_hits`` (reads served by the cache) and
    ``cache_repairs`` (damaged cache entries found, decoded again and rewritten) are cumulative
    over this process and its loader workers since the Dataset was made; per-epoch figures are
    differences. The epoch set by ``set_epoch`` is shared the same way, so persistent
    workers see it; call it before iterating the epoch.
    """

    def __init__(self, videos: Sequence[VideoInfo], *, num_frames: int, frame_stride: int,
                 height: int, width: int, train: bool, seed: int = 0,
                 cache: FrameCache | None = None, encoded: bool = False):
        self.videos = list(videos)
        if not self.videos:
            raise DataError("VideoClipDataset got no videos; check the dataset folder and the index summary "
                            "(vidtune index ROOT)")
        for name, value in (("num_frames", num_frames), ("frame_stride", frame_stride),
                            ("height", height), ("width", width)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"VideoClipDataset {name}={value!r}: must be a positive integer")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"VideoClipDataset seed={seed!r}: must be an integer >= 0")
        bad = [v for v in self.videos if v.num_frames < 1]
        if bad:
            raise DataError(f"video {bad[0].path} has num_frames={bad[0].num_frames} in the index; "
                            "rebuild the index (vidtune index ROOT)")
        self.num_frames, self.frame_stride = int(num_frames), int(frame_stride)
        self.height, self.width = int(height), int(width)
        self.train, self.seed = bool(train), int(seed)
        self.cache, self.encoded = cache, bool(encoded)
        self._by_label: dict[int, list[int]] = {}      # label -> item numbers, in order
        self._rank: list[int] = []                      # item i is _by_label[label][_rank[i]]
        for i, v in enumerate(self.videos):
            members = self._by_label.setdefault(int(v.label), [])
            self._rank.append(len(members))
            members.append(i)
        for name in _COUNTERS:
            setattr(self, name, multiprocessing.Value("q", 0))
        self._epoch = multiprocessing.Value("q", 0, lock=False)

    def __len__(self) -> int:
        return len(self.videos)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's train jitter; seen by already running (persistent) loader workers."""
        if epoch < 0:
            raise ValueError(f"set_epoch({epoch}): epochs are counted from 0 or 1, not negative")
        self._epoch.value = int(epoch)

    @property
    def epoch(self) -> int:
        return int(self._epoch.value)

    @property
    def failures(self) -> int:
        """Failed reads so far in this process and its DataLoader workers (shared counter)."""
        return int(self._failures.value)

    @property
    def reads(self) -> int:
        """Clip reads so far (failed ones included), this process and its loader workers."""
        return int(self._reads.value)

    @property
    def cache_hits(self) -> int:
        """Reads served from the frame cache so far, this process and its loader workers."""
        return int(self._cache_hits.value)

    @property
    def cache_repairs(self) -> int:
        """Damaged cache entries found and decoded again so far, this process and its loader workers."""
        return int(self._cache_repairs.value)

    @staticmethod
    def _add(counter, n: int = 1) -> None:
        with counter.get_lock():
            counter.value += n

    def clip_indices(self, i: int) -> np.ndarray:
        """The frame indices item `i` reads this epoch (int64, length T)."""
        rng = np.random.default_rng([self.seed, self.epoch, i]) if self.train else None
        return sample_indices(self.videos[i].num_frames, self.num_frames, self.frame_stride, rng)

    def read(self, i: int) -> Clip:
        """Item `i`'s clip (decoded tensor, or JPEG files, see the class doc), raising DataError
        on failure (no replacement)."""
        self._add(self._reads)
        if self.cache is None:
            frames = read_frames(self.videos[i].path, self.clip_indices(i), height=self.height,
                                 width=self.width)
        else:
            repairs = self.cache.repairs      # this process's FrameCache copy counts; the shared value sums
            frames, hit = self.cache.read(self.videos[i], self.clip_indices(i), height=self.height,
                                          width=self.width, encoded=self.encoded)
            if hit:
                self._add(self._cache_hits)
            if self.cache.repairs > repairs:
                self._add(self._cache_repairs, self.cache.repairs - repairs)
        return torch.from_numpy(frames) if isinstance(frames, np.ndarray) else frames

    def __getitem__(self, i: int) -> tuple[Clip, int]:
        label = int(self.videos[i].label)
        same_class = self._by_label[label]
        start = self._rank[i]
        errors: list[str] = []
        for k in range(len(same_class)):   # i itself first, then the rest of its class in order
            j = same_class[(start + k) % len(same_class)]
            try:
                clip = self.read(j)
            except DataError as e:
                self._add(self._failures)
                errors.append(str(e))
                if len(errors) < len(same_class):
                    nxt = self.videos[same_class[(start + k + 1) % len(same_class)]].path
                    log.warning("%s; using %s (same class) instead", e, nxt)
                continue
            return clip, label
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        shown = "\n  ".join(errors[:10]) + more
        raise DataError(f"every video of class {label} failed to read ({len(errors)} files):\n  {shown}\n"
                        "The files changed or were removed after indexing; rebuild the index "
                        "(vidtune index ROOT) and check the disk.")

    def __getstate__(self) -> dict:
        # Shared counters travel to DataLoader workers (inheritance at process start). Pickled in any
        # other context (e.g. copied to another machine) they cannot be shared: start fresh ones.
        state = self.__dict__.copy()
        if get_spawning_popen() is None:
            for name in (*_COUNTERS, "_epoch"):
                state[name] = getattr(self, name).value
        return state

    def __setstate__(self, state: dict) -> None:
        if not hasattr(state["_failures"], "get_lock"):
            for name in _COUNTERS:
                state[name] = multiprocessing.Value("q", state.get(name, 0))
            state["_epoch"] = multiprocessing.Value("q", state["_epoch"], lock=False)
        self.__dict__.update(state)


def build_loader(dataset: VideoClipDataset, *, batch_size: int, train: bool, num_workers: int,
                 pin_memory: bool, seed: int = 0, sampler: Sampler[int] | None = None) -> DataLoader:
    """Batches of ``(clips uint8 B x T x H x W x C, labels int64 B)``.

    Train: shuffled (by `sampler`, else by a generator seeded by `seed`, so the order is
    reproducible) and `drop_last`, so every batch has the same shape (cudnn.benchmark re-tunes for
    each new shape); a dataset (or sampler) smaller than `batch_size` gives no batch (the one
    check is `trainer.ray_setup.launch.check_batch_sizes`, on the driver). Val: in `sampler`'s order, else
    in order, every clip. Workers > 0 are persistent (decoding workers are not restarted each
    epoch) and prefetch 2 batches each. `pin_memory`: True on CUDA (faster, async copies).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers}: must be >= 0 (0 = decode in the training process)")
    extra = dict(persistent_workers=True, prefetch_factor=2) if num_workers > 0 else {}
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=train and sampler is None, sampler=sampler, drop_last=train,
        num_workers=num_workers, pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed),
        collate_fn=collate_clips if getattr(dataset, "encoded", False) else None, **extra)


def collate_clips(batch: list[tuple[Clip, int]]) -> tuple[torch.Tensor | list[Clip], torch.Tensor]:
    """DataLoader collate_fn of an ``encoded`` dataset: ``(clips, labels int64 B)`` where clips is
    the usual stacked uint8 B x T x H x W x C tensor when every item is decoded, else the list of
    the B items as they are (tensors and JPEG lists) for `clips_to_device`."""
    clips = [clip for clip, _ in batch]
    labels = torch.tensor([label for _, label in batch], dtype=torch.int64)
    if all(isinstance(c, torch.Tensor) for c in clips):
        return default_collate(clips), labels
    return clips, labels


def clips_to_device(clips: torch.Tensor | list[Clip], device: torch.device | str, *,
                    non_blocking: bool = False) -> torch.Tensor:
    """A batch as `build_loader` gives it -> uint8 B x T x H x W x C on `device`.

    A tensor is copied (`non_blocking` with pinned memory overlaps the copy with compute). A
    list (from `collate_clips`) has its JPEG frames decoded on `device` in one batched call -
    on a GPU this takes the decoding off the loader's CPU cores - and decoded items copied.
    """
    if isinstance(clips, torch.Tensor):
        return clips.to(device, non_blocking=non_blocking)
    encoded = [clip for clip in clips if not isinstance(clip, torch.Tensor)]
    decoded = iter(())
    if encoded:   # one call for the whole batch: a GPU decoder is fast only on many images at once
        frames = decode_jpeg_frames([frame for clip in encoded for frame in clip], device)
        decoded = iter(frames.split([len(clip) for clip in encoded]))
    return torch.stack([clip.to(device, non_blocking=non_blocking) if isinstance(clip, torch.Tensor)
                        else next(decoded) for clip in clips])
