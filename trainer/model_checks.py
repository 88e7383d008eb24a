"""The checks of a config that need the model registry (torch, torchvision: seconds to import):
the model name, its Kinetics weights, the clip size against the model, a weights file. Run on the
driver, last among `trainer.launch.validate_config`'s checks, so a bad flag is refused first.
"""
from __future__ import annotations

from pathlib import Path

from vidtune.flags import ConfigError
from vidtune.trainer.config import TrainConfig
from vidtune.trainer.models import (
    WeightsError,
    build_model,
    check_input_size,
    fetch_kinetics,
    get_spec,
    has_kinetics_weights,
)

BUILTIN_WEIGHTS = ("none", "kinetics")


def check_model(cfg: TrainConfig) -> None:
    """`cfg`'s model, weights and clip size; ConfigError naming the flag at fault. A weights file
    is loaded onto a CPU model of that name, so a file of another architecture is refused here
    rather than after a cluster has been allocated."""
    try:   # an hf: model's checkpoint is fetched here, once, on the driver (a refusal: one line)
        get_spec(cfg.model)
    except ValueError as e:
        raise ConfigError("--model", str(e)) from None
    if cfg.weights == "kinetics" and not has_kinetics_weights(cfg.model):
        raise ConfigError("--weights", f"model {cfg.model!r} has no Kinetics weights; pass --weights none "
                          "(an hf: model then loads its checkpoint's own) or a state-dict file")
    if cfg.weights == "kinetics":   # fetched once, here: the workers read this machine's (or a copy)
        try:
            fetch_kinetics(cfg.model)
        except WeightsError as e:
            raise ConfigError("--weights", str(e)) from None
    _check_clip_size(cfg)
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
