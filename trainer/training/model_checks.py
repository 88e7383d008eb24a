"""The checks of a config that need the model registry (torch, torchvision: seconds to import):
the model name, its Kinetics weights, the clip size against the model, an own model's factory
(built once, one dummy clip through it), a weights file. Run on the driver, last among
`trainer.ray_setup.launch.validate_config`'s checks, so a bad flag is refused first.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vidtune.flags import ConfigError
from vidtune.trainer.models.own_models import one_line
from vidtune.trainer.models.registry import (
    WeightsError,
    build_model,
    check_input_size,
    classifier,
    fetch_kinetics,
    get_spec,
    has_kinetics_weights,
    is_hf_model,
    is_own_model,
)
from vidtune.trainer.training.config import TrainConfig

NUM_CLASSES = 2   # what every run builds (violent or not): build_model's default

BUILTIN_WEIGHTS = ("none", "kinetics")


def check_model(cfg: TrainConfig) -> None:
    """`cfg`'s model, weights and clip size; ConfigError naming the flag at fault. A weights file
    is loaded onto a CPU model of that name, so a file of another architecture is refused here
    rather than after a cluster has been allocated."""
    try:   # an hf: model's checkpoint is fetched here, once, on the driver (a refusal: one line)
        get_spec(cfg.model)
    except ValueError as e:
        raise ConfigError("--model", str(e)) from None
    if cfg.weights == "kinetics" and is_own_model(cfg.model):
        raise ConfigError("--weights", f"own model {cfg.model} has no Kinetics weights vidtune could "
                          "load; load pretrained weights inside the factory and pass --weights none, or "
                          "pass a state-dict file")
    if cfg.weights == "kinetics" and not has_kinetics_weights(cfg.model):
        raise ConfigError("--weights", f"model {cfg.model!r} has no Kinetics weights; pass --weights none "
                          "(an hf: model then loads its checkpoint's own) or a state-dict file")
    if cfg.weights == "kinetics":   # fetched once, here: the workers read this machine's (or a copy)
        try:
            fetch_kinetics(cfg.model)
        except WeightsError as e:
            raise ConfigError("--weights", str(e)) from None
    _check_clip_size(cfg)
    if cfg.gradient_checkpointing and not is_hf_model(cfg.model):
        raise ConfigError("--gradient-checkpointing", f"model {cfg.model!r} has no gradient checkpointing in "
                          "vidtune (hf: models have it); drop the flag, or lower --batch-size and raise "
                          "--grad-accum to keep the effective batch")
    if is_own_model(cfg.model):
        _check_own_model(cfg)
    if cfg.weights not in BUILTIN_WEIGHTS:
        _check_weights_file(cfg.model, Path(cfg.weights))


def _check_clip_size(cfg: TrainConfig) -> None:
    spec, d = get_spec(cfg.model), cfg.data
    num_frames, height, width = (d.num_frames or spec.num_frames, d.height or spec.height,
                                 d.width or spec.width)
    try:
        check_input_size(cfg.model, num_frames, height, width)
    except ValueError as e:
        flag = ("--num-frames" if num_frames != spec.num_frames else
                "--height" if height != spec.height else "--width" if width != spec.width else "--model")
        raise ConfigError(flag, str(e)) from None


def _check_weights_file(model_name: str, path: Path) -> None:
    if not path.is_file():
        raise ConfigError(
            "--weights",
            f"{path} is not a file; pass 'none', 'kinetics' or the path of a saved state dict / "
            "vidtune checkpoint",
        )
    try:
        # Loads the file onto a CPU model of that name: refuses another architecture (only the
        # classification head may differ), a damaged file, or one that is not a state dict.
        build_model(model_name, weights=str(path))
    except WeightsError as e:
        raise ConfigError("--weights", str(e)) from None


def _check_own_model(cfg: TrainConfig) -> None:
    """An own model's factory, called as the workers will: it returns an nn.Module whose output for
    one dummy clip of the run's size, `1 x 3 x T x H x W`, is `1 x NUM_CLASSES` logits; with
    --freeze-backbone-epochs, it has a head to keep training (an nn.Linear). ConfigError("--model")
    naming the factory and what to do (the size's flags when the clip size is what it refuses)."""
    spec, d, name = get_spec(cfg.model), cfg.data, cfg.model
    size = (d.num_frames or spec.num_frames, d.height or spec.height, d.width or spec.width)
    try:
        model = build_model(name, num_classes=NUM_CLASSES)
    except Exception as e:  # noqa: BLE001 - the user's factory may raise anything
        raise ConfigError("--model", f"own model {name}: calling it as {name.rpartition(':')[2]}"
                          f"(num_classes={NUM_CLASSES}) raised {one_line(e)}; fix the factory") from None
    if not isinstance(model, nn.Module):
        raise ConfigError("--model", f"own model {name}: returned a {type(model).__name__}, not a "
                          "torch.nn.Module; return the model itself from the factory")
    clip = torch.zeros(1, 3, *size)
    try:
        with torch.inference_mode():
            out = model.eval()(clip)
    except Exception as e:  # noqa: BLE001 - the user's forward may raise anything
        resized = size != (spec.num_frames, spec.height, spec.width)
        raise ConfigError("--model", f"own model {name}: a float clip of shape {tuple(clip.shape)} "
                          f"(B x C x T x H x W) raised {one_line(e)}; make forward take its input spec's size"
                          + (", or leave --num-frames/--height/--width unset" if resized else "")) from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, NUM_CLASSES):
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
        raise ConfigError("--model", f"own model {name}: a clip of shape {tuple(clip.shape)} gave {got}, not "
                          f"logits of shape (1, {NUM_CLASSES}); return (batch, num_classes) logits, the "
                          "classes from the num_classes argument")
    if cfg.freeze_backbone_epochs:
        try:
            classifier(model)
        except TypeError:
            raise ConfigError("--freeze-backbone-epochs", f"own model {name} has no nn.Linear head to train "
                              "while the rest is frozen; name its last layer `head`, or leave "
                              "--freeze-backbone-epochs at 0") from None
