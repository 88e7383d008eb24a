"""Scoring videos with a trained model: the model and its precision loaded from a checkpoint
(`Predictor`), a video's score by the one scoring rule (`video_score`), long videos cut into
clip windows with one violence probability per window (`score_video`).

The scoring rule (`SCORING_RULE`, `AGGREGATIONS`) is shared by `vidtune predict` and the MLflow
model a search registers (`trainer.serving.mlflow_model`): by default a video's score is P(violent) of
the one clip validation scored (`datasets.video.sample_indices` without a generator: the centred
window), so the accuracy of either on the validation videos is the val_acc the search reported.
`vidtune predict` (`vidtune.trainer.serving.predict`) is its command line; the rule's words live in
`vidtune.trainer.serving.scoring_rule` (no torch) so that `--help` answers at once.
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
from vidtune.trainer.models.registry import HF_PREFIX, build_model, get_spec, is_hf_model
from vidtune.trainer.serving.scoring_rule import AGGREGATIONS, CENTRE, SCORING_RULE, rule_sentence  # noqa: F401 (re-exported)
from vidtune.trainer.training.checkpointing import CheckpointError, checkpoint_file, load_checkpoint
from vidtune.trainer.training.precision import choose_precision, default_device

# Beside the checkpoint file of a vidtune MLflow model of an `hf:` model (`trainer.serving.mlflow_model`):
# its config and image processor, so that it loads without its hub id or source folder.
HF_CONFIG_FOLDER = "hf_config"


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
        name, beside = state["spec"]["name"], checkpoint_file(path).parent / HF_CONFIG_FOLDER
        if is_hf_model(name) and (beside / "config.json").is_file():
            name = HF_PREFIX + str(beside)
        spec = get_spec(name)
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


def open_video(given: str | Path) -> dict[str, Any]:
    """The video's probe (`datasets.probe.probe_video`: the frames that really decode, as the
    index counts them for validation), or VideoReadError saying in one line why `given` cannot be
    scored: empty path, no such file, a folder, not a regular file, does not decode."""
    if not str(given).strip():
        raise VideoReadError(f"{str(given)!r}: an empty path, not a video file")
    path = Path(given)
    if not path.exists():
        raise VideoReadError(f"{path}: no such file")
    if path.is_dir():
        raise VideoReadError(f"{path}: a folder, not a video file")
    if not path.is_file():
        raise VideoReadError(f"{path}: not a regular file (a device, a pipe or a socket)")
    try:
        info = probe_video(str(path))
    except OSError as e:             # unreadable (permissions), removed meanwhile
        raise VideoReadError(f"{path}: cannot be read ({e.strerror or e})") from None
    if "error" in info:
        raise VideoReadError(f"{path}: does not decode as a video ({info['error']})")
    return info


def video_score(p: Predictor, path: Path, aggregation: str = CENTRE, window_stride_s: float = 1.0,
                batch_size: int = 8, info: dict[str, Any] | None = None) -> float:
    """The video's P(violent) by the scoring rule `aggregation` (`scoring_rule.AGGREGATIONS`):
    `centre` (the default), the clip validation scored: `num_frames` frames `frame_stride`
    apart, centred in the video, as `VideoClipDataset` reads a validation item; `max` / `mean`,
    over the clip windows `score_video` slides every `window_stride_s` seconds. `info`: the
    video's probe when the caller has it (`open_video`). Raises VideoReadError naming the file."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation {aggregation!r}: choose one of {', '.join(AGGREGATIONS)}")
    if aggregation == CENTRE:
        info = info or open_video(path)
        clip = sample_indices(info["num_frames"], p.num_frames, p.frame_stride, None)
        return float(p.probabilities(torch.from_numpy(_read(p, path, clip)[None]))[0])
    probs = [q for _, q in score_video(p, path, window_stride_s, batch_size, info=info)]
    return max(probs) if aggregation == "max" else sum(probs) / len(probs)


def _read(p: Predictor, path: Path, indices: np.ndarray) -> np.ndarray:
    """Frames `indices` of the video at the model's size, uint8 N x H x W x C; VideoReadError."""
    try:
        return read_frames(path, indices.tolist(), height=p.height, width=p.width)
    except DataError as e:   # "Failed to read video PATH: reason"
        reason = str(e).removeprefix(f"Failed to read video {path}: ")
        raise VideoReadError(f"{path}: does not decode as a video ({reason})") from None


def score_video(p: Predictor, path: Path, window_stride_s: float,
                batch_size: int = 8, info: dict[str, Any] | None = None) -> list[tuple[float, float]]:
    """[(window start in seconds, P(violent))] for every clip window of the video.
    Raises VideoReadError naming the file when it is missing or does not decode."""
    info = info or open_video(path)  # the frames that really decode, not what the container claims
    fps = float(info["fps"]) or 25.0
    windows = clip_windows(info["num_frames"], p.num_frames, p.frame_stride, fps, window_stride_s)
    out: list[tuple[float, float]] = []
    for chunk in np.array_split(windows, max(1, -(-len(windows) // batch_size))):
        # Overlapping windows share frames: decode each frame once, then gather.
        needed = np.unique(chunk)
        frames = _read(p, path, needed)
        clips = torch.from_numpy(frames[np.searchsorted(needed, chunk)])
        out.extend((float(w[0]) / fps, float(q)) for w, q in zip(chunk, p.probabilities(clips), strict=True))
    return out


def device_named(name: str) -> torch.device:
    """`--device`: auto (the GPU when present), cpu, cuda or cuda:N."""
    return default_device() if name == "auto" else torch.device(name)
