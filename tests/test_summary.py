"""The end of a search as a value: `tune.summary.summarise` computes the Summary from Tune's
results alone (trials.csv, best_config.json and the plots written; no MLflow store touched), and
the tracker records in MLflow what it is handed. Fake Tune results, a SQLite store, no Ray."""
from __future__ import annotations

import csv
import errno
import json
import os
import shlex
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from vidtune import atomic, servers
from vidtune.tune.config.options import base_config, parse_options
from vidtune.tune.outputs.found import Summary
from vidtune.tune.preflight import Plan
from vidtune.tune.running import faults
from vidtune.tune.summary import print_summary, summarise
from vidtune.tune.tracking.description import spaced_table
from vidtune.tune.tracking.schema import BEST_TAG, TRIAL_ID_TAG
from vidtune.tune.tracking.tracker import MLflowTracker

EPOCHS = 2
# trial name -> (batch size, lr, val_acc per epoch)
TRIALS = {"t01-bs4-lr1e-3": (4, 1e-3, (0.55, 0.70)), "t02-bs4-lr2e-4": (4, 2e-4, (0.50, 0.60))}


def _plan(tmp_path: Path) -> Plan:
    opts = parse_options(["--smoke-test", "--epochs", str(EPOCHS), "--num-samples", str(len(TRIALS)),
                          "--storage", str(tmp_path / "results"), "--name", "s"])
    plan = Plan(opts=opts, base=base_config(opts), storage=str(tmp_path / "results"), name="s", demo=False)
    Path(plan.experiment_path).mkdir(parents=True)
    return plan


def _results(plan: Plan) -> list[SimpleNamespace]:
    """A stand-in for Tune's ResultGrid: one finished Result per trial, every epoch reported."""
    out, trials = [], []
    for i, (name, (batch, lr, accs)) in enumerate(TRIALS.items()):
        epochs = [{"epoch": e, "val_acc": acc, "val_f1": acc - 0.05, "clips_per_s": 20.0 + e,
                   "compute_clips_per_s": 40.0, "epoch_time_s": 5.0, "concurrent_trainings": 1.0, "oom": 0,
                   "train_loss": 0.6, "batch_size": batch, "timestamp": 1_700_000_000 + e}
                  for e, acc in enumerate(accs, start=1)]
        out.append(SimpleNamespace(metrics=dict(epochs[-1]), config={"batch_size": batch, "lr": lr},
                                   error=None, metrics_dataframe=pd.DataFrame(epochs),
                                   path=f"{plan.experiment_path}/{name}"))
        trials.append(SimpleNamespace(trial_id=f"abc_0000{i}", status="TERMINATED"))

    class Grid(list):   # what tune.running.ray_internals.trial_states reads
        _experiment_analysis = SimpleNamespace(trials=trials)

    return Grid(out)


@pytest.fixture
def summary(tmp_path, monkeypatch) -> tuple[Plan, Summary]:
    """A search's Summary, computed where any MLflow client would fail."""
    monkeypatch.chdir(tmp_path)   # the default store, sqlite:///mlruns.db, would land here

    def no_store(*args, **kwargs):
        raise AssertionError("computing the summary touched MLflow")

    with monkeypatch.context() as m:
        m.setattr(MlflowClient, "__init__", no_store)
        plan = _plan(tmp_path)
        return plan, summarise(plan, plan.opts, _results(plan))


def test_a_summary_is_computed_without_mlflow(summary, tmp_path):
    plan, done = summary
    assert [p.name for p in tmp_path.iterdir()] == ["results"]          # no mlruns.db, no mlruns/
    assert [r.status for r in done.rows] == ["DONE", "DONE"] and not done.interrupted
    assert done.best is not None and done.best.name == "t01-bs4-lr1e-3" and done.best.val_acc == 0.70
    assert done.answer and "t01-bs4-lr1e-3" in " ".join(done.answer)
    assert [t for t, _ in done.trial_states] == ["abc_00000", "abc_00001"]
    assert {"trials_csv", "best_config", "history", "params", "scatter"} <= set(done.files)
    # the user's files at the top of the search's folder; Tune's state in its subfolder
    assert all(path.parent == Path(plan.search_path) for path in done.files.values())
    assert Path(plan.experiment_path) == Path(plan.search_path) / "ray"
    with open(done.files["trials_csv"]) as f:
        assert [r["name"] for r in csv.DictReader(f)] == ["t01-bs4-lr1e-3", "t02-bs4-lr2e-4"]
    best_config = json.loads(done.files["best_config"].read_text())
    assert (best_config["name"], best_config["train_config"]["lr"]) == ("t01-bs4-lr1e-3", 1e-3)
    assert "t01-bs4-lr1e-3" in done.table_markdown


def test_the_summary_prints_without_a_tracker(summary, capsys):
    plan, done = summary
    code = print_summary(plan, plan.opts, done, mlflow_links="compare the trials in MLflow: (links)",
                         pending=None)
    out = capsys.readouterr().out
    assert code == 0
    assert out.index(done.answer[0]) < out.index("compare the trials in MLflow: (links)") \
        < out.index("trials:")
    # the line runs as printed where the venv is not active: vidtune by its absolute path
    line = next(ln for ln in out.splitlines() if ln.startswith("train it again: "))
    argv = shlex.split(line.removeprefix("train it again: "))
    assert argv[1:] == ["train", "--config", str(done.files["best_config"])]
    assert os.path.isabs(argv[0]) and os.access(argv[0], os.X_OK) and Path(argv[0]).name == "vidtune"


def test_the_tracker_records_the_summary_it_is_handed(summary, tmp_path):
    plan, done = summary
    db = tmp_path / "mlflow" / "mlruns.db"
    db.parent.mkdir()
    uri = f"sqlite:///{db}"
    tracker = MLflowTracker(tracking_uri=uri, experiment="summary", experiment_path=plan.search_path,
                            epochs=EPOCHS, parent_params={}, parent_tags={}, child_params={}, val_clips=0)
    assert tracker.record_summary(done) is None
    c = MlflowClient(uri)
    parent = c.get_run(tracker.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert {a.path for a in c.list_artifacts(parent.info.run_id)} == {p.name for p in done.files.values()} | {
        "previews"}                                   # the plots' narrow copies the description shows
    assert parent.data.metrics["best_val_acc"] == done.best.val_acc
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith(done.answer[0]) and spaced_table(done.table_markdown) in note
    children = {r.data.tags[TRIAL_ID_TAG]: r for r in c.search_runs(
        [tracker.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}
    assert set(children) == {t for t, _ in done.trial_states}
    assert all(r.info.status == "FINISHED" for r in children.values())
    assert children["abc_00000"].data.tags.get(BEST_TAG) == "true"
    assert [m.step for m in c.get_metric_history(children["abc_00000"].info.run_id, "val_acc")] == [1, 2]
    links = tracker.summary_links(None)
    assert links.startswith("compare the trials in MLflow: http://127.0.0.1:5000/#/experiments/")
    assert tracker.summary_links("down") == \
        f"compare the trials in MLflow: {uri}  (after: {servers.vidtune_command()} ui --mlflow-uri sqlite:///{db})"


def _fail_inside(folder: Path):
    """An os.fsync that fails with ENOSPC for files under `folder` (a full disk there only)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(folder):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    return fsync


def test_a_full_disk_leaves_the_last_results_whole_and_no_empty_file(tmp_path, monkeypatch, capsys):
    """trials.csv and best_config.json are written whole or not at all (vidtune/atomic.py): with
    the search's disk full, the files of the last summary stay as they were, no zero-byte or
    temporary file is left, and the results go to a temporary folder, saying so."""
    monkeypatch.chdir(tmp_path)
    plan = _plan(tmp_path)
    first = summarise(plan, plan.opts, _results(plan))
    folder = Path(plan.search_path)
    before = {name: (folder / name).read_bytes() for name in ("trials.csv", "best_config.json")}
    monkeypatch.setattr(atomic.os, "fsync", _fail_inside(folder))
    again = summarise(plan, plan.opts, _results(plan))
    assert "could not be written to" in capsys.readouterr().out
    assert {name: (folder / name).read_bytes() for name in before} == before
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp") or p.stat().st_size == 0]
    assert again.files["trials_csv"].parent != folder and again.files["trials_csv"].stat().st_size > 0
    assert first.files["trials_csv"] == folder / "trials.csv"


def test_a_kept_traceback_is_whole_or_absent_on_a_full_disk(tmp_path, monkeypatch):
    experiment = tmp_path / "s" / "ray"
    experiment.mkdir(parents=True)
    monkeypatch.setattr(atomic.os, "fsync", _fail_inside(tmp_path))
    assert faults.keep_traceback(str(experiment), "t01", "Traceback ...\nValueError: x") is None
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]          # no empty file, no .tmp
    monkeypatch.undo()
    kept = faults.keep_traceback(str(experiment), "t01", "Traceback ...\nValueError: x")
    assert kept.read_text() == "Traceback ...\nValueError: x\n"
