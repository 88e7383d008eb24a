"""Which checkpoint a rerun resumes from: the latest Ray hands back when it is whole, else the
newest whole one of the run's other checkpoints (`checkpointing.checkpoint_problem` decides
whole). Used by the Train worker (`trainer.cluster.worker`) as a run starts again.
"""
from __future__ import annotations

import contextlib
import posixpath
from typing import Any

import ray.train
from pyarrow import fs

from vidtune.atomic_fs import is_local
from vidtune.trainer.training.checkpointing import CheckpointError, checkpoint_problem, load_checkpoint
from vidtune.trainer.training.history import read_history


def resume_candidates(latest: ray.train.Checkpoint) -> list[ray.train.Checkpoint]:
    """`latest`, then the other checkpoint folders (`epoch_*`) of its run, newest first (by name:
    epochs are zero-padded), on the same filesystem (local or remote)."""
    here = latest.path.rstrip("/")
    infos = latest.filesystem.get_file_info(fs.FileSelector(posixpath.dirname(here), allow_not_found=True))
    others = sorted((i.path for i in infos if i.type == fs.FileType.Directory
                     and posixpath.basename(i.path).startswith("epoch_") and i.path.rstrip("/") != here),
                    key=posixpath.basename, reverse=True)
    return [latest, *(ray.train.Checkpoint(path, filesystem=latest.filesystem) for path in others)]


def first_whole_checkpoint(candidates: list[ray.train.Checkpoint]
                           ) -> tuple[tuple[str, dict[str, Any], dict[int, dict]] | None, list[str]]:
    """((path, state, history) of the first of `candidates` that is whole and loads, or None;
    why each one before it was skipped). Remote checkpoints are downloaded to be checked."""
    damaged: list[str] = []
    for checkpoint in candidates:
        # a local storage's own folder, read in place: no copy (Ray copies from any other filesystem)
        local = is_local(checkpoint.filesystem)
        with contextlib.nullcontext(checkpoint.path) if local else checkpoint.as_directory() as directory:
            problem = checkpoint_problem(directory)
            if problem is None:
                try:
                    return (checkpoint.path, load_checkpoint(directory), read_history(directory)), damaged
                except CheckpointError as e:
                    problem = str(e)
        damaged.append(f"checkpoint {checkpoint.path} is damaged: {problem}")
    return None, damaged
