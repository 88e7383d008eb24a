"""Violence probability of videos with a trained checkpoint, on the CPU or a GPU, without Ray.

    vidtune predict --checkpoint PATH VIDEO [VIDEO ...]

The model sees fixed-length clips (`num_frames` frames, every `frame_stride`-th), so a video
longer than one clip is scored window by window: the clip window slides over the video every
`--window-stride` seconds; each window's start time and probability are printed, and the
video's score is the max over windows (the mean is shown too): one violent moment makes a
violent video. A video that is missing or cannot be decoded is named on stderr; the others are
still scored; the exit code is then 1 (2 for a bad checkpoint or flag).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vidtune.datasets.cli import read_options
from vidtune.datasets.decode import read_frames
from vidtune.datasets.probe import probe_video
from vidtune.datasets.transforms import ClipTransform
from vidtune.datasets.video import fitting_stride, sample_indices
from vidtune.errors import DataError
from vidtune.flags import ConfigError, add_flags, flag_specs, join_negative_values, option
from vidtune.trainer.checkpointing import CheckpointError, load_checkpoint
from vidtune.trainer.config import TrainConfig
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


@dataclass(frozen=True)
class PredictOptions:
    """The prediction CLI's flags; its --precision is `TrainConfig.precision`'s (`PRECISION_FLAG`)."""

    checkpoint: str | None = option(None, flag="--checkpoint", metavar="PATH",
                                    help="checkpoint directory (printed by trainer.train) or its "
                                    "checkpoint.pt; required")
    window_stride: float = option(1.0, flag="--window-stride", metavar="S", gt=0,
                                  help="seconds between window starts in long videos")
    batch_size: int = option(8, flag="--batch-size", metavar="N", ge=1,
                             help="windows scored per forward pass")
    device: str = option("auto", flag="--device", metavar="DEVICE",
                         help="auto (the GPU when present) | cpu | cuda | cuda:N")


PREDICT_FLAGS = tuple(flag_specs(PredictOptions))
PRECISION_FLAG = tuple(s for s in flag_specs(TrainConfig) if s.path == "precision")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vidtune predict", description=__doc__.split("\n\n")[0])
    p.add_argument("videos", nargs="+", metavar="VIDEO", help="video files to score")
    add_flags(p, PREDICT_FLAGS + PRECISION_FLAG, group_of=lambda s: "prediction", suppress=False)
    return p


def _device(name: str) -> torch.device:
    return default_device() if name == "auto" else torch.device(name)


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(join_negative_values(argv, PREDICT_FLAGS))
    try:
        opts = read_options(PredictOptions, PREDICT_FLAGS, args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if opts.checkpoint is None:
        p.error("the following arguments are required: --checkpoint")
    try:
        device = _device(opts.device)
        predictor = Predictor.from_checkpoint(opts.checkpoint, device, args.precision)
    except (CheckpointError, RuntimeError, ValueError) as e:
        where = f"--checkpoint {opts.checkpoint}: " if isinstance(e, CheckpointError) else ""
        print(f"error: {where}{e}", file=sys.stderr)
        return 2
    failed = 0
    for video in args.videos:
        try:
            windows = score_video(predictor, Path(video), opts.window_stride, opts.batch_size)
        except VideoReadError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        probs = [q for _, q in windows]
        name = predictor.positive_name
        if len(windows) == 1:
            print(f"{video}: P({name}) {probs[0]:.3f}", flush=True)
            continue
        print(f"{video}: P({name}) max {max(probs):.3f} mean {float(np.mean(probs)):.3f} "
              f"over {len(windows)} windows")
        for start, q in windows:
            print(f"  {start:8.2f} s  {q:.3f}")
        sys.stdout.flush()
    if failed:
        print(f"{failed} of {len(args.videos)} video(s) could not be read", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
