"""Scoring videos with a trained model: the model and its precision loaded from a checkpoint
(`Predictor`), long videos cut into clip windows, one violence probability per window.

`vidtune predict` (`vidtune.trainer.predict`) is its command line; this module is what it
imports once its flags are checked (torch, the model), so that `--help` answers at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vidtune.datasets.decode import read_frames
from vidtune.datasets.probe import probe_video
from vidtune.datasets.transforms import ClipTransform
from vidtune.datasets.video import fitting_stride, sample_indices
from vidtune.errors import DataError
from vidtune.trainer.checkpointing import CheckpointError, load_checkpoint
from vidtune.trainer.models import build_model, get_spec
from vidtune.trainer.precision import choose_precision, default_device


class VideoReadError(RuntimeError):
    """A video cannot be opened or decoded; the message names it."""


@dataclass(frozen=True)
class Predictor:
    """A trained model ready to score clips. `clip_frames` frames taken every `frame_stride`,
    decoded at `height x width`; `positive_name` is the violent class's folder name."""

    model: torch.nn.Module
    transform: torch.nn.Module
    policy: Any
    device: torch.device
    num_frames: int
    frame_stride: int
    height: int
    width: int
    positive_name: str

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: torch.device, precision: str = "auto") -> Predictor:
        state = load_checkpoint(path)
        spec = get_spec(state["spec"]["name"])
        data = state["config"].get("data", {})
        model = build_model(spec.name, weights="none")
        try:
            model.load_state_dict(state["model"])
        except RuntimeError as e:
            raise CheckpointError(f"checkpoint {path} does not fit model {spec.name!r}: {e}") from None
        model.eval().to(device)
        transform = ClipTransform(spec.mean, spec.std, train=False).to(device)
        return cls(model=model, transform=transform, policy=choose_precision(precision, device),
                   device=device, num_frames=data.get("num_frames") or spec.num_frames,
                   frame_stride=data.get("frame_stride") or 1,
                   height=data.get("height") or spec.height, width=data.get("width") or spec.width,
                   positive_name=state["class_names"].get(1, "violent"))

    @torch.inference_mode()
    def probabilities(self, clips: torch.Tensor) -> np.ndarray:
        """`clips`: uint8 B x T x H x W x C on the CPU -> float64 B, P(violent) in [0, 1]."""
        x = self.transform(clips.to(self.device, non_blocking=True))
        with self.policy.autocast():
            logits = self.model(x)
        return torch.softmax(logits.float(), dim=1)[:, 1].cpu().double().numpy()


def window_starts(total_frames: int, span: int, step: int) -> list[int]:
    """First frame of each window of `span` frames, every `step` frames, the last one flush
    with the end of the video so its tail is scored too."""
    last = max(0, total_frames - span)
    starts = list(range(0, last + 1, max(1, step)))
    if starts[-1] != last:
        starts.append(last)
    return starts


def clip_windows(total_frames: int, num_frames: int, frame_stride: int, fps: float,
                 window_stride_s: float) -> np.ndarray:
    """Frame indices of every clip window, int64 `W x num_frames`: frames `frame_stride` apart
    (shrunk for a short video, as in training), windows every `window_stride_s` seconds. A video
    shorter than one clip gives one window (frames repeated when it has fewer than T)."""
    frame_stride = fitting_stride(total_frames, num_frames, frame_stride)
    span = (num_frames - 1) * frame_stride + 1
    if total_frames <= span:
        return sample_indices(total_frames, num_frames, frame_stride, None)[None, :]
    starts = np.asarray(window_starts(total_frames, span, round(window_stride_s * fps)), dtype=np.int64)
    return starts[:, None] + frame_stride * np.arange(num_frames, dtype=np.int64)[None, :]


def score_video(p: Predictor, path: Path, window_stride_s: float,
                batch_size: int = 8) -> list[tuple[float, float]]:
    """[(window start in seconds, P(violent))] for every clip window of the video.
    Raises VideoReadError naming the file when it is missing or does not decode."""
    if not path.is_file():
        raise VideoReadError(f"{path}: no such file")
    info = probe_video(str(path))  # the frames that really decode, not what the container claims
    if "error" in info:
        raise VideoReadError(f"{path}: {info['error']}")
    fps = float(info["fps"]) or 25.0
    windows = clip_windows(info["num_frames"], p.num_frames, p.frame_stride, fps, window_stride_s)
    out: list[tuple[float, float]] = []
    for chunk in np.array_split(windows, max(1, -(-len(windows) // batch_size))):
        # Overlapping windows share frames: decode each frame once, then gather.
        needed = np.unique(chunk)
        try:
            frames = read_frames(path, needed.tolist(), height=p.height, width=p.width)
        except DataError as e:
            raise VideoReadError(str(e)) from None
        clips = torch.from_numpy(frames[np.searchsorted(needed, chunk)])
        out.extend((float(w[0]) / fps, float(q)) for w, q in zip(chunk, p.probabilities(clips), strict=True))
    return out


def device_named(name: str) -> torch.device:
    """`--device`: auto (the GPU when present), cpu, cuda or cuda:N."""
    return default_device() if name == "auto" else torch.device(name)
