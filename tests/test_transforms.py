"""ClipTransform: layout, dtype, normalisation, per-clip augmentation shared by all frames."""
from __future__ import annotations

import pytest
import torch

from vidtune.datasets.transforms import ClipTransform

MEAN, STD = (0.45, 0.40, 0.35), (0.225, 0.25, 0.2)


def _clips(b=3, t=4, h=16, w=20, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t, h, w, 3), dtype=torch.uint8, generator=g)


def _expected(clips: torch.Tensor) -> torch.Tensor:
    x = clips.permute(0, 4, 1, 2, 3).double() / 255
    mean = torch.tensor(MEAN).view(1, 3, 1, 1, 1).double()
    std = torch.tensor(STD).view(1, 3, 1, 1, 1).double()
    return ((x - mean) / std).float()


def test_eval_converts_layout_dtype_and_normalises():
    clips = _clips()
    out = ClipTransform(MEAN, STD, train=False)(clips)
    assert out.shape == (3, 3, 4, 16, 20) and out.dtype == torch.float32
    torch.testing.assert_close(out, _expected(clips), rtol=0, atol=1e-5)


def test_eval_and_eval_mode_never_augment():
    clips = _clips()
    ref = _expected(clips)
    torch.testing.assert_close(ClipTransform(MEAN, STD, train=False).train()(clips), ref, rtol=0, atol=1e-5)
    # A train transform switched to eval mode (as during validation) does not augment either.
    evaluated = ClipTransform(MEAN, STD, train=True, flip_p=1.0).eval()(clips)
    torch.testing.assert_close(evaluated, ref, rtol=0, atol=1e-5)


def test_train_output_shape_and_dtype_and_changes_clips():
    clips = _clips()
    t = ClipTransform(MEAN, STD, train=True, generator=torch.Generator().manual_seed(0))
    out = t(clips)
    assert out.shape == (3, 3, 4, 16, 20) and out.dtype == torch.float32
    assert not torch.allclose(out, _expected(clips))


def test_flip_only_mirrors_width_exactly():
    clips = _clips()
    t = ClipTransform(MEAN, STD, train=True, crop_scale=(1.0, 1.0), ratio=(1.0, 1.0), flip_p=1.0)
    torch.testing.assert_close(t(clips), _expected(clips).flip(-1), rtol=0, atol=1e-4)
    no_flip = ClipTransform(MEAN, STD, train=True, crop_scale=(1.0, 1.0), ratio=(1.0, 1.0), flip_p=0.0)
    torch.testing.assert_close(no_flip(clips), _expected(clips), rtol=0, atol=1e-4)


def test_same_crop_and_flip_for_every_frame_of_a_clip_different_across_clips():
    frame = _clips(b=1, t=1, h=24, w=24, seed=1)
    clips = frame.expand(8, 6, 24, 24, 3).contiguous()       # 8 clips of 6 identical frames
    out = ClipTransform(MEAN, STD, train=True, generator=torch.Generator().manual_seed(3))(clips)
    for b in range(8):                                        # frames of one clip stay identical
        for t in range(1, 6):
            torch.testing.assert_close(out[b, :, t], out[b, :, 0], rtol=0, atol=0)
    distinct = {tuple(out[b, :, 0].flatten()[:50].tolist()) for b in range(8)}
    assert len(distinct) == 8                                 # each clip its own draw


def test_crop_zooms_into_a_sub_window():
    # Horizontal ramp: column x holds value x. A crop keeping 1/4 of the area (half each side)
    # shows an increasing ramp spanning about half the columns' range (or decreasing if flipped).
    w = 64
    ramp = torch.arange(w, dtype=torch.uint8).view(1, 1, 1, w, 1).expand(16, 2, 32, w, 3).contiguous()
    t = ClipTransform((0, 0, 0), (1 / 255,) * 3, train=True, crop_scale=(0.25, 0.25), ratio=(1.0, 1.0),
                      generator=torch.Generator().manual_seed(0))
    out = t(ramp)[:, 0, 0, 16]                                # B x W: one row of each clip
    span = out.max(dim=1).values - out.min(dim=1).values
    assert torch.all((span > 0.4 * w) & (span < 0.6 * w)), span
    steps = out[:, 1:] - out[:, :-1]
    assert torch.all((steps >= -1e-4).all(dim=1) | (steps <= 1e-4).all(dim=1))  # monotone: a crop, no shuffle
    assert len({round(float(out[b, 0]), 2) for b in range(16)}) > 4                # crops at different places


def test_generator_makes_augmentation_reproducible():
    clips = _clips()
    a = ClipTransform(MEAN, STD, train=True, generator=torch.Generator().manual_seed(5))(clips)
    b = ClipTransform(MEAN, STD, train=True, generator=torch.Generator().manual_seed(5))(clips)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_output_float32_under_autocast():
    clips = _clips()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ClipTransform(MEAN, STD, train=True)(clips)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("kwargs,match", [
    (dict(mean=(0.5, 0.5)), "mean"),
    (dict(std=(0.2, 0.0, 0.2)), "std"),
    (dict(crop_scale=(0.0, 1.0)), "crop_scale"),
    (dict(crop_scale=(0.8, 0.5)), "crop_scale"),
    (dict(flip_p=1.5), "flip_p"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = {"mean": MEAN, "std": STD, "train": True, **kwargs}
    with pytest.raises(ValueError, match=match):
        ClipTransform(args.pop("mean"), args.pop("std"), **args)


def test_bad_input_is_refused_with_its_shape_or_dtype():
    t = ClipTransform(MEAN, STD, train=False)
    with pytest.raises(ValueError, match="uint8"):
        t(_clips().float())
    with pytest.raises(ValueError, match=r"\(3, 3, 4, 16, 20\)"):
        t(_clips().permute(0, 4, 1, 2, 3))                    # already B x C x T x H x W
