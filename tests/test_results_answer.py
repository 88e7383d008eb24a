"""One number per trial: `tune.outputs.results.summary_metrics` and trials.csv under the same names
(best_val_acc, best_epoch, speed_clips_per_s, the 95% interval), on known rows; the table's
interval column; the answer and intervals handed to the MLflow description."""
from __future__ import annotations

import csv
import math

import pytest

from vidtune.tune import summary
from vidtune.tune.outputs import results, tables
from vidtune.tune.outputs.importance import Importance
from vidtune.tune.outputs.uncertainty import wilson_interval
from vidtune.tune.tracking.tracker import MLflowTracker


def _row(name: str, acc: float, speed: float, *, best_epoch: int = 2, status: str = "DONE",
         batch: int = 8, lr: float = 1e-3) -> results.TrialResult:
    return results.TrialResult(trial_id=name, batch_size=batch, lr=lr, val_acc=acc,
                            val_f1=0.5, clips_per_s=speed, epoch_time_s=10.0, epochs=3, status=status,
                            checkpoint=None, name=name, best_epoch=best_epoch)


def test_summary_metrics_are_the_best_epoch_its_speed_and_the_wilson_interval():
    m = results.summary_metrics(_row("t01", 0.75, 41.2, best_epoch=3), 32)
    assert tuple(m) == results.SUMMARY_KEYS
    low, high = wilson_interval(24, 32)
    assert (m["best_val_acc"], m["best_epoch"], m["speed_clips_per_s"]) == (0.75, 3.0, 41.2)
    assert (m["best_val_acc_low"], m["best_val_acc_high"]) == (low, high)
    assert low == pytest.approx(0.5789, abs=1e-4) and high == pytest.approx(0.8675, abs=1e-4)


def test_summary_metrics_are_nan_where_there_is_none():
    oom = results.summary_metrics(_row("t02", math.nan, math.nan, best_epoch=0, status="OOM"), 32)
    assert all(math.isnan(v) for v in oom.values())
    unknown_size = results.summary_metrics(_row("t03", 0.5, 10.0), 0)
    assert unknown_size["best_val_acc"] == 0.5
    assert math.isnan(unknown_size["best_val_acc_low"]) and math.isnan(unknown_size["best_val_acc_high"])


def test_trials_csv_uses_the_summary_names_and_values(tmp_path):
    rows = [_row("t01", 0.5, 20.0, best_epoch=1), _row("t02", 0.75, 41.234, best_epoch=3),
            _row("t03", math.nan, math.nan, best_epoch=0, status="OOM")]
    with open(tables.write_csv(rows, tmp_path / "trials.csv", val_clips=32)) as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == list(tables.csv_columns([]))
    assert set(results.SUMMARY_KEYS) <= set(read[0])
    assert [r["name"] for r in read] == ["t02", "t01", "t03"]
    best = read[0]
    assert (best["best_val_acc"], best["best_epoch"], best["speed_clips_per_s"]) == ("0.7500", "3", "41.23")
    assert (best["best_val_acc_low"], best["best_val_acc_high"]) == ("0.5789", "0.8675")
    for r, row in zip(read[:2], (rows[1], rows[0]), strict=True):   # the same numbers as summary_metrics
        m = results.summary_metrics(row, 32)
        assert all(float(r[k]) == pytest.approx(m[k], abs=5e-3) for k in results.SUMMARY_KEYS)
    oom = read[2]
    assert all(oom[k] == "nan" for k in results.SUMMARY_KEYS)


def test_the_table_shows_the_best_epoch_and_the_interval_beside_val_acc():
    rows = [_row("t01", 0.75, 41.2, best_epoch=3),
            _row("t02", math.nan, math.nan, best_epoch=0, status="OOM")]
    head, _, best, oom, *_ = tables.format_table(rows, val_clips=32).splitlines()
    assert head.split()[3:8] == ["best", "val_acc", "epoch", "best", "val_f1"]
    assert best.split()[3:7] == ["0.750", "[0.58,", "0.87]", "3"]             # Wilson on 24 of 32 clips
    assert oom.split()[3:5] == ["-", "-"]
    assert "[0." not in tables.format_table(rows)                     # clip count unknown: no interval
    notes = " ".join(line.strip() for line in tables.column_notes(rows, val_clips=32))
    assert notes.startswith("columns: best val_acc = validation accuracy at the trial's best epoch")
    assert "95% interval" in notes and "s/epoch = " in notes
    assert notes.endswith("status: DONE = all epochs, OOM = out of memory")     # the statuses present
    assert all(len(line) <= 100 for line in tables.column_notes(rows, val_clips=32))


def test_the_answer_and_the_intervals_reach_the_mlflow_description():
    calls = {}

    class Tracker(MLflowTracker):   # the store's calls faked; record_summary's own
        def __init__(self): self.tracking_uri = "sqlite:///x.db"
        def open_parent(self, refresh=False): pass
        def retire_lost_runs(self, ids): return []
        def reconcile(self, pairs): return 0
        def log_summary(self, **kw): pass
        def close(self, interrupted): pass
        def publish_view(self, **kw): calls.update(kw)

    rows = [_row("t01", 0.75, 41.2, best_epoch=3)]
    done = summary.Summary(objective="val_acc", rows=rows, trials=[], trial_states=[], interrupted=False,
                           val_clips=32, answer=["Best: t01."], best=rows[0], checkpoint=rows[0],
                           importance=Importance("val_acc", 1), files={})
    pending = Tracker().record_summary(done)
    assert pending is None and calls["answer"] == ["Best: t01."] and calls["best_trial_id"] == "t01"
    assert "0.750 [0.58, 0.87]" in calls["table_markdown"]
