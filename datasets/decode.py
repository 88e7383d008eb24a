"""Frame decoding: the one wrapper of decord (video files) and of torchvision's JPEG codec.

Used by the clip Dataset (`datasets.video`), the clip cache (`datasets.cache`,
`datasets.cache_layout`) and prediction (`trainer.serving.predict`). Imports nothing of this project but
`vidtune.errors`, so every module above can import it at the top.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torchvision.io import decode_jpeg, encode_jpeg

from vidtune.errors import DataError, decoder_reason

try:  # guarded: the module imports (and its errors explain) without decord installed
    import decord
except ImportError as _e:  # pragma: no cover - decord is a declared dependency
    decord = None
    _DECORD_IMPORT_ERROR: ImportError | None = _e
else:
    _DECORD_IMPORT_ERROR = None

# torchvision 0.29 marks its JPEG codec deprecated in favour of TorchCodec, which cannot load
# here without system FFmpeg libraries; the codec works, so its warning (once per call) is noise.
warnings.filterwarnings("ignore", message=r".*image decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)


def read_frames(path: str | Path, indices: Sequence[int], *, height: int = -1,
                width: int = -1) -> np.ndarray:
    """Decode frames `indices` of `path`: uint8 ndarray ``len(indices) x H x W x 3`` (RGB).

    The one wrapper of decord. A fresh `decord.VideoReader(num_threads=1)` per call: a reader
    shared across DataLoader worker processes deadlocks or leaks, and one decode thread per
    worker is what scales (threads inside decord contend on a few cores). `height`/`width`
    resize at decode time (-1 = the stored size), which is cheaper than resizing afterwards.
    Raises DataError ``Failed to read video {path}: {reason}`` for any decord failure.
    """
    if decord is None:
        raise DataError(f"Failed to read video {path}: decord is not importable ({_DECORD_IMPORT_ERROR}); "
                        "install the project's dependencies (pip install -e .)")
    if not Path(path).is_file():
        raise DataError(f"Failed to read video {path}: file not found (moved or deleted after indexing?)")
    try:
        frames = _decode(path, indices, height, width)
    except Exception as e:  # decord raises DECORDError, RuntimeError, IndexError, AssertionError
        if height <= 0 and width <= 0:
            raise DataError(f"Failed to read video {path}: {decoder_reason(e)}") from e
        # decord 0.6 cannot resize to some widths (16, 24, 48, 72 px from a 112 px source fail
        # with "DECORDArrayCopyFromTo: The size must exactly match"): decode at the stored size
        # and resize here instead. A file that is really broken fails this too.
        try:
            frames = _resize(_decode(path, indices, -1, -1), height, width)
        except Exception:
            raise DataError(f"Failed to read video {path}: {decoder_reason(e)}") from e
    expected = (len(indices), height if height > 0 else frames.shape[1],
                width if width > 0 else frames.shape[2], 3)
    if frames.shape != expected or frames.dtype != np.uint8:
        raise DataError(f"Failed to read video {path}: got frames {frames.shape} {frames.dtype}, "
                        f"expected {expected} uint8")
    return frames


def _decode(path: str | Path, indices: Sequence[int], height: int, width: int) -> np.ndarray:
    reader = decord.VideoReader(str(path), width=width, height=height, num_threads=1)
    batch = reader.get_batch([int(i) for i in indices])
    return batch.asnumpy() if hasattr(batch, "asnumpy") else np.asarray(batch)  # whichever decord bridge


def _resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 N x h x w x 3 -> uint8 N x height x width x 3 (bilinear, antialiased; -1 keeps a side)."""
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
    size = (height if height > 0 else frames.shape[1], width if width > 0 else frames.shape[2])
    x = torch.nn.functional.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
    return x.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def decode_jpeg_frames(jpegs: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """JPEG files (1-D uint8 tensors on the CPU) -> uint8 N x H x W x 3 on `device`, decoded there
    in one batched call (torchvision: nvJPEG on a GPU; libjpeg-turbo on the CPU). On a GPU the
    decode runs on a stream of its own (`_decode_on_own_stream`): ready for the caller's current
    stream, without waiting for the work queued there."""
    if not jpegs:
        raise ValueError("decode_jpeg_frames got no frames")
    device = torch.device(device)
    if device.type != "cpu":
        return _decode_on_own_stream(jpegs, device)
    return _stack_frames(decode_jpeg(list(jpegs), device=device))


def _stack_frames(frames: list[torch.Tensor]) -> torch.Tensor:
    # On the CPU each frame is H x W x C memory seen as C x H x W: stacking the H x W x C views is a
    # plain copy, 15x faster than stacking the C x H x W ones (1.2 ms per 16 frames at 224 px).
    return torch.stack([f.permute(1, 2, 0) for f in frames])


# One decoding stream per device, made on first use (`_decode_on_own_stream`).
_DECODE_STREAMS: dict[torch.device, torch.Stream] = {}


def decode_stream(device: torch.device) -> torch.Stream:
    """The stream device decodes run on, one per device (of this process)."""
    if device.index is None:
        device = torch.device(device.type, torch.accelerator.current_device_index())
    if device not in _DECODE_STREAMS:
        _DECODE_STREAMS[device] = torch.Stream(device=device)
    return _DECODE_STREAMS[device]


def _decode_on_own_stream(jpegs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """`decode_jpeg` on `device` without draining the caller's stream (where training queues).

    The hazard (pytorch/vision PR #9606, not merged): torchvision's `decode_jpeg(device="cuda")`
    takes its output tensors from the caching allocator on the *current* stream, then decodes on
    a private stream that never waits for it, and nvJPEG's hardware engine writes before work
    already queued on its stream has run. The allocator hands a block out again as soon as it is
    freed on its stream, so a decode on the training stream can be given memory the previous
    step's queued kernels have yet to read, and overwrite it (wrong inputs or NaNs, seen as
    spurious DIVERGED trials: 134 of 200 iterations corrupted on an H100, torchvision 0.28).

    Here the current stream is this device's decoding stream (`decode_stream`) instead. The only
    kernels ever queued there are the decoder's and the stack that copies its frames into one
    tensor, so draining it before each decode (a sync point, as torchcodec's PR #1634 drains
    before its hardware decode) waits for the last decode's copy, never for a training step: the
    blocks the allocator can then hand the decoder on that stream are idle. The result is used on
    the caller's stream in order (`wait_stream`, an event: no host wait) and marked used there
    (`record_stream`), so its block goes back to the decoding stream's pool only once the
    caller's kernels that read it have run. torchvision returns only once its decode is done, so
    the host time spent here is the decode's own: the training loop counts it as time spent
    waiting for data (`trainer.training.loop`), and `make gpu-check` records it
    (decode_ms_per_batch_median) and checks the decoded frames against the CPU's."""
    consumer = torch.accelerator.current_stream(device)
    side = decode_stream(device)
    side.synchronize()   # the last decode's copy only: nothing of the caller's is queued here
    with side:
        frames = _stack_frames(decode_jpeg(list(jpegs), device=device))
    consumer.wait_stream(side)
    frames.record_stream(consumer)
    return frames


def encode_jpeg_frames(frames: np.ndarray, *, quality: int) -> list[torch.Tensor]:
    """uint8 ndarray N x H x W x 3 (RGB) -> N JPEG files, each a 1-D uint8 tensor (CPU)."""
    return encode_jpeg(list(torch.from_numpy(frames).permute(0, 3, 1, 2)), quality=quality)
