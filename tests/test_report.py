"""tune.report: a trial's row takes its steady-state speed, not its last (or first) epoch's."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd

from tune import report


def _result(epochs: list[dict], *, config=None, error=None):
    last = epochs[-1] if epochs else {}
    return SimpleNamespace(metrics=dict(last), config=config or {"batch_size": 8, "lr": 1e-3}, error=error,
                           metrics_dataframe=pd.DataFrame(epochs))


def _epoch(e: int, speed: float, **kw) -> dict:
    return {"epoch": e, "val_acc": 0.5 + 0.1 * e, "val_f1": 0.5, "clips_per_s": speed,
            "compute_clips_per_s": 2 * speed, "epoch_time_s": 100.0 / speed if speed else 1.0, "oom": 0,
            "concurrent_trainings": 1.0, **kw}


def test_row_speed_is_the_median_of_epochs_2_and_later():
    # epoch 1 is slow (start-up, cache fill); the last epoch sped up when a neighbour ended
    result = _result([_epoch(1, 5.0), _epoch(2, 20.0), _epoch(3, 22.0), _epoch(4, 40.0)])
    row = report.row_from_result(result, trial_id="t", epochs=4, finished=True)
    assert row.clips_per_s == 22.0 and row.compute_clips_per_s == 44.0
    assert row.epoch_time_s == 100.0 / 22.0
    assert row.val_acc == 0.5 + 0.4 and row.status == "DONE" and row.concurrent_trainings == 1.0


def test_one_epoch_trial_uses_epoch_1_and_a_resumed_epoch_counts_once():
    row = report.row_from_result(_result([_epoch(1, 5.0)]), trial_id="t", epochs=3, finished=True)
    assert row.clips_per_s == 5.0 and row.status == "STOPPED"
    # a resumed trial re-reports its last checkpointed epoch: the later report of epoch 2 wins
    result = _result([_epoch(1, 5.0), _epoch(2, 10.0), _epoch(2, 12.0), _epoch(3, 30.0)])
    assert report.row_from_result(result, trial_id="t", epochs=3, finished=True).clips_per_s == 21.0


def test_oom_trial_has_no_speed_and_sharing_is_flagged_in_the_table():
    oom = report.row_from_result(_result([_epoch(1, 0.0, oom=1)]), trial_id="o", epochs=3, finished=True)
    assert oom.status == "OOM" and math.isnan(oom.clips_per_s)
    shared = report.row_from_result(_result([_epoch(1, 5.0), _epoch(2, 9.0, concurrent_trainings=2.0)]),
                                    trial_id="s", epochs=2, finished=True)
    assert shared.concurrent_trainings == 2.0
    table = report.format_table([shared, oom])
    assert "9.0*" in table and "compute/s" in table


def test_pareto_front_and_best_use_the_steady_speed():
    fast_late = report.row_from_result(_result([_epoch(1, 1.0), _epoch(2, 50.0)]), trial_id="a", epochs=2, finished=True)
    fast_first = report.row_from_result(_result([_epoch(1, 99.0), _epoch(2, 10.0)]), trial_id="b", epochs=2, finished=True)
    front = report.pareto_front([fast_late, fast_first])
    assert [r.trial_id for r in front] == ["a"]          # same accuracy; a is faster in steady state
