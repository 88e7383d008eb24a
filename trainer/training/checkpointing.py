"""The vidtune checkpoint: one `checkpoint.pt` file holding everything needed to resume a run
exactly (model, optimizer, GradScaler, scheduler, epoch, the precision it trained in) or to
predict with it (model spec, config, class names), written by rank 0 at the end of every epoch.

Loaded with `torch.load(weights_only=True)`: the file holds only tensors, numbers, strings and
containers of them, so loading a checkpoint cannot run code.

Beside it, `checksums.json` holds the SHA-256 of every file of the folder at save time:
`verify_checkpoint` checks them before a checkpoint is named best, uploaded or resumed from (a
copy cut short by a full disk or a killed upload reads as damaged, not as a model). Hashing costs
about a second per GB, once per epoch on rank 0.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vidtune.trainer.models.registry import load_error_detail, refused_pickle, unwrap

FILE_NAME = "checkpoint.pt"
CHECKSUM_FILE = "checksums.json"
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
    precision: str | None = None,
) -> Path:
    """Write `directory/checkpoint.pt`; `epoch` is the number of completed epochs (1-based).

    `spec` is the model's `ModelSpec` (a dataclass), `config` the run's `TrainConfig.to_dict()`,
    `precision` the one the run trained in (fp32 | fp16 | bf16: what `auto` became), which a
    resumed run keeps (`saved_precision`, `trainer.training.precision.trial_precision`).
    Written to a temporary name then renamed, so a crash never leaves a half-written file.
    Then `checksums.json` covers every file of `directory` (write any other file, such as
    `trainer.training.history`'s, before this call).
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
        "precision": precision,
    }
    path = directory / FILE_NAME
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    write_checksums(directory)
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksums(directory: str | Path) -> Path:
    """`directory/checksums.json`: {file name: SHA-256} of every file in `directory` (not its
    subfolders), written to a temporary name then renamed."""
    directory = Path(directory)
    sums = {f.name: _sha256(f) for f in sorted(directory.iterdir())
            if f.is_file() and f.name != CHECKSUM_FILE and not f.name.endswith(".tmp")}
    path = directory / CHECKSUM_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(sums, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path


def checkpoint_problem(directory: str | Path) -> str | None:
    """Why the checkpoint folder `directory` cannot be trusted, or None when it is whole: every
    file `checksums.json` lists is there with its SHA-256. A folder without `checksums.json`
    (written before checksums existed) is whole when its `checkpoint.pt` loads (`weights_only`)."""
    directory = Path(directory)
    sums_file = directory / CHECKSUM_FILE
    if not sums_file.is_file():
        try:
            load_checkpoint(directory)
        except CheckpointError as e:
            return str(e)
        return None
    try:
        sums = json.loads(sums_file.read_text())
        if not isinstance(sums, dict) or FILE_NAME not in sums:
            return f"{sums_file} is damaged (it lists no {FILE_NAME})"
    except (OSError, ValueError) as e:
        return f"{sums_file} is damaged ({e})"
    for name, expected in sorted(sums.items()):
        file = directory / str(name)
        try:
            if _sha256(file) != expected:
                return f"{file} does not match its checksum (truncated or overwritten)"
        except OSError as e:
            return f"{file} cannot be read ({e.strerror or e})"
    return None


def verify_checkpoint(directory: str | Path) -> bool:
    """True when the checkpoint folder `directory` is whole (`checkpoint_problem`)."""
    return checkpoint_problem(directory) is None


def first_whole(paths: list[str]) -> tuple[str | None, list[str]]:
    """(the first of the checkpoint folders `paths`, best first, that is whole, or None; why
    each one before it was skipped). Remote ones (a URI) are taken as they are: checking them
    would mean downloading them."""
    skipped: list[str] = []
    for path in paths:
        problem = None if "://" in str(path) else checkpoint_problem(path)
        if problem is None:
            return str(path), skipped
        skipped.append(f"checkpoint {path} is damaged ({problem})")
    return None, skipped


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
        raise CheckpointError(f"checkpoint {file} not found; pass the checkpoint directory printed at the "
                              "end of training")
    try:
        state = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as e:  # pickle, zip and torch errors all mean the same to the user
        reason = refused_pickle(e)
        if reason is not None:
            raise CheckpointError(f"checkpoint {file} {reason}; vidtune's own checkpoints hold none, so this "
                                  "file was not written by trainer.commands.train or a search") from None
        raise CheckpointError(f"checkpoint {file} cannot be read ({load_error_detail(e)}); it is damaged or "
                              "not a torch file") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a vidtune checkpoint (no '{FORMAT}' marker); pass a directory "
                              "written by trainer.commands.train or a search")
    if state.get("version", 0) > VERSION:
        raise CheckpointError(f"checkpoint {file} has format version {state['version']}; this vidtune reads "
                              f"up to {VERSION}, upgrade it")
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
    # A checkpoint trained without loss scaling (bf16, fp32) has an empty scaler state, which an
    # enabled scaler refuses ("source state dict is empty"): one resumed in fp16 (a bf16 trial
    # rescheduled onto a T4) starts from a fresh scaler, which finds its scale in its first steps.
    if state["scaler"] or not scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])
    scheduler.load_state_dict(state["scheduler"])
    return saved_epoch(state) + 1


def saved_precision(state: dict[str, Any] | None) -> str | None:
    """The precision a loaded checkpoint's run trained in (fp32 | fp16 | bf16), None when there is
    no checkpoint or it does not say (written before vidtune recorded it)."""
    precision = (state or {}).get("precision")
    return precision if isinstance(precision, str) else None


def saved_epoch(state: dict[str, Any]) -> int:
    """The epoch a loaded checkpoint ends (1-based: the epochs it completed), from its state
    (`load_checkpoint`)."""
    return int(state["epoch"])
