"""The vidtune checkpoint: one `checkpoint.pt` file holding everything needed to resume a run
exactly (model, optimizer, GradScaler, scheduler, epoch) or to predict with it (model spec,
config, class names), written by rank 0 at the end of every epoch.

Loaded with `torch.load(weights_only=True)`: the file holds only tensors, numbers, strings and
containers of them, so loading a checkpoint cannot run code.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.models import load_error_detail, refused_pickle, unwrap

FILE_NAME = "checkpoint.pt"
FORMAT = "vidtune-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint or weights file cannot be used; the message names the file."""


def save_checkpoint(
    directory: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    epoch: int,
    config: dict[str, Any],
    spec: Any,
    class_names: dict[int, str],
    metrics: dict[str, Any] | None = None,
) -> Path:
    """Write `directory/checkpoint.pt`; `epoch` is the number of completed epochs (1-based).

    `spec` is the model's `ModelSpec` (a dataclass), `config` the run's `TrainConfig.to_dict()`.
    Written to a temporary name then renamed, so a crash never leaves a half-written file.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "format": FORMAT,
        "version": VERSION,
        "epoch": int(epoch),
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "scheduler": scheduler.state_dict(),
        "config": config,
        "spec": _plain(asdict(spec)),
        "class_names": {int(k): str(v) for k, v in class_names.items()},
        "metrics": _plain(metrics or {}),
    }
    path = directory / FILE_NAME
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def _plain(value: Any) -> Any:
    """Containers of Python scalars only (tuples kept), so `weights_only` loading accepts them."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def checkpoint_file(path: str | Path) -> Path:
    """`path` itself if it is a file, else `path/checkpoint.pt` (a Ray checkpoint directory)."""
    path = Path(path).expanduser()
    return path / FILE_NAME if path.is_dir() else path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a vidtune checkpoint (file or directory). Raises `CheckpointError` naming the path
    when it is missing, unreadable, or not a vidtune checkpoint."""
    file = checkpoint_file(path)
    if not file.is_file():
        raise CheckpointError(f"checkpoint {file} not found; pass the checkpoint directory printed at the end of training")
    try:
        state = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as e:  # pickle, zip and torch errors all mean the same to the user
        reason = refused_pickle(e)
        if reason is not None:
            raise CheckpointError(f"checkpoint {file} {reason}; vidtune's own checkpoints hold none, so this "
                                  "file was not written by trainer.train or a search") from None
        raise CheckpointError(f"checkpoint {file} cannot be read ({load_error_detail(e)}); it is damaged or not a torch file") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a vidtune checkpoint (no '{FORMAT}' marker); pass a directory written by trainer.train or a search")
    if state.get("version", 0) > VERSION:
        raise CheckpointError(f"checkpoint {file} has format version {state['version']}; this vidtune reads up to {VERSION}, upgrade it")
    return state


def restore_training_state(
    state: dict[str, Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> int:
    """Load a checkpoint's state into freshly built training objects (model already on its
    device; optimizer state is moved there by `load_state_dict`). Returns the first epoch still
    to run (1-based), i.e. the saved epoch + 1."""
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["epoch"]) + 1
