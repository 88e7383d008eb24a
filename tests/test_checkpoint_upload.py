"""Rank 0's checkpoint goes to the storage while the next epoch trains
(`trainer.cluster.checkpoint_upload`): the local folder outlives `_report` until Ray has copied
it, the next epoch starts before the upload ends, and a rerun resumes from the last whole one."""
from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.train

from vidtune.datasets.config import DataConfig
from vidtune.trainer.cluster import worker
from vidtune.trainer.cluster.build_trainer import build_torch_trainer
from vidtune.trainer.training import history
from vidtune.trainer.training.checkpointing import checkpoint_problem, load_checkpoint
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.resume import first_whole_checkpoint, resume_candidates


class _FakeRay:
    """`ray.train.report` / `get_checkpoint` of a Train V2 worker whose uploads run only when
    the test says so (`upload_next`, which then deletes the local folder as Ray does)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.queued: list[tuple[ray.train.Checkpoint, str]] = []
        self.committed: str | None = None
        self.uploaded: list[set[str]] = []
        self.looked = threading.Semaphore(0)   # released on every get_checkpoint

    def report(self, metrics, checkpoint=None, checkpoint_dir_name=None, **kwargs):
        self.calls.append({"metrics": metrics, "name": checkpoint_dir_name, **kwargs})
        if checkpoint is not None:
            self.queued.append((checkpoint, checkpoint_dir_name))

    def upload_next(self) -> None:
        checkpoint, name = self.queued.pop(0)
        self.uploaded.append({p.name for p in Path(checkpoint.path).iterdir()})  # fails once deleted
        shutil.rmtree(checkpoint.path)
        self.committed = name

    def get_checkpoint(self):
        self.looked.release()
        return None if self.committed is None else SimpleNamespace(path=f"/storage/run/{self.committed}/")


def test_rank_0_reports_before_the_upload_and_keeps_the_folder_until_it_is_done(monkeypatch):
    fake = _FakeRay()
    monkeypatch.setattr(ray.train, "report", fake.report)
    monkeypatch.setattr(ray.train, "get_checkpoint", fake.get_checkpoint)
    def save(run, directory, *, epoch, metrics):
        (Path(directory) / "checkpoint.pt").write_text(str(epoch))

    monkeypatch.setattr(worker, "save_run_checkpoint", save)
    w = worker._Worker(run=SimpleNamespace(rank=0), slot=SimpleNamespace())
    worker._report(w, 1, {"epoch": 1})
    # _report returned with the upload still to do: the folder must still be there, whole
    assert fake.calls[0]["checkpoint_upload_mode"] is ray.train.CheckpointUploadMode.ASYNC
    assert fake.calls[0]["delete_local_checkpoint_after_upload"] is True   # Ray deletes it, after the copy
    assert fake.calls[0]["name"] == "epoch_0001"
    fake.upload_next()
    assert fake.uploaded == [{"checkpoint.pt", history.FILE_NAME}]

    # Epoch 1 is committed: epoch 2 is reported at once. Epoch 3 waits for epoch 2's upload
    # (at most two local copies), and is reported once Ray has committed it.
    worker._report(w, 2, {"epoch": 2})
    reporter = threading.Thread(target=worker._report, args=(w, 3, {"epoch": 3}))
    reporter.start()
    for _ in range(3):   # it asked Ray three times whether epoch 2 is committed, and did not report
        assert fake.looked.acquire(timeout=30)
    assert [c["name"] for c in fake.calls] == ["epoch_0001", "epoch_0002"]
    fake.upload_next()
    reporter.join(timeout=30)
    assert [c["name"] for c in fake.calls] == ["epoch_0001", "epoch_0002", "epoch_0003"]
    fake.upload_next()
    assert fake.uploaded[1:] == [{"checkpoint.pt", history.FILE_NAME}] * 2


def _slow_storage(events: Path):
    """A local pyarrow filesystem whose first write into `epoch_0001/` waits until the worker is
    training again (some thread inside `train_one_epoch`), up to 60 s, and writes to `events`
    whether it saw that. Defined in a function so Ray pickles it by value (workers cannot import
    tests/)."""
    import fsspec.implementations.local
    from pyarrow import fs

    class SlowHandler(fs.FSSpecHandler):
        def __init__(self, events_path: str):
            super().__init__(fsspec.implementations.local.LocalFileSystem())
            self.events_path = events_path
            self.waited = False

        def __reduce__(self):
            return SlowHandler, (self.events_path,)

        def open_output_stream(self, path, metadata):
            if "/epoch_0001/" in path and not self.waited:
                self.waited = True
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not _training_now():
                    time.sleep(0.05)
                with open(self.events_path, "a") as f:
                    f.write(("trained during upload" if _training_now() else "no training during upload")
                            + f" {time.time()}\n")
            return super().open_output_stream(path, metadata)

    def _training_now() -> bool:
        for frame in sys._current_frames().values():
            while frame is not None:
                if frame.f_code.co_name == "train_one_epoch":
                    return True
                frame = frame.f_back
        return False

    return fs.PyFileSystem(SlowHandler(str(events)))


@pytest.mark.slow
def test_the_next_epoch_trains_while_the_checkpoint_uploads_and_a_rerun_resumes_whole(
        ray_session, synthetic_root, tmp_path):
    """Through Ray Train on a storage whose upload of epoch 1 holds until training runs again:
    today's synchronous upload never sees it (the worker waits in `ray.train.report`)."""
    events = tmp_path / "events.txt"
    cfg = TrainConfig(data=DataConfig(root=str(synthetic_root), loader_workers=1), model="tiny",
                      precision="fp32", lr=1e-3, epochs=2, batch_size=8)
    storage = tmp_path / "storage"
    storage.mkdir()
    result = build_torch_trainer(cfg, name="async-upload", storage_path=str(storage),
                                 storage_filesystem=_slow_storage(events)).fit()
    lines = events.read_text().splitlines()
    assert [line.rsplit(" ", 1)[0] for line in lines] == ["trained during upload"]
    epoch_2 = result.metrics_dataframe["epoch_start_ts"].iloc[-1]
    assert epoch_2 < float(lines[0].rsplit(" ", 1)[1])     # epoch 2 started before upload 1 ended

    # Both checkpoints are whole, and a rerun picks the last one.
    found, damaged = first_whole_checkpoint(resume_candidates(result.checkpoint))
    assert damaged == [] and found is not None and Path(found[0]).name == "epoch_0002"
    assert load_checkpoint(Path(found[0]))["epoch"] == 2
    assert checkpoint_problem(storage / "async-upload" / "epoch_0001") is None
