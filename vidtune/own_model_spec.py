"""The input spec of your own model, set beside its factory (`docs/own-model.md`):

    from vidtune.own_model_spec import video_model

    @video_model(num_frames=16, height=112, width=112)
    def build(num_classes: int = 2) -> nn.Module: ...

    vidtune search --data DIR --model mymodels:build

The spec is the factory's `input_spec` attribute, a dict with the keys `SPEC_KEYS`: clips of
`num_frames x height x width` RGB frames, normalised as `(x / 255 - mean) / std`. `video_model`
only sets it (checked at once, so a mistake shows when the module is imported); a module that
sets `build.input_spec = {...}` itself need not import vidtune. Standard library only: importing
this costs nothing, and `trainer.models.own_models` reads the same attribute with `checked_input_spec`.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

SPEC_ATTRIBUTE = "input_spec"
SIZE_KEYS = ("num_frames", "height", "width")
SPEC_KEYS = (*SIZE_KEYS, "mean", "std")
# ImageNet's RGB statistics: what most pretrained image and video backbones were trained with
# (timm, Hugging Face's video processors, torchvision's Swin3D).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

Factory = TypeVar("Factory", bound=Callable[..., Any])


def video_model(*, num_frames: int, height: int, width: int,
                mean: tuple[float, float, float] = IMAGENET_MEAN,
                std: tuple[float, float, float] = IMAGENET_STD) -> Callable[[Factory], Factory]:
    """Decorator giving a model factory its input spec (its `input_spec` attribute): clips of
    `num_frames` frames of `height x width` RGB, each channel normalised as `(x / 255 - mean) / std`
    (mean and std in [0, 1] units, one per channel). ValueError naming the key at fault."""
    spec = checked_input_spec({"num_frames": num_frames, "height": height, "width": width,
                               "mean": mean, "std": std})

    def mark(factory: Factory) -> Factory:
        setattr(factory, SPEC_ATTRIBUTE, dict(spec))
        return factory

    return mark


def checked_input_spec(value: Any) -> dict[str, Any]:
    """`value` as a spec dict: ints >= 1 for the size, three finite floats for mean and std (std > 0;
    both default to ImageNet's when absent). ValueError in one line naming the key at fault."""
    if not isinstance(value, dict):
        raise ValueError(f"is a {type(value).__name__}, not a dict with the keys {', '.join(SPEC_KEYS)}")
    unknown = sorted(str(k) for k in value if k not in SPEC_KEYS)
    missing = [k for k in SIZE_KEYS if k not in value]
    if unknown or missing:
        wrong = ([f"has no {', '.join(missing)}"] if missing else []) + (
            [f"has unknown key(s) {', '.join(unknown)}"] if unknown else [])
        raise ValueError(f"{' and '.join(wrong)} (its keys: {', '.join(SPEC_KEYS)}; mean and std optional)")
    spec: dict[str, Any] = {}
    for key in SIZE_KEYS:
        n = value[key]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{key} must be a whole number >= 1, not {n!r}")
        spec[key] = n
    for key, default in (("mean", IMAGENET_MEAN), ("std", IMAGENET_STD)):
        spec[key] = _three_floats(key, value.get(key, default))
    if min(spec["std"]) <= 0:
        raise ValueError(f"std must be above 0 for every channel, not {spec['std']}")
    return spec


def _three_floats(key: str, value: Any) -> tuple[float, float, float]:
    try:
        numbers = tuple(float(v) for v in value if not isinstance(v, bool))
        if len(numbers) != 3 or len(numbers) != len(value):
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be three numbers, one per RGB channel (e.g. {IMAGENET_MEAN}), "
                         f"not {value!r}") from None
    if not all(math.isfinite(v) for v in numbers):
        raise ValueError(f"{key} must be finite numbers, not {value!r}")
    return numbers   # type: ignore[return-value]  # three, checked above

