"""On-device clip preprocessing: uint8 frames from the loader -> normalised float model input.

Clips cross the host->device link as uint8 (4x fewer bytes than float32) and are turned into
float, augmented and normalised here, batched, on the training device.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _check_triplet(name: str, values: Sequence[float]) -> list[float]:
    vals = [float(v) for v in values]
    if len(vals) != 3:
        raise ValueError(f"ClipTransform {name}={list(values)!r}: give one value per RGB channel (3 values)")
    return vals


class ClipTransform(nn.Module):
    """Convert, augment and normalise a batch of clips.

    Input: ``uint8`` tensor ``B x T x H x W x C`` (C = 3, RGB, values 0..255), as the
    `VideoClipDataset` / `build_loader` produce it, already on the training device.
    Output: ``float32`` tensor ``B x C x T x H x W``: ``(x / 255 - mean) / std`` per channel, the
    layout torchvision's video models take. Output H x W equals input H x W.

    Train (``train=True`` and the module in training mode): a random resized crop (area share
    drawn from ``crop_scale``, aspect ratio from 3/4..4/3, like torchvision's RandomResizedCrop)
    resized back to H x W, and a horizontal flip with probability ``flip_p``. Both are drawn once
    per clip and applied identically to all T frames of that clip (motion stays consistent);
    clips of a batch get independent draws. All clips are warped in one ``grid_sample`` call.
    Eval (``train=False``, or after ``.eval()``): no augmentation, only convert and normalise.

    Randomness comes from torch's global generator on the input's device, or from ``generator``
    when given (it must live on the same device as the input).
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], *, train: bool,
                 crop_scale: tuple[float, float] = (0.6, 1.0), flip_p: float = 0.5,
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), generator: torch.Generator | None = None):
        super().__init__()
        mean_v, std_v = _check_triplet("mean", mean), _check_triplet("std", std)
        if any(s <= 0 for s in std_v):
            raise ValueError(f"ClipTransform std={std_v}: every value must be > 0")
        lo, hi = crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"ClipTransform crop_scale={crop_scale}: need 0 < min <= max <= 1 "
                             "(share of the frame area kept)")
        if not 0 <= flip_p <= 1:
            raise ValueError(f"ClipTransform flip_p={flip_p}: a probability, between 0 and 1")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ClipTransform ratio={ratio}: need 0 < min <= max")
        self.augment = bool(train)          # not `self.train`: that is nn.Module's mode switch
        self.crop_scale = (float(lo), float(hi))
        self.flip_p = float(flip_p)
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.generator = generator
        # Folded into one multiply-add: x * scale + shift == (x / 255 - mean) / std.
        std_t, mean_t = torch.tensor(std_v), torch.tensor(mean_v)
        self.register_buffer("scale", (1.0 / (255.0 * std_t)).view(1, 3, 1, 1, 1), persistent=False)
        self.register_buffer("shift", (-mean_t / std_t).view(1, 3, 1, 1, 1), persistent=False)

    def extra_repr(self) -> str:
        return (f"train={self.augment}, crop_scale={self.crop_scale}, flip_p={self.flip_p}, "
                f"ratio=({self.ratio[0]:.3f}, {self.ratio[1]:.3f})")

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        if clips.dim() != 5 or clips.shape[-1] != 3:
            raise ValueError("ClipTransform expects uint8 B x T x H x W x 3 clips, got shape "
                             f"{tuple(clips.shape)}")
        if clips.dtype != torch.uint8:
            raise ValueError(f"ClipTransform expects uint8 clips (0..255), got {clips.dtype}")
        # B x T x H x W x C -> B x C x T x H x W; float32 even under autocast (the model casts).
        x = clips.permute(0, 4, 1, 2, 3).to(torch.float32)
        if self.augment and self.training:
            x = self._crop_and_flip(x)
        return x * self.scale + self.shift

    def sample_params(self, batch: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Per-clip crop and flip draws: (width share, height share, centre x, centre y, flip sign).

        Shares are of the frame side (0..1], centres in [-1, 1] grid coordinates, flip sign +-1;
        each a float32 tensor of shape (batch,).
        """
        g = self.generator

        def uniform(lo: float, hi: float) -> torch.Tensor:
            return lo + (hi - lo) * torch.rand(batch, device=device, generator=g)

        area = uniform(*self.crop_scale)
        log_ratio = uniform(math.log(self.ratio[0]), math.log(self.ratio[1]))
        aspect = torch.exp(log_ratio)
        # A crop wider or taller than the frame is clamped (torchvision retries; clamping is batchable).
        w = torch.sqrt(area * aspect).clamp(max=1.0)
        h = torch.sqrt(area / aspect).clamp(max=1.0)
        cx = (1 - w) * uniform(-1.0, 1.0)
        cy = (1 - h) * uniform(-1.0, 1.0)
        flip = torch.where(torch.rand(batch, device=device, generator=g) < self.flip_p, -1.0, 1.0)
        return w, h, cx, cy, flip

    def _crop_and_flip(self, x: torch.Tensor) -> torch.Tensor:
        """x: float32 B x C x T x H x W -> same shape, each clip cropped/flipped with its own draw."""
        b, c, t, hgt, wid = x.shape
        w, h, cx, cy, flip = self.sample_params(b, x.device)
        theta = torch.zeros(b, 2, 3, device=x.device, dtype=x.dtype)
        theta[:, 0, 0] = w * flip          # a negative x scale mirrors the crop horizontally
        theta[:, 0, 2] = cx
        theta[:, 1, 1] = h
        theta[:, 1, 2] = cy
        grid = F.affine_grid(theta, [b, c * t, hgt, wid], align_corners=False)
        # Channels and frames folded together: one grid per clip, shared by all its frames.
        out = F.grid_sample(x.reshape(b, c * t, hgt, wid), grid, mode="bilinear",
                            padding_mode="border", align_corners=False)
        return out.view(b, c, t, hgt, wid)
