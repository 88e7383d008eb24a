"""Rank 0's checkpoints on their way to the storage while the next epoch trains.

A checkpoint (model and AdamW state: about 1 GB for swin3d_b) is written to a local folder, then
handed to Ray Train's own background upload (`ray.train.report(...,
checkpoint_upload_mode=CheckpointUploadMode.ASYNC)`, Train V2): the call returns at once, Ray
copies the folder to the storage on its upload thread, one checkpoint at a time and in report
order, then deletes the local folder and only then commits the checkpoint (so
`ray.train.get_checkpoint()`, a rerun's resume and Tune see only whole copies) and passes the
epoch's metrics on. When the training function returns, Ray waits for the uploads still running.

At most two local copies exist: before reporting a checkpoint, `report` waits until the
previous one is committed (only when an upload takes longer than an epoch). An upload that fails
is the worker's error (Ray passes it on from its upload thread): the run restarts from the last
committed checkpoint, as after any failure (`--max-failures`).
"""
from __future__ import annotations

import posixpath
import tempfile
import time
from typing import Any

import ray.train

# How often `wait_for_previous` looks whether Ray has committed the previous checkpoint.
POLL_S = 0.2


class CheckpointUploads:
    """Rank 0's checkpoint folders and their background uploads, one run."""

    def __init__(self) -> None:
        self.pending: str | None = None   # checkpoint_dir_name of the last checkpoint reported

    @staticmethod
    def new_folder() -> str:
        """A new local folder for the next checkpoint. Ray deletes it once it is uploaded."""
        return tempfile.mkdtemp(prefix="vidtune-ckpt-")

    def report(self, metrics: dict[str, Any], directory: str, name: str) -> None:
        """`ray.train.report` of `metrics` with the checkpoint in `directory`, stored as `name`
        under the run's folder; returns before the upload ends."""
        self.wait_for_previous()
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                         checkpoint_dir_name=name,
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=True)
        self.pending = name

    def wait_for_previous(self) -> None:
        """Block until the last checkpoint reported is uploaded and committed (Ray's latest)."""
        while self.pending is not None and not self._committed(self.pending):
            time.sleep(POLL_S)
        self.pending = None

    @staticmethod
    def _committed(name: str) -> bool:
        latest = ray.train.get_checkpoint()
        return latest is not None and posixpath.basename(latest.path.rstrip("/")) == name
