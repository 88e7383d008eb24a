"""Generate a small, learnable violence-like dataset of real encoded video files.

Layout (RWF-2000): ``ROOT/{train,val}/{Fight,NonFight}/*.mp4|*.avi``. Every clip shows a
surveillance-style scene (gradient + texture background, sensor noise, a quarter of the cameras
shaking) with stick-like figures (body, head, arms, legs). The label is carried by *motion*:

* ``Fight``: 2-4 figures pulled towards a common point, kicked by random impulses every frame
  (fast, erratic, colliding), arms flailing.
* ``NonFight``: 1-4 figures walking at a steady speed (some jog, some walk side by side, some
  gesture slowly), arms swinging smoothly.

Colours, backgrounds, sizes, brightness, noise and figure counts are drawn from the *same*
distributions for both classes, so a single frame says little and a model has to look at how
things move. Some fights are mild, some walks brisk, some cameras shake, so the task is not
trivial; the `tiny` model reaches ~0.8-0.95 val accuracy on 200 videos within 4-5 epochs.

Files are H.264 ``.mp4`` (yuv420p, CRF 12 by default: near-lossless) and some ``.avi``
(MPEG-4 part 2 or MJPEG), a few with spaces / non-ASCII in their names, as real data has.
The same seed gives the same frames (each video draws from its own ``(seed, index)`` stream,
so the result also does not depend on ``workers``).

CLI: ``vidtune synth OUT --videos 200 [--seed 0 --fps 15 --seconds 3 --size 112]``.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import shutil
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np

from vidtune.datasets.probe import probe_video
from vidtune.errors import DataError
from vidtune.flags import (
    ConfigError,
    FlagSpec,
    add_flags,
    build,
    check_bounds,
    flag_specs,
    join_negative_values,
    option,
)

CLASS_DIRS = {1: "Fight", 0: "NonFight"}   # label -> RWF-2000 folder name
SPLITS = ("train", "val")
METADATA_FILE = "synthetic.json"           # the generator's parameters, for reproducibility

# Name patterns of the "odd" files (spaces, accents, non-Latin script, brackets), cycled.
_ODD_NAMES = ("clip {i:03d} é", "caméra nº{i} (copie)", "監視 カメラ {i}", "Ünïcode clip {i}")


@dataclass(frozen=True)
class SynthSpec:
    """Everything that decides the generated files (written to ROOT/synthetic.json). Each field
    is its CLI flag too (`vidtune.flags.option`), bounds included."""

    # an odd count gives Fight the extra clip
    videos: int = option(200, flag="--videos", metavar="N", ge=4,
                         help="total clips, classes balanced; at least 4: one per class in train and val")
    seed: int = option(0, flag="--seed", metavar="N", ge=0, help="random seed; same seed, same frames")
    fps: int = option(15, flag="--fps", metavar="FPS", ge=1, lt=121, help="frames per second")
    seconds: float = option(3.0, flag="--seconds", metavar="S", gt=0,
                            help="clip length in seconds; frames = round(fps x seconds), at least 4")
    # even: H.264 with yuv420p halves the chroma planes
    size: int = option(112, flag="--size", metavar="PX", ge=32, lt=1025,
                       help="square frame side in pixels, even, 32 to 1024")
    val_fraction: float = option(0.2, flag="--val-fraction", metavar="F", gt=0, lt=1,
                                 help="share of each class written to val/")
    avi_every: int = option(5, flag="--avi-every", metavar="K", ge=0,
                            help="every k-th clip is an .avi (MPEG-4 part 2 / MJPEG); 0 = all .mp4")
    odd_name_every: int = option(6, flag="--odd-name-every", metavar="K", ge=0,
                                 help="every k-th clip gets a name with spaces / non-ASCII; 0 = none")
    # 0 = lossless luma; 23 is x264's default
    crf: int = option(12, flag="--crf", metavar="CRF", ge=0, lt=52,
                      help="H.264 quality, 0 (lossless) to 51; 12 is near-lossless")

    @property
    def frames(self) -> int:
        return int(round(self.fps * self.seconds))


@dataclass(frozen=True)
class WriteOptions:
    """How `generate` writes the files, which does not change them (not in synthetic.json)."""

    workers: int | None = option(None, flag="--workers", metavar="N", ge=1,
                                 help="processes rendering/encoding in parallel (default: one per core, at "
                                 "most 4)")
    overwrite: bool = option(False, flag="--overwrite", help="replace videos already in OUT")


SPEC_FLAGS = tuple(flag_specs(SynthSpec))
WRITE_FLAGS = tuple(flag_specs(WriteOptions))


def _check_bounds(options: SynthSpec | WriteOptions, specs: Sequence[FlagSpec]) -> None:
    """`check_bounds` as a DataError naming the flag and its value (`--videos 3: it must be ...`),
    the error `generate`'s callers handle."""
    try:
        check_bounds(options, specs)
    except ConfigError as e:
        value = getattr(options, next(s.path for s in specs if s.flag == e.flag))
        reason = str(e)[len(e.flag) + 2:]
        raise DataError(f"{e.flag} {value}: {reason.partition('; ')[2] or reason}") from None


def _validate(spec: SynthSpec) -> None:
    """Raise DataError naming the offending option (CLI flag spelling) and what to use instead."""
    _check_bounds(spec, SPEC_FLAGS)
    if spec.frames < 4:
        raise DataError(f"--seconds {spec.seconds} at --fps {spec.fps} gives {spec.frames} frames; "
                        "need at least 4 frames per clip")
    if spec.size % 2:
        raise DataError(f"--size {spec.size}: use an even frame side between 32 and 1024 pixels "
                        "(H.264 with yuv420p needs even sides)")


# ----------------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class _Job:
    index: int       # global clip number: seeds the clip's random stream
    label: int
    path: Path
    codec: str       # libx264 | mpeg4 | mjpeg


def _plan(root: Path, spec: SynthSpec) -> list[_Job]:
    """Decide every file's label, split, name and codec (deterministic, no randomness)."""
    n_non = spec.videos // 2
    counts = {1: spec.videos - n_non, 0: n_non}
    jobs: list[_Job] = []
    index = 0
    for label, count in counts.items():
        n_val = min(max(1, round(count * spec.val_fraction)), count - 1)
        for k in range(count):
            split = "val" if k >= count - n_val else "train"
            stem = f"{CLASS_DIRS[label].lower()}_{k:04d}"
            if spec.odd_name_every and k % spec.odd_name_every == 1:
                stem = _ODD_NAMES[(k // spec.odd_name_every) % len(_ODD_NAMES)].format(i=k)
            codec = "libx264"
            if spec.avi_every and k % spec.avi_every == 2:
                codec = "mpeg4" if (k // spec.avi_every) % 2 == 0 else "mjpeg"
            ext = ".mp4" if codec == "libx264" else ".avi"
            jobs.append(_Job(index, label, root / split / CLASS_DIRS[label] / (stem + ext), codec))
            index += 1
    return jobs


# ---------------------------------------------------------------------------------- rendering
def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """A static scene: float32 H x W x 3 in [0, 255]. Same distribution for both classes."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    base = rng.uniform(40, 190, size=3)
    angle = rng.uniform(0, 2 * math.pi)
    ramp = (np.cos(angle) * xx + np.sin(angle) * yy)[..., None] * rng.uniform(-60, 60, size=3)
    texture = np.zeros((size, size), np.float32)
    for _ in range(3):     # a few soft stripes / tiles: walls, floor, shadows
        fx, fy = rng.uniform(1, 6, size=2)
        texture += np.sin(2 * math.pi * (fx * xx + fy * yy) + rng.uniform(0, 2 * math.pi))
    bg = base + ramp + texture[..., None] * rng.uniform(3, 15)
    if rng.random() < 0.5:  # a floor line, as in corridor / street cameras
        horizon = int(size * rng.uniform(0.3, 0.6))
        bg[horizon:] *= rng.uniform(0.7, 1.2)
    return np.clip(bg, 0, 255).astype(np.float32)


def _segment_alpha(px: np.ndarray, py: np.ndarray, a: np.ndarray, b: np.ndarray, r: float) -> np.ndarray:
    """Anti-aliased coverage (H x W float32 in [0, 1]) of a thick segment a-b with radius r.

    Soft edges keep the H.264 round trip close (hard edges ring after chroma subsampling).
    """
    d = b - a
    t = np.clip(((px - a[0]) * d[0] + (py - a[1]) * d[1]) / max(float(d @ d), 1e-6), 0, 1)
    dist = np.hypot(px - (a[0] + t * d[0]), py - (a[1] + t * d[1]))
    return np.clip(r - dist + 0.5, 0, 1)


@dataclass
class _Figure:
    """One stick-like person: position is the body centre, in pixels."""

    pos: np.ndarray        # (2,) x, y
    vel: np.ndarray        # (2,) px per frame
    scale: float           # body height in pixels
    color: np.ndarray      # (3,) RGB 0..255
    arm: np.ndarray        # (2,) arm angles in radians (0 = hanging down)
    arm_vel: np.ndarray    # (2,) radians per frame


def _draw(frame: np.ndarray, fig: _Figure, px: np.ndarray, py: np.ndarray, shift=(0, 0)) -> None:
    """Paint `fig` into `frame` (float32 H x W x 3) in place; `shift` = camera offset in pixels."""
    h = fig.scale
    x, y = fig.pos[0] - shift[0], fig.pos[1] - shift[1]
    # Work on the figure's bounding box only: ~5x less than the whole frame.
    size_y, size_x = frame.shape[:2]
    x0, x1 = max(int(x - 0.65 * h), 0), min(int(x + 0.65 * h) + 2, size_x)
    y0, y1 = max(int(y - 0.75 * h), 0), min(int(y + 0.8 * h) + 2, size_y)
    if x0 >= x1 or y0 >= y1:
        return
    frame, px, py = frame[y0:y1, x0:x1], px[y0:y1, x0:x1], py[y0:y1, x0:x1]
    top, bottom = np.array([x, y - 0.35 * h]), np.array([x, y + 0.35 * h])
    alpha = _segment_alpha(px, py, top, bottom, 0.14 * h)                      # body
    head = np.array([x, y - 0.55 * h])
    alpha = np.maximum(alpha, np.clip(0.13 * h - np.hypot(px - head[0], py - head[1]) + 0.5, 0, 1))
    for side, ang in zip((-1, 1), fig.arm, strict=True):                        # arms from shoulders
        shoulder = np.array([x + side * 0.08 * h, y - 0.28 * h])
        hand = shoulder + 0.45 * h * np.array([side * math.sin(ang), math.cos(ang)])
        alpha = np.maximum(alpha, _segment_alpha(px, py, shoulder, hand, 0.08 * h))
    for side in (-1, 1):                                                       # legs
        foot = bottom + np.array([side * 0.12 * h, 0.35 * h])
        alpha = np.maximum(alpha, _segment_alpha(px, py, bottom, foot, 0.08 * h))
    frame *= 1 - alpha[..., None]
    frame += alpha[..., None] * fig.color


def _figures(rng: np.random.Generator, n: int, size: int) -> list[_Figure]:
    """Figures with class-independent look: colour, size and pose drawn the same for both classes."""
    figs = []
    for _ in range(n):
        figs.append(_Figure(
            pos=rng.uniform(0.2 * size, 0.8 * size, size=2),
            vel=np.zeros(2),
            scale=size * rng.uniform(0.3, 0.48),
            color=rng.uniform(0, 255, size=3),
            arm=rng.uniform(0.1, 2.0, size=2),
            arm_vel=np.zeros(2),
        ))
    return figs


def _fight_motion(rng, figs, frames, size, fps):
    """Yield per-frame states: figures kicked by random impulses and pulled together (collisions)."""
    per_frame = 15.0 / fps                       # keeps motion per second the same at any fps
    intensity = rng.uniform(0.6, 1.0)           # mild scuffles to brawls: not every fight is obvious
    centre = rng.uniform(0.35 * size, 0.65 * size, size=2)
    drift = rng.normal(0, 0.3, size=2) * per_frame
    kick = size * 0.07 * intensity * per_frame
    for _ in range(frames):
        centre = np.clip(centre + drift, 0.25 * size, 0.75 * size)
        for f in figs:
            pull = (centre - f.pos) * 0.15 * per_frame
            f.vel = 0.7 * f.vel + pull + rng.normal(0, kick, size=2)
            f.pos = np.clip(f.pos + f.vel, 0.1 * size, 0.9 * size)
            f.arm_vel = rng.normal(0, 0.9 * intensity * per_frame, size=2)
            f.arm = np.clip(f.arm + f.arm_vel, 0.0, 3.0)
        yield figs


def _walk_motion(rng, figs, frames, size, fps):
    """Yield per-frame states: steady walking (some jog, some in a group, some gesture slowly)."""
    per_frame = 15.0 / fps
    style = rng.choice(["walk", "jog", "group", "gesture"], p=[0.45, 0.15, 0.2, 0.2])
    speed = {"walk": (0.3, 1.2), "jog": (1.2, 2.2), "group": (0.3, 1.0), "gesture": (0.0, 0.4)}[style]
    heading = rng.uniform(0, 2 * math.pi)
    for i, f in enumerate(figs):
        if style != "group":
            heading = rng.uniform(0, 2 * math.pi)
        elif i:   # side by side, close together: clustered figures are not a fight cue
            f.pos = figs[0].pos + rng.normal(0, 0.12 * size, size=2)
        direction = np.array([math.cos(heading), 0.4 * math.sin(heading)])
        f.vel = rng.uniform(*speed) * size / 112 * per_frame * direction
        f.arm_vel = np.array([rng.uniform(0.05, 0.2), rng.uniform(0, 2 * math.pi)])  # swing freq, phase
    amp = 1.0 if style == "gesture" else 0.35   # slow wide gestures cover the same arm poses as fights
    base = [f.arm.copy() for f in figs]
    for t in range(frames):
        for f, b in zip(figs, base, strict=True):
            f.pos = f.pos + f.vel
            for axis in (0, 1):   # turn back at the edges instead of leaving the scene
                if not 0.1 * size <= f.pos[axis] <= 0.9 * size:
                    f.vel[axis] = -f.vel[axis]
                    f.pos[axis] = np.clip(f.pos[axis], 0.1 * size, 0.9 * size)
            phase = f.arm_vel[0] * per_frame * t + f.arm_vel[1]
            f.arm = np.clip(b + amp * np.array([math.sin(phase), -math.sin(phase)]), 0.0, 3.0)
            f.pos[1] += 0.15 * math.sin(2 * phase)   # walking bob
        yield figs


def render_clip(label: int, rng: np.random.Generator, *, frames: int, size: int, fps: int) -> np.ndarray:
    """One clip as uint8 T x H x W x 3 (RGB). Label 1 = fight-like motion, 0 = walking."""
    margin = max(2, size // 28)                        # room for camera shake
    bg = _background(rng, size + 2 * margin)
    n = int(rng.integers(2, 5)) if label == 1 else int(rng.integers(1, 5))
    figs = _figures(rng, n, size)
    noise = rng.uniform(0.0, 4.0)                      # sensor noise sigma, same range for both classes
    flicker = rng.uniform(0.0, 0.04)                   # global brightness flicker (lights, auto-exposure)
    # Some cameras shake (wind, traffic): whole-frame motion in both classes, so "anything
    # moves" is not the same as "a fight".
    shake = rng.uniform(0.3, 1.0) * margin if rng.random() < 0.25 else 0.0
    shake_f, shake_phase = rng.uniform(0.5, 2.0) / fps, rng.uniform(0, 2 * math.pi, size=2)
    motion = _fight_motion if label == 1 else _walk_motion
    py, px = np.mgrid[0:size, 0:size].astype(np.float32)
    out = np.empty((frames, size, size, 3), np.uint8)
    for t, state in enumerate(motion(rng, figs, frames, size, fps)):
        wobble = np.sin(2 * math.pi * shake_f * t * np.array([1.0, 1.3]) + shake_phase)
        dx, dy = np.round(shake * wobble).astype(int)
        frame = bg[margin + dy:margin + dy + size, margin + dx:margin + dx + size].copy()
        for f in state:
            _draw(frame, f, px, py, shift=(dx, dy))
        frame *= 1 + rng.normal(0, flicker)
        frame += rng.normal(0, noise, size=frame.shape).astype(np.float32)
        out[t] = np.clip(frame, 0, 255).astype(np.uint8)
    return out


# ----------------------------------------------------------------------------------- encoding
def write_video(path: Path, frames: np.ndarray, *, fps: int, codec: str = "libx264", crf: int = 12) -> None:
    """Encode uint8 T x H x W x 3 RGB frames to `path` with PyAV.

    codec: "libx264" (.mp4, yuv420p, `crf`), "mpeg4" (MPEG-4 part 2, fixed quantiser 2) or
    "mjpeg" (quality 2); the last two go in an AVI container.
    """
    fmt = "mp4" if codec == "libx264" else "avi"
    with av.open(str(path), mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        if codec == "libx264":
            stream.pix_fmt = "yuv420p"
            # threads=1: the work is many tiny files, parallelised across processes instead.
            stream.options = {"crf": str(crf), "preset": "veryfast", "threads": "1"}
        else:
            stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
            stream.codec_context.qscale = True       # fixed quantiser: near-lossless, small files
            stream.codec_context.global_quality = 2
        # One encoder thread, whatever the codec: a seed must give the same files, and an encoder's
        # output can depend on its thread count (PyAV's default is one per core).
        stream.codec_context.thread_count = 1
        for arr in frames:
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(arr), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _make(job: _Job, spec: SynthSpec) -> None:
    rng = np.random.default_rng([spec.seed, job.index])
    clip = render_clip(job.label, rng, frames=spec.frames, size=spec.size, fps=spec.fps)
    write_video(job.path, clip, fps=spec.fps, codec=job.codec, crf=spec.crf)


def _prepare_root(root: Path, overwrite: bool) -> None:
    """Refuse to mix with earlier files unless told; with overwrite, remove only our own folders."""
    if root.exists() and not root.is_dir():
        raise DataError(f"output {root} exists and is not a folder; choose another OUT path")
    ours = [root / s / c for s in SPLITS for c in CLASS_DIRS.values()]
    existing = [p for p in ours if p.exists() and any(p.iterdir())]
    if existing and not overwrite:
        raise DataError(f"output folder {root} already holds videos ({existing[0]}); "
                        "pass --overwrite (overwrite=True) to replace them, or choose an empty folder")
    for p in ours:
        if p.exists():
            shutil.rmtree(p)
        p.mkdir(parents=True)


def generate(out_dir: str | Path, *, workers: int | None = None, overwrite: bool = False,
             **spec_fields: Any) -> Path:
    """Write the dataset under `out_dir` and return its root (the same path, as a Path).

    `spec_fields`: any of `SynthSpec`'s fields (videos, seed, fps, seconds, size, val_fraction,
    avi_every, odd_name_every, crf; an unknown one is a TypeError); the others keep its
    defaults, which live there only. See the module docstring for what the clips show.
    `workers` > 1 renders and encodes in that many processes (same files as with 1); None = one
    per CPU core (at most 4) for more than 8 videos, else 1.
    Raises DataError for unusable options or a non-empty output folder (without `overwrite`).
    """
    spec = SynthSpec(**spec_fields)
    _validate(spec)
    _check_bounds(WriteOptions(workers=workers, overwrite=overwrite), WRITE_FLAGS)
    if workers is None:
        workers = min(os.cpu_count() or 1, 4) if spec.videos > 8 else 1
    root = Path(out_dir)
    _prepare_root(root, overwrite)
    jobs = _plan(root, spec)
    # Always in fresh processes, one worker included: the same seed must give the same files, and
    # in a process that has loaded torch (whose math libraries numpy's sin/exp may then resolve
    # to) the rendered frames differed in the last bits, which the encoder turned into visible
    # differences. Spawn, not fork: the caller may hold torch/Ray threads a forked child can
    # deadlock on.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
        list(pool.map(_make, jobs, [spec] * len(jobs), chunksize=4))
    _check_decodes(root, spec)
    (root / METADATA_FILE).write_text(json.dumps({**asdict(spec), "frames": spec.frames}, indent=2) + "\n")
    return root


def _check_decodes(root: Path, spec: SynthSpec) -> None:
    """Probe one written video as `vidtune index` will (datasets.probe): a frame size the
    decoder misreads makes every video unusable, which is said here, naming --size, rather than
    when a search drops them all."""
    path = next(p for p in (root / "train").rglob("*") if p.is_file())
    problem = probe_video(str(path)).get("error")
    if problem:
        raise DataError(f"--size {spec.size}: the videos written to {root} cannot be trained on: "
                        f"{path.name}: {problem}. Pass another --size (such as {spec.size + 8}) "
                        f"with --overwrite")


# ---------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vidtune synth",
        description="Write a small learnable violence-like dataset (RWF-2000 layout) of real video files.")
    p.add_argument("out", metavar="OUT", help="output folder (created; becomes the dataset root)")
    add_flags(p, SPEC_FLAGS, group_of=lambda s: "dataset", suppress=False)
    add_flags(p, WRITE_FLAGS, group_of=lambda s: "writing", suppress=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(join_negative_values(argv, SPEC_FLAGS + WRITE_FLAGS))
    spec = build(SynthSpec, {s.path: getattr(args, s.path) for s in SPEC_FLAGS})
    run = build(WriteOptions, {s.path: getattr(args, s.path) for s in WRITE_FLAGS})
    try:
        root = generate(args.out, **asdict(spec), **asdict(run))   # generate checks the bounds
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    counts = {f"{s}/{c}": sum(1 for _ in (root / s / c).iterdir())
              for s in SPLITS for c in CLASS_DIRS.values()}
    print(f"wrote {sum(counts.values())} videos to {root}: "
          + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
