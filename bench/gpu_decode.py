"""`make gpu-check`'s decoding step: the clip cache's JPEG entries decoded on the GPU against the
same entries decoded on the CPU, as frames and as what a few seeded training steps make of them.

On a GPU with a jpeg clip cache, training decodes each batch on the GPU (nvJPEG, in
`datasets.video.clips_to_device`) while the previous step's kernels may still be queued; decoded on
the training stream, the decoder could overwrite memory those kernels have yet to read
(pytorch/vision PR #9606), which its own decoding stream (`datasets.decode._decode_on_own_stream`)
prevents without waiting for them. This step, on videos it generates (`datasets.synthetic`):

  1. decodes every batch of cache entries on the GPU and on the CPU (libjpeg-turbo): each
     frame's mean |GPU - CPU| must stay within JPEG_MEAN_ABS_LEVELS;
  2. trains the same seeded model on those batches twice with `train_one_epoch`, once decoding
     on the GPU inside the loop (each decode issued while the previous step is still queued,
     where the race was) and once on frames decoded on the CPU beforehand: each step's model
     input must agree within the same tolerance, and each step's loss within LOSS_TOLERANCE.

`compare_decoding` returns the figures (for gpu_check's JSON), `problems` says what disagreed and
`summary` is the check's line. Runs on the CPU as well (both sides then decode there: a dry run).
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vidtune.datasets.cache import FrameCache
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index
from vidtune.datasets.synthetic import generate
from vidtune.datasets.transforms import ClipTransform
from vidtune.datasets.video import VideoClipDataset, clips_to_device, collate_clips
from vidtune.trainer.models.registry import build_model, get_spec
from vidtune.trainer.training import precision
from vidtune.trainer.training.loop import make_optimizer, train_one_epoch

# Mean |GPU - CPU| over one frame, in 8-bit levels. torchvision's own test of nvJPEG against its
# CPU decoder (test_image.py, test_decode_jpeg_cuda) allows a mean below 2: the two decoders'
# IDCT rounding and chroma upsampling differ by a level or two, at colour edges by more, so the
# largest single difference is no test. A frame overwritten by other data (another image's
# frame, garbage, zeros) is off by tens of levels on average.
JPEG_MEAN_ABS_LEVELS = 2.0
# |loss on GPU-decoded - loss on CPU-decoded frames| of one step. The seeded model starts near
# ln 2 = 0.69 on two classes, and inputs a level or two apart move that by far less than 0.05
# (7%). The loss is the coarse test: it catches a NaN or a blown-up step (memory overwritten
# under the forward or backward pass), not a swapped input, which an untrained model scores
# alike; the model-input comparison is the fine one.
LOSS_TOLERANCE = 0.05
LEARNING_RATE = 3e-4   # the search's default lr: the steps move the weights as a trial's would


def cache_batches(work: Path, *, videos: int, batch_size: int, model: str,
                  size: int = 112) -> list[tuple[list, torch.Tensor]]:
    """`videos` generated videos (`size` px) in a jpeg clip cache under `work`, read back as an
    encoded dataset does on a GPU: batches ``(B clips, each T JPEG frames as 1-D uint8 CPU tensors;
    labels int64 B)`` at `model`'s clip size, as many full batches as the videos give."""
    spec = get_spec(model)
    root = generate(work / "videos", videos=videos, size=size, seed=1,
                    workers=min(os.cpu_count() or 1, 16), overwrite=True)
    index = build_index(DataConfig(root=str(root)), use_cache=False)
    cache = FrameCache(work / "clips", format="jpeg", max_gb=1)
    dataset = VideoClipDataset(index.train + index.val, num_frames=spec.num_frames, frame_stride=2,
                               height=spec.height, width=spec.width, train=False, cache=cache, encoded=True)
    for i in range(len(dataset)):   # a miss decodes the video and writes its entry
        dataset[i]
    items = [dataset[i] for i in range(len(dataset))]
    missing = sum(not isinstance(clip, list) for clip, _ in items)
    if missing:
        raise RuntimeError(f"{missing} of {len(items)} clips were not read from the jpeg cache in {work}")
    return [collate_clips(items[i:i + batch_size]) for i in range(0, len(items) - batch_size + 1, batch_size)]


def frame_levels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean |a - b| of each frame in 8-bit levels: uint8 B x T x H x W x C clips (any devices)
    -> float64 (B*T,) on the CPU."""
    return (a.cpu().int() - b.cpu().int()).abs().double().mean(dim=(2, 3, 4)).flatten()


def input_levels(a: torch.Tensor, b: torch.Tensor, transform: ClipTransform) -> torch.Tensor:
    """Mean |a - b| of each frame of two model inputs (float32 B x C x T x H x W, normalised by
    `transform`), in the 8-bit levels of the frames they came from -> float64 (B*T,) on the CPU."""
    levels = (a - b).abs() / transform.scale.to(a.device)
    return levels.mean(dim=(1, 3, 4)).flatten().double().cpu()


class _Recording(nn.Module):
    """The input transform, keeping a copy of each model input it makes. The copy is queued on
    the stream right after the transform, so it holds what the step itself read."""

    def __init__(self, transform: ClipTransform):
        super().__init__()
        self.transform, self.inputs = transform, []

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        x = self.transform(clips)
        self.inputs.append(x.detach().clone())
        return x


def seeded_steps(batches: list[tuple[Any, torch.Tensor]], device: torch.device, *,
                 model: str) -> tuple[list[float], list[torch.Tensor], ClipTransform]:
    """One `train_one_epoch` of a fresh `model` (seed 0, no pretrained weights, the precision
    `auto` picks for `device`, no augmentation) over `batches` on `device`, as a worker trains:
    JPEG frames in a batch are decoded on `device` inside the loop, decoded clips are copied.
    Returns each step's loss (float, cross-entropy of its logits), each step's model input
    (float32 B x C x T x H x W on `device`) and the transform that normalised them."""
    spec = get_spec(model)
    torch.manual_seed(0)
    net = build_model(model).to(device)
    logits: list[torch.Tensor] = []
    hook = net.register_forward_hook(lambda module, args, out: logits.append(out.detach().float().clone()))
    policy = precision.choose_precision("auto", device)
    optimizer = make_optimizer(net, lr=LEARNING_RATE, weight_decay=0.05, device=device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    transform = ClipTransform(spec.mean, spec.std, train=False).to(device)
    recording = _Recording(transform)
    torch.manual_seed(0)   # dropout and stochastic depth draw alike in both runs
    try:
        train_one_epoch(net, batches, transform=recording, optimizer=optimizer, scheduler=scheduler,
                        scaler=policy.make_scaler(), policy=policy, device=device, finite_check_every=0)
    finally:
        hook.remove()
    losses = [float(F.cross_entropy(out, labels.to(device)).item())
              for out, (_, labels) in zip(logits, batches, strict=True)]
    return losses, recording.inputs, transform


def compare_decoding(batches: list[tuple[list, torch.Tensor]], device: torch.device, *,
                     model: str) -> dict[str, Any]:
    """The figures of both comparisons (module doc) on `batches` from `cache_batches`."""
    device = torch.device(device)
    levels, decode_ms = [], []
    for clips, _ in batches:
        precision.synchronize(device)
        t0 = time.perf_counter()
        on_device = clips_to_device(clips, device)
        precision.synchronize(device)
        decode_ms.append(1000 * (time.perf_counter() - t0))
        levels.append(frame_levels(on_device, clips_to_device(clips, "cpu")))
    frames = torch.cat(levels)
    losses_device, inputs_device, transform = seeded_steps(batches, device, model=model)
    decoded_first = [(clips_to_device(clips, "cpu"), labels) for clips, labels in batches]
    losses_cpu, inputs_cpu, _ = seeded_steps(decoded_first, device, model=model)
    step_levels = [float(input_levels(a, b, transform).max())
                   for a, b in zip(inputs_device, inputs_cpu, strict=True)]
    del inputs_device, inputs_cpu
    precision.free_memory(device)   # the search that follows in gpu-check gets the GPU's memory back
    return {
        "device": str(device), "model": model, "batches": len(batches),
        "frames_per_batch": sum(len(clip) for clip in batches[0][0]),
        "frames": int(frames.numel()),
        "frame_mean_abs_levels_max": float(frames.max()),
        "frame_mean_abs_levels_median": float(frames.median()),
        "decode_ms_per_batch_median": statistics.median(decode_ms),
        "step_input_mean_abs_levels_max": step_levels,
        "step_losses_device_decoded": losses_device,
        "step_losses_cpu_decoded": losses_cpu,
        "tolerance": {"frame_mean_abs_levels": JPEG_MEAN_ABS_LEVELS, "loss": LOSS_TOLERANCE},
    }


def problems(figures: dict[str, Any]) -> list[str]:
    """What disagreed, one line each; empty when the GPU-decoded and CPU-decoded sides agree."""
    out = []
    worst = figures["frame_mean_abs_levels_max"]
    if not worst <= JPEG_MEAN_ABS_LEVELS:
        out.append(f"decoded frames: a frame differs from the CPU's by {worst:.2f} levels on average "
                   f"(tolerance {JPEG_MEAN_ABS_LEVELS:g})")
    for step, level in enumerate(figures["step_input_mean_abs_levels_max"], 1):
        if not level <= JPEG_MEAN_ABS_LEVELS:
            out.append(f"step {step}: the model input from GPU-decoded frames differs from the CPU-decoded "
                       f"one by {level:.2f} levels on a frame (tolerance {JPEG_MEAN_ABS_LEVELS:g})")
    pairs = zip(figures["step_losses_device_decoded"], figures["step_losses_cpu_decoded"], strict=True)
    for step, (on_device, on_cpu) in enumerate(pairs, 1):
        if not abs(on_device - on_cpu) <= LOSS_TOLERANCE:   # NaN fails too
            out.append(f"step {step}: loss {on_device:.4f} on GPU-decoded frames, {on_cpu:.4f} on "
                       f"CPU-decoded ones (tolerance {LOSS_TOLERANCE:g})")
    return out


def summary(figures: dict[str, Any]) -> str:
    """The check's line: what was compared and how close it came."""
    gaps = [abs(a - b) for a, b in zip(figures["step_losses_device_decoded"],
                                       figures["step_losses_cpu_decoded"], strict=True)]
    return (f"{figures['frames']} frames: mean |GPU - CPU| <= {figures['frame_mean_abs_levels_max']:.2f} "
            f"levels a frame; {len(gaps)} seeded {figures['model']} steps: inputs <= "
            f"{max(figures['step_input_mean_abs_levels_max']):.2f} levels, losses within {max(gaps):.4f}; "
            f"decode {figures['decode_ms_per_batch_median']:.1f} ms per {figures['frames_per_batch']} frames")
