"""A full disk under --storage, simulated (errno 28 raised by a write): Ray's copies into the
storage leave each file whole or absent (vidtune.atomic_fs), the first trial that failed on it
stops the search as unfinished without a retry (tune.running.disk_full), its row and the summary count it
as run, and the search's last line says where, how much to free and the command that continues.
The real disk (a small tmpfs) is tests/test_faults.py's."""
from __future__ import annotations

import errno
import io
import signal
from pathlib import Path
from types import SimpleNamespace

import pyarrow.fs as pafs
import pytest
from ray.train._internal.storage import _pyarrow_fs_copy_files  # how Tune and Train copy into storage

import vidtune.atomic_fs as atomic_fs
from vidtune.atomic_fs import AtomicLocalHandler, atomic_local_fs, storage_filesystem
from vidtune.tune.outputs import results
from vidtune.tune.running import disk_full, faults

ENOSPC_TEXT = ("ray.train.WorkerGroupError: ...\nOSError: [Errno 28] Error writing bytes to file. Detail: "
               "[errno 28] No space left on device\n")


class _FillsUp(io.FileIO):
    """A file on a disk with `room` bytes left: the write past them raises ENOSPC."""

    room = 5

    def write(self, data) -> int:
        if len(data) > _FillsUp.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        _FillsUp.room -= len(data)
        return super().write(data)


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "checkpoint.pt").write_bytes(b"w" * 4096)
    return src


def test_a_copy_into_storage_meeting_a_full_disk_leaves_the_old_file_and_no_empty_one(tmp_path, monkeypatch):
    dest = tmp_path / "storage" / "epoch_0002"
    dest.mkdir(parents=True)
    (dest / "checkpoint.pt").write_bytes(b"old whole checkpoint")
    src, _FillsUp.room = _source(tmp_path), 5
    monkeypatch.setattr(atomic_fs, "open", lambda path, mode: _FillsUp(path, "w"), raising=False)
    with pytest.raises(OSError, match="No space left"):
        _pyarrow_fs_copy_files(str(src), str(dest), source_filesystem=pafs.LocalFileSystem(),
                               destination_filesystem=atomic_local_fs())
    assert [p.name for p in dest.iterdir()] == ["checkpoint.pt"]          # no temporary file left
    assert (dest / "checkpoint.pt").read_bytes() == b"old whole checkpoint"
    (dest / "checkpoint.pt").unlink()
    _FillsUp.room = 5
    with pytest.raises(OSError, match="No space left"):
        _pyarrow_fs_copy_files(str(src), str(dest), source_filesystem=pafs.LocalFileSystem(),
                               destination_filesystem=atomic_local_fs())
    assert list(dest.iterdir()) == []                                     # absent, not zero bytes


def test_a_copy_with_room_is_whole_and_the_filesystem_travels_to_rays_workers(tmp_path):
    import pickle

    dest = tmp_path / "storage"
    fs = atomic_local_fs()
    fs.create_dir(str(dest))
    _pyarrow_fs_copy_files(str(_source(tmp_path)), str(dest), source_filesystem=pafs.LocalFileSystem(),
                           destination_filesystem=fs)
    assert (dest / "checkpoint.pt").read_bytes() == b"w" * 4096
    assert [p.name for p in dest.iterdir()] == ["checkpoint.pt"]
    again = pickle.loads(pickle.dumps(fs))
    assert isinstance(again.handler, AtomicLocalHandler) and again == fs
    assert storage_filesystem("s3://bucket/searches") is None and storage_filesystem(str(tmp_path)) == fs


def test_tune_and_train_write_into_a_local_storage_through_the_atomic_filesystem(tmp_path):
    from vidtune.trainer.cluster.build_trainer import build_torch_trainer
    from vidtune.trainer.training.config import TrainConfig

    trainer = build_torch_trainer(TrainConfig(), name="t01", storage_path=str(tmp_path))
    assert isinstance(trainer.run_config.storage_filesystem.handler, AtomicLocalHandler)
    assert build_torch_trainer(TrainConfig(), name="t01").run_config.storage_filesystem is None


def _trial(tmp_path: Path, trial_id: str, status: str, error: str | None = None) -> SimpleNamespace:
    error_file = None
    if error is not None:
        error_file = tmp_path / f"{trial_id}-error.txt"
        error_file.write_text(error)
    return SimpleNamespace(trial_id=trial_id, status=status,
                           error_file=str(error_file) if error_file else None)


@pytest.fixture
def usr1(monkeypatch):
    """Tune's graceful-stop signal, caught here: the signals it got."""
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
    faults.reset()
    yield got
    signal.signal(signal.SIGUSR1, previous)
    faults.reset()


def test_the_first_trial_that_fails_on_a_full_disk_stops_the_search_unfinished(tmp_path, usr1):
    failed = _trial(tmp_path, "a", "PENDING", ENOSPC_TEXT)            # Tune has just queued its retry
    others = [failed, _trial(tmp_path, "b", "TERMINATED"), _trial(tmp_path, "c", "PENDING")]
    disk_full.DiskFullStop().on_trial_recover(1, others, failed)
    assert usr1 == [signal.SIGUSR1]                                       # Tune stops before the next step
    assert faults.STATE.disk_full == "No space left on device"
    assert faults.trial_unfinished("a") and faults.trial_unfinished("c") and not faults.trial_unfinished("b")
    assert isinstance(disk_full.stopped_error(), OSError) and disk_full.stopped_error().errno == errno.ENOSPC
    disk_full.DiskFullStop().on_trial_error(1, others, others[2])         # stopping already: one stop
    assert usr1 == [signal.SIGUSR1]


def test_a_trial_that_failed_by_itself_stops_nothing(tmp_path, usr1):
    failed = _trial(tmp_path, "a", "ERROR", "ValueError: a bug\n")
    disk_full.DiskFullStop().on_trial_error(1, [failed], failed)
    assert usr1 == [] and faults.STATE.disk_full is None and disk_full.stopped_error() is None
    assert not faults.trial_unfinished("a")


def test_a_trial_stopped_unfinished_is_a_row_to_continue_not_an_error():
    result = SimpleNamespace(metrics={"epoch": 2, "val_acc": 0.6, "oom": 0},
                             config={"batch_size": 4, "lr": 1e-3}, metrics_dataframe=None,
                             error=RuntimeError("[Errno 28] No space left on device"))
    assert results.row_from_result(result, trial_id="a", epochs=4, finished=False).status == "UNFINISHED"
    assert results.row_from_result(result, trial_id="a", epochs=4, finished=True).status == "ERROR"


def test_the_last_line_says_where_how_much_to_free_and_the_command_that_continues(tmp_path):
    experiment = tmp_path / "s" / "ray"
    epoch = experiment / "train_runs" / "t01" / "epoch_0001"
    epoch.mkdir(parents=True)
    (epoch / "checkpoint.pt").write_bytes(b"x" * (1 << 20))
    line = disk_full.message(str(tmp_path), str(experiment), str(tmp_path / "s"), "No space left on device",
                             trials_left=2, resumable=True, last_good=False,
                             resume="vidtune search --resume --name s --storage DIR")
    assert "\n" not in line and line.startswith(f"disk full at {tmp_path} (No space left on device)")
    assert "a checkpoint is 1.0 MB; each of the 2 trials left keeps up to 3" in line
    assert "free at least " in line and line.endswith("with: vidtune search --resume --name s --storage DIR")
    assert disk_full.space_needed(str(experiment), "s3://bucket", 2) == ""


def test_a_checkpoint_in_a_local_storage_is_read_in_place_not_copied_first(tmp_path, monkeypatch):
    """Train hands a resumed worker its checkpoint on the storage's filesystem; on the atomic one
    Ray's `as_directory` would copy it to a temporary folder first (a whole model, each resume)."""
    import ray.train

    from vidtune.trainer.training.checkpointing import write_checksums
    from vidtune.trainer.training.resume import first_whole_checkpoint

    folder = tmp_path / "run" / "epoch_0001"
    folder.mkdir(parents=True)
    (folder / "checkpoint.pt").write_bytes(b"not a model")
    write_checksums(folder)

    def copied(self):
        raise AssertionError("copied to a temporary folder")

    monkeypatch.setattr(ray.train.Checkpoint, "as_directory", copied)
    found, damaged = first_whole_checkpoint([ray.train.Checkpoint(str(folder), filesystem=atomic_local_fs())])
    assert found is None and len(damaged) == 1 and str(folder) in damaged[0]   # read, in place


def test_the_console_and_mlflow_say_nothing_of_the_error_of_a_trial_the_disk_stopped(tmp_path, usr1, capsys):
    """With --max-failures 0 Tune reports the trial as an error (`on_trial_error`) after
    `DiskFullStop`: the console prints no FAILED line nor traceback, and its MLflow run stays open
    (KILLED at the end, reopened by --resume), not FAILED; another trial's error is said as before."""
    from mlflow.tracking import MlflowClient

    from vidtune.tune.outputs.console import SearchConsole
    from vidtune.tune.tracking.tracker import MLflowTracker

    tracker = MLflowTracker(tracking_uri=f"sqlite:///{tmp_path / 'mlruns.db'}", experiment="e",
                            experiment_path=str(tmp_path / "s" / "ray"), epochs=2, parent_params={},
                            parent_tags={}, child_params={})
    tracker.setup()
    screen = SearchConsole(num_samples=2, epochs=2, objective="val_acc", tty=False)
    stopped = SimpleNamespace(**vars(_trial(tmp_path, "a", "ERROR", ENOSPC_TEXT)), config={"batch_size": 4})
    own = SimpleNamespace(**vars(_trial(tmp_path, "b", "ERROR", "ValueError: a bug\n")),
                          config={"batch_size": 4})
    for trial in (stopped, own):
        tracker.on_trial_start(0, [], trial)
    capsys.readouterr()
    disk_full.DiskFullStop().on_trial_error(1, [stopped, own], stopped)
    for callback in (tracker, screen):
        callback.on_trial_error(1, [stopped, own], stopped)
    assert capsys.readouterr().out == ""
    for callback in (tracker, screen):
        callback.on_trial_error(1, [stopped, own], own)
    assert "FAILED: ValueError: a bug" in capsys.readouterr().out
    c = MlflowClient(tracker.tracking_uri)
    assert c.get_run(tracker.child_runs["a"]).info.status == "RUNNING"
    assert c.get_run(tracker.child_runs["b"]).info.status == "FAILED"
