"""Each child run's summary and status: the summary the trials table shows (SUMMARY_KEYS),
written when the trial ends from the tracker's own epoch records and again from its final row,
equal to the row's in trials.csv; an ASHA-stopped trial ends FINISHED with outcome "stopped early", an
interrupted one KILLED. A SQLite store, fake Tune trials, no Ray."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from vidtune.tune.outputs.results import SUMMARY_KEYS, TrialResult, live_row, row_from_result, summary_metrics
from vidtune.tune.outputs.tables import csv_record
from vidtune.tune.tracking.schema import INTERRUPTED_REASON, OUTCOME_TAG, STOP_TAG
from vidtune.tune.tracking.tracker import MLflowTracker

VAL_CLIPS = 32


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    """One store for the module (an MLflow SQLite schema costs seconds); one experiment a test."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlruns.db'}"


def _tracker(uri: str, experiment: str) -> MLflowTracker:
    return MLflowTracker(tracking_uri=uri, experiment=experiment, experiment_path=f"/results/{experiment}",
                         epochs=3, parent_params={}, parent_tags={}, child_params={}, val_clips=VAL_CLIPS)


def _trial(trial_id: str, last: dict) -> SimpleNamespace:
    return SimpleNamespace(trial_id=trial_id, config={"batch_size": 4, "lr": 1e-3}, last_result=last)


def _tracked(uri: str, experiment: str, reports: list[dict]) -> tuple[MLflowTracker, SimpleNamespace]:
    """A tracker that saw trial "a" start, report each of `reports` and complete."""
    t = _tracker(uri, experiment)
    t.setup()
    trial = _trial("a", reports[-1])
    t.on_trial_start(0, [], trial)
    for r in reports:
        t.on_trial_result(0, [], trial, r)
    t.on_trial_complete(0, [], trial)
    return t, trial


def _report(epoch: int, val_acc: float, clips_per_s: float, **kw) -> dict:
    return {"epoch": epoch, "val_acc": val_acc, "val_f1": val_acc - 0.1, "clips_per_s": clips_per_s,
            "epoch_time_s": 8.0 / clips_per_s if clips_per_s else 0.0, "oom": 0, "diverged": 0,
            "training_iteration": epoch, "timestamp": 1_700_000_000 + epoch, **kw}


def _tune_result(reports: list[dict]) -> SimpleNamespace:
    """A Tune Result as `tune.outputs.results` reads it: per-epoch dataframe, last report, config."""
    return SimpleNamespace(metrics=reports[-1], metrics_dataframe=pd.DataFrame(reports),
                           config={"batch_size": 4, "lr": 1e-3}, error=None, path=None)


def _summary(c: MlflowClient, run_id: str) -> dict[str, float]:
    return {k: v for k, v in c.get_run(run_id).data.metrics.items() if k in SUMMARY_KEYS}


def _in_csv(row: TrialResult) -> dict[str, float]:
    """The row's SUMMARY_KEYS as trials.csv writes them, read back as numbers."""
    record = csv_record(row, VAL_CLIPS)
    return {k: float(record[k]) for k in SUMMARY_KEYS}


def test_the_summary_logged_when_a_trial_ends_and_after_reconcile_equals_its_row(uri):
    # epochs 2 and 3 tie on val_acc: the later is the best; the speed is the median of epochs 2..
    reports = [_report(1, 0.50, 4.0), _report(2, 0.75, 10.0), _report(3, 0.75, 12.0)]
    t, trial = _tracked(uri, "summary", reports)

    row = row_from_result(_tune_result(reports), trial_id="a", epochs=3, finished=True, name="a")
    assert summary_metrics(row, VAL_CLIPS)["best_epoch"] == 3 and row.clips_per_s == 11.0
    assert summary_metrics(live_row("a", trial.config, t._records["a"], "DONE"), VAL_CLIPS) == \
        summary_metrics(row, VAL_CLIPS)
    c = MlflowClient(uri)
    run_id = t.child_runs["a"]
    logged = _summary(c, run_id)                                 # while the search runs
    assert logged == summary_metrics(row, VAL_CLIPS)             # unrounded: what was measured
    assert logged == pytest.approx(_in_csv(row), abs=5e-5)       # trials.csv shows it rounded
    assert _in_csv(row)["best_val_acc_low"] == 0.5789 != logged["best_val_acc_low"]   # 24 of 32 clips

    final = row_from_result(_tune_result(reports[:2]), trial_id="a", epochs=3, finished=True, name="a")
    t.reconcile([(final, _tune_result(reports[:2]), None)])     # a final row that differs: it wins
    assert _summary(c, run_id) == summary_metrics(final, VAL_CLIPS) and _in_csv(final)["best_epoch"] == 2
    assert c.get_run(run_id).data.metrics["best_val_f1"] == final.val_f1


def test_an_out_of_memory_trial_has_no_summary_values(uri):
    t = _tracker(uri, "oom")
    t.setup()
    last = _report(1, 0.0, 0.0, oom=1)
    trial = _trial("oom", last)
    t.on_trial_start(0, [], trial)
    t.on_trial_result(0, [], trial, last)
    t.on_trial_complete(0, [], trial)
    run = MlflowClient(uri).get_run(t.child_runs["oom"])
    assert run.info.status == "FAILED" and run.data.tags[OUTCOME_TAG] == "out of memory"
    assert not set(SUMMARY_KEYS) & set(run.data.metrics)


def test_an_asha_stopped_trial_finishes_stopped_early_and_an_interrupted_one_is_killed(uri):
    t = _tracker(uri, "statuses")
    t.setup()
    stopped = _trial("stopped", _report(1, 0.5, 10.0))
    running = _trial("running", _report(1, 0.5, 10.0))
    for trial in (stopped, running):
        t.on_trial_start(0, [], trial)
        t.on_trial_result(0, [], trial, trial.last_result)
    t.on_trial_complete(0, [], stopped)                           # epoch 1 of 3: ASHA stopped it
    t.close(interrupted=True)
    c = MlflowClient(uri)
    run = c.get_run(t.child_runs["stopped"])
    assert run.info.status == "FINISHED" and run.data.tags[OUTCOME_TAG] == "stopped early"
    assert run.data.tags[STOP_TAG] == "stopped early by ASHA after epoch 1 of 3"
    assert not math.isnan(run.data.metrics["best_val_acc"])
    other = c.get_run(t.child_runs["running"])
    assert other.info.status == "KILLED" and other.data.tags[STOP_TAG] == INTERRUPTED_REASON
    assert t.mlflow_status("STOPPED", {"epoch": 2})[0] == "FINISHED"
    assert t.mlflow_status("UNFINISHED", {"epoch": 2})[0] == "KILLED"


def test_speeds_are_logged_to_the_decimals_trials_csv_shows(uri):
    """A speed is a measurement that varies by far more than 0.01 clips/s between epochs: the
    child run's speed_clips_per_s, each epoch's clips_per_s and the parent's best speed are
    logged to 2 decimals, trials.csv's number, not 46.83094586854091."""
    speed = 46.83094586854091
    reports = [_report(1, 0.50, speed), _report(2, 0.75, speed, compute_clips_per_s=51.234567)]
    t, trial = _tracked(uri, "rounded", reports)
    row = row_from_result(_tune_result(reports), trial_id="a", epochs=2, finished=True, name="a")
    t.log_summary(best=row)
    c = MlflowClient(uri)
    run_id = t.child_runs["a"]
    assert _summary(c, run_id)["speed_clips_per_s"] == 46.83 == _in_csv(row)["speed_clips_per_s"]
    assert {m.value for m in c.get_metric_history(run_id, "clips_per_s")} == {46.83}
    assert c.get_run(run_id).data.metrics["compute_clips_per_s"] == 51.23
    assert c.get_run(t.parent_run_id).data.metrics["speed_clips_per_s"] == 46.83
