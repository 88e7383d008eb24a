"""Damaged files are not used as whole ones: checkpoints carry checksums, a damaged one is never
named best nor resumed from (the run falls back to an older one, or starts again); a failed
trial's reason is its exception's line, its whole traceback kept; the console says when Train
restarted a trial. Unit tests: no Ray cluster, no search."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.train
import torch
from mlflow.tracking import MlflowClient

from vidtune.trainer.cluster.worker import METRIC_KEYS
from vidtune.trainer.models.registry import build_model, get_spec
from vidtune.trainer.training.checkpointing import (
    CHECKSUM_FILE,
    FILE_NAME,
    checkpoint_problem,
    save_checkpoint,
    verify_checkpoint,
)
from vidtune.trainer.training.history import write_history
from vidtune.trainer.training.loop import make_optimizer, make_scheduler
from vidtune.trainer.training.resume import first_whole_checkpoint, resume_candidates
from vidtune.tune.outputs import console, results
from vidtune.tune.running import faults
from vidtune.tune.tracking.schema import FAILURE_TAG, TRACEBACK_ARTIFACT, TRIAL_ID_TAG
from vidtune.tune.tracking.tracker import MLflowTracker


def _save(directory: Path, epoch: int, val_acc: float = 0.5) -> Path:
    torch.manual_seed(0)
    model = build_model("tiny")
    optimizer = make_optimizer(model, 1e-3, 0.0, torch.device("cpu"))
    scheduler = make_scheduler(optimizer, 4, 0.0)
    directory.mkdir(parents=True)
    write_history(directory, {e: {"epoch": e, "val_acc": val_acc} for e in range(1, epoch + 1)})
    save_checkpoint(directory, model=model, optimizer=optimizer,
                    scaler=torch.amp.GradScaler("cpu", enabled=False),
                    scheduler=scheduler, epoch=epoch, config={"model": "tiny"}, spec=get_spec("tiny"),
                    class_names={0: "a", 1: "b"}, metrics={"val_acc": val_acc})
    return directory


def _truncate(directory: Path) -> None:
    file = directory / FILE_NAME
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A Train run folder with two whole checkpoints (epochs 2 and 3)."""
    folder = tmp_path_factory.mktemp("run")
    _save(folder / "epoch_0002", 2, val_acc=0.6)
    _save(folder / "epoch_0003", 3, val_acc=0.8)
    return folder


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- checksums

def test_checksums_pass_on_a_whole_checkpoint_and_fail_on_a_truncated_one(run_folder, tmp_path):
    whole = _copy(run_folder / "epoch_0003", tmp_path / "whole")
    sums = json.loads((whole / CHECKSUM_FILE).read_text())
    assert set(sums) == {FILE_NAME, "epochs.json"}              # every file of the folder
    assert verify_checkpoint(whole)
    _truncate(whole)
    assert not verify_checkpoint(whole)
    assert "does not match its checksum" in checkpoint_problem(whole)
    (whole / FILE_NAME).unlink()
    assert "cannot be read" in checkpoint_problem(whole)


def test_a_checkpoint_from_before_checksums_is_checked_by_loading_it(run_folder, tmp_path):
    old = _copy(run_folder / "epoch_0002", tmp_path / "old")
    (old / CHECKSUM_FILE).unlink()
    assert verify_checkpoint(old)
    _truncate(old)
    assert "cannot be read" in checkpoint_problem(old)


# ---------------------------------------------------------------- resume

def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(run_folder, tmp_path):
    folder = tmp_path / "run"
    _copy(run_folder, folder)
    _truncate(folder / "epoch_0003")
    latest = ray.train.Checkpoint.from_directory(str(folder / "epoch_0003"))
    candidates = resume_candidates(latest)
    assert [Path(c.path).name for c in candidates] == ["epoch_0003", "epoch_0002"]
    found, damaged = first_whole_checkpoint(candidates)
    path, state, history = found
    assert Path(path).name == "epoch_0002" and state["epoch"] == 2 and sorted(history) == [1, 2]
    assert len(damaged) == 1 and "epoch_0003" in damaged[0]


def test_no_whole_checkpoint_means_starting_again(run_folder, tmp_path):
    folder = tmp_path / "run"
    _copy(run_folder, folder)
    for name in ("epoch_0002", "epoch_0003"):
        _truncate(folder / name)
    found, damaged = first_whole_checkpoint(resume_candidates(
        ray.train.Checkpoint.from_directory(str(folder / "epoch_0003"))))
    assert found is None and len(damaged) == 2
    assert {"damaged_checkpoints", "cache_repairs", "resumed_from_epoch"} <= set(METRIC_KEYS)


# ---------------------------------------------------------------- best checkpoint

def _fake_run(monkeypatch, checkpoints: list[tuple[Path, float, int]]) -> None:
    run = SimpleNamespace(best_checkpoints=[(SimpleNamespace(path=str(p)), {"val_acc": acc, "epoch": e})
                                            for p, acc, e in checkpoints])
    monkeypatch.setattr(ray.train.Result, "from_path", staticmethod(lambda path: run))


def test_a_truncated_best_checkpoint_is_not_named_best(run_folder, tmp_path, monkeypatch, capsys):
    folder = _copy(run_folder, tmp_path / "run")
    _truncate(folder / "epoch_0003")                      # the best by val_acc
    _fake_run(monkeypatch, [(folder / "epoch_0002", 0.6, 2), (folder / "epoch_0003", 0.8, 3)])
    result = SimpleNamespace(metrics={"checkpoint_path": str(folder / "epoch_0003")})
    # the next best, with its own epoch and val_acc
    assert results.best_checkpoint(str(folder), result, "t02") == (str(folder / "epoch_0002"), 2, 0.6)
    assert "t02: checkpoint" in capsys.readouterr().out

    _truncate(folder / "epoch_0002")
    path, epoch, acc = results.best_checkpoint(str(folder), result, "t02")
    assert (path, epoch) == (None, 0) and math.isnan(acc)
    assert "no whole checkpoint is left" in capsys.readouterr().out


def test_the_best_checkpoint_is_ranked_by_the_objective(run_folder, tmp_path, monkeypatch):
    """Under --objective val_f1 the checkpoint named best is the one of the best F1, not of the
    best accuracy; and among trials whose best epoch has no whole checkpoint, the objective's
    value at each kept checkpoint decides."""
    folder = _copy(run_folder, tmp_path / "run")
    kept = [(folder / "epoch_0002", {"val_acc": 0.8, "val_f1": 0.5, "epoch": 2}),
            (folder / "epoch_0003", {"val_acc": 0.7, "val_f1": 0.75, "epoch": 3})]
    run = SimpleNamespace(best_checkpoints=[(SimpleNamespace(path=str(p)), m) for p, m in kept])
    monkeypatch.setattr(ray.train.Result, "from_path", staticmethod(lambda path: run))
    result = SimpleNamespace(metrics={})
    assert results.best_checkpoint(str(folder), result, "t")[:2] == (str(folder / "epoch_0002"), 2)
    assert results.best_checkpoint(str(folder), result, "t", metric="val_f1") == \
        (str(folder / "epoch_0003"), 3, 0.7)           # its epoch, and that epoch's val_acc
    t01 = results.TrialResult("a_00001", 4, 1e-3, 0.8, 0.5, 10.0, 1.0, 4, "DONE", "/r/t01/epoch_0004",
                           name="t01", best_epoch=1, checkpoint_epoch=4, checkpoint_val_acc=0.8,
                           checkpoint_score=0.5)
    t02 = dataclasses.replace(t01, trial_id="a_00002", name="t02", checkpoint="/r/t02/epoch_0002",
                              best_epoch=1, checkpoint_epoch=2, checkpoint_val_acc=0.7, checkpoint_score=0.75)
    assert results.best_whole_checkpoint([t01, t02], t01) is t02


def test_the_best_checkpoint_is_the_best_whole_one_of_the_search():
    """The issue's case: t01's best epoch (0.500 at epoch 1) has a damaged checkpoint and its
    next whole one is epoch 4 (0.375); t02 has a whole 0.500 checkpoint. The search's best
    checkpoint is t02's, named with t02's own epoch and val_acc on every line, best_config too."""
    from vidtune.tune.summary import checkpoint_line

    t01 = results.TrialResult("a_00001", 4, 1e-3, 0.5, 0.5, 10.0, 1.0, 4, "DONE", "/r/t01/epoch_0004",
                           name="t01", best_epoch=1, checkpoint_epoch=4, checkpoint_val_acc=0.375,
                           checkpoint_score=0.375)
    t02 = dataclasses.replace(t01, trial_id="a_00002", name="t02", checkpoint="/r/t02/epoch_0002",
                              best_epoch=2, checkpoint_epoch=2, checkpoint_val_acc=0.5, checkpoint_score=0.5)
    assert results.best_whole_checkpoint([t01, t02], t01) is t02
    line = checkpoint_line(t01, t02)
    assert line == ("t01's epoch 1 has no whole checkpoint; the best whole one of the search: "
                    "best checkpoint (t02, epoch 2, val_acc 0.500): /r/t02/epoch_0002")
    # the best trial's own best epoch, when whole, is the answer; with none whole anywhere: none
    whole = dataclasses.replace(t01, checkpoint="/r/t01/epoch_0001", checkpoint_epoch=1,
                                checkpoint_val_acc=0.5, checkpoint_score=0.5)
    assert results.best_whole_checkpoint([whole, t02], whole) is whole
    assert checkpoint_line(whole, whole) == "best checkpoint (t01, epoch 1, val_acc 0.500): /r/t01/epoch_0001"
    gone = [dataclasses.replace(r, checkpoint=None) for r in (t01, t02)]
    assert results.best_whole_checkpoint(gone, gone[0]) is None
    assert checkpoint_line(gone[0], None).startswith("best checkpoint: none kept")


# ---------------------------------------------------------------- failure text

TRACEBACK = """Failure # 1 (occurred at 2026-12-01_16-00-00)
ray::ImplicitFunc.train() (pid=123, ip=10.0.0.1)
  File "/ray/tune/trainable/function_trainable.py", line 250, in train
    raise e
ray.train.WorkerGroupError: Training failed due to worker errors:
[Rank 0 Error Snippet]:
Traceback (most recent call last):
  File "/work/trainer/loop.py", line 80, in train_one_epoch
    loss.backward()
RuntimeError: CUDA error: an illegal memory access was encountered
CUDA kernel errors might be asynchronously reported at some other API call.
"""


def test_failure_reason_is_the_exception_line_and_the_traceback_is_kept(tmp_path):
    assert faults.exception_line(TRACEBACK) == ("RuntimeError: CUDA error: an illegal memory access "
                                                "was encountered")
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    experiment = tmp_path / "search-1"
    t = MLflowTracker(tracking_uri=uri, experiment="failures", experiment_path=str(experiment), epochs=2,
                      parent_params={}, parent_tags={}, child_params={})
    error_file = tmp_path / "session" / "error.txt"     # Ray's session folder: not kept
    error_file.parent.mkdir()
    error_file.write_text(TRACEBACK)
    trial = SimpleNamespace(trial_id="abc", config={"batch_size": 4, "lr": 1e-3}, last_result={},
                            error_file=str(error_file), experiment_tag="2_batch_size=4")
    t.setup()
    t.on_trial_start(0, [], trial)
    t.on_trial_error(0, [], trial)
    kept = experiment / "failures" / "t02-bs4-lr1e-3.txt"
    assert kept.read_text() == TRACEBACK
    c = MlflowClient(uri)
    run = c.search_runs([c.get_experiment_by_name("failures").experiment_id],
                        filter_string=f"tags.`{TRIAL_ID_TAG}` = 'abc'")[0]
    assert run.data.tags[FAILURE_TAG] == ("RuntimeError: CUDA error: an illegal memory access "
                                          f"was encountered (full traceback: {kept})")
    assert [a.path for a in c.list_artifacts(run.info.run_id, "failure")] == [TRACEBACK_ARTIFACT]


# ---------------------------------------------------------------- console

def test_console_says_when_a_worker_died_and_where_the_trial_continues(capsys):
    c = console.SearchConsole(num_samples=2, epochs=6, objective="val_acc")
    trial = SimpleNamespace(trial_id="x", config={"batch_size": 8, "lr": 1e-3}, experiment_tag="2_a",
                            status="RUNNING")
    c.on_trial_start(0, [trial], trial)
    for epoch in (1, 2, 3, 4):
        c.on_trial_result(0, [trial], trial, {"epoch": epoch, "val_acc": 0.5, "resumed_from_epoch": 0})
    assert "worker died" not in capsys.readouterr().out
    c.on_trial_result(0, [trial], trial, {"epoch": 5, "val_acc": 0.5, "resumed_from_epoch": 4,
                                          "cache_repairs": 3})
    out = capsys.readouterr().out
    assert "worker died; t02-bs8-lr1e-3 continues from epoch 4" in out
    assert "t02-bs8-lr1e-3: 3 damaged clip-cache entries decoded again" in out
    # A --resume (the trial started again in this process) is no worker death.
    assert console.restart_line("t02", {"resumed_from_epoch": 4}, worker_died=False) == \
        "t02 continues from epoch 4"
    assert console.restart_line("t02", {"resumed_from_epoch": 0, "damaged_checkpoints": 2},
                                worker_died=True) == \
        "worker died; t02 starts again from epoch 1: no whole checkpoint (2 damaged checkpoints skipped)"
    assert console.restart_line("t02", {"resumed_from_epoch": 0}, worker_died=True) is None
