"""tune.report: a trial's row takes its steady-state speed, not its last (or first) epoch's."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd
import pytest

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


# --- status rules, ranking, the front, the table, the CSV and the plot ----------------------


def _row(trial_id: str, acc: float, speed: float, *, f1: float = 0.5, status: str = "DONE",
         batch: int = 8, shared: float = 1.0) -> report.TrialRow:
    return report.TrialRow(trial_id=trial_id, batch_size=batch, lr=1e-3, weight_decay=None, val_acc=acc,
                           val_f1=f1, clips_per_s=speed, epoch_time_s=100.0 / speed if speed else math.nan,
                           epochs=3, status=status, checkpoint=None, concurrent_trainings=shared)


@pytest.mark.parametrize("error, oom, finished, epochs_run, expected", [
    (RuntimeError("boom"), 1, True, 3, "ERROR"),      # an error wins over everything
    (None, 1, True, 3, "OOM"),                        # out of memory, even after all epochs
    (None, 1, False, 1, "OOM"),                       # ... and even when interrupted
    (None, 0, False, 3, "UNFINISHED"),                # interrupted, whatever it had reported
    (None, 0, True, 2, "STOPPED"),                    # ended before the epochs asked (ASHA)
    (None, 0, True, 3, "DONE"),
    (None, 0, True, 4, "DONE"),                       # more epochs than asked (resumed) is not STOPPED
])
def test_status_rules(error, oom, finished, epochs_run, expected):
    epochs = [_epoch(e, 10.0, oom=oom if e == epochs_run else 0) for e in range(1, epochs_run + 1)]
    row = report.row_from_result(_result(epochs, error=error), trial_id="t", epochs=3, finished=finished)
    assert row.status == expected and row.epochs == epochs_run


def test_a_trial_that_reported_nothing():
    result = SimpleNamespace(metrics={}, config={"batch_size": 4, "lr": 0.01, "weight_decay": 0.05}, error=None,
                             metrics_dataframe=None)
    row = report.row_from_result(result, trial_id="t", epochs=3, finished=True)
    assert (row.status, row.epochs, row.batch_size, row.lr, row.weight_decay) == ("STOPPED", 0, 4, 0.01, 0.05)
    assert math.isnan(row.val_acc) and math.isnan(row.clips_per_s) and row.checkpoint is None
    assert report.usable([row]) == []                 # no accuracy: nothing to rank
    unfinished = report.row_from_result(result, trial_id="u", epochs=3, finished=False)
    assert unfinished.status == "UNFINISHED"


def test_usable_keeps_ranked_statuses_with_an_accuracy():
    rows = [_row(s.lower(), 0.7, 10.0, status=s) for s in report.STATUSES] + [_row("nan", math.nan, 10.0)]
    assert [r.trial_id for r in report.usable(rows)] == ["done", "stopped", "unfinished"]


def test_best_trial_per_objective():
    accurate = _row("accurate", 0.9, 5.0, f1=0.6)
    balanced = _row("balanced", 0.8, 20.0, f1=0.85)
    fast = _row("fast", 0.6, 50.0, f1=0.5)
    rows = [fast, accurate, balanced]
    assert report.best_trial(rows, "val_acc") is accurate
    assert report.best_trial(rows, "val_f1") is balanced
    assert report.best_trial(rows, "pareto") is accurate          # the most accurate on the front


def test_best_trial_tie_goes_to_the_faster_trial():
    slow, quick = _row("slow", 0.8, 10.0), _row("quick", 0.8, 30.0)
    assert report.best_trial([slow, quick], "val_acc") is quick
    assert report.best_trial([quick, slow], "val_acc") is quick   # not the order given
    no_speed = _row("no_speed", 0.8, math.nan)
    assert report.best_trial([no_speed, slow], "val_acc") is slow  # a known speed beats none
    assert report.best_trial([_row("a", 0.7, 1.0, f1=0.9), _row("b", 0.7, 9.0, f1=0.9)], "val_f1").trial_id == "b"


def test_best_trial_is_never_an_oom_or_error_trial():
    ok = _row("ok", 0.6, 10.0)
    rows = [_row("oom", 0.99, 99.0, status="OOM"), _row("err", 0.98, 99.0, status="ERROR"), ok]
    for objective in ("val_acc", "val_f1", "pareto"):
        assert report.best_trial(rows, objective) is ok
    assert report.best_trial(rows[:2], "val_acc") is None
    assert report.best_trial([], "pareto") is None
    assert report.best_trial([_row("nan", math.nan, 5.0)], "val_acc") is None
    # pareto needs a speed: a trial with an accuracy but no clips/s is not on the front
    assert report.best_trial([_row("no_speed", 0.9, math.nan)], "pareto") is None
    assert report.best_trial([_row("no_speed", 0.9, math.nan)], "val_acc").trial_id == "no_speed"


def test_pareto_front_excludes_dominated_trials_and_sorts_by_accuracy():
    rows = [
        _row("fast", 0.6, 50.0),
        _row("dominated", 0.55, 40.0),            # fast beats it on both
        _row("accurate", 0.9, 5.0),
        _row("tied_slower", 0.9, 4.0),            # same accuracy, slower: dominated
        _row("middle", 0.8, 20.0),
        _row("equal_middle", 0.8, 20.0),          # identical to middle: neither dominates the other
        _row("oom", 0.99, 99.0, status="OOM"),    # would dominate all, but is not usable
        _row("no_speed", 0.95, math.nan),
    ]
    front = report.pareto_front(rows)
    assert [r.trial_id for r in front] == ["accurate", "middle", "equal_middle", "fast"]
    assert report.pareto_front([]) == []


def test_format_table_marks_shared_speed_and_missing_numbers():
    alone = _row("alone", 0.75, 12.34, shared=1.0)
    shared = _row("shared", 0.5, 8.0, shared=2.0)
    unknown = _row("unknown", 0.5, 8.0, shared=math.nan)
    oom = report.TrialRow("oom", 64, 1e-3, None, math.nan, math.nan, math.nan, math.nan, 1, "OOM", None)
    lines = report.format_table([alone, shared, unknown, oom]).splitlines()
    assert lines[0].split() == ["trial", "batch", "lr", "val_acc", "val_f1", "clips/s", "compute/s", "epoch_s",
                                "epochs", "status"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    cells = {line.split()[0]: line.split() for line in lines[2:]}
    assert cells["alone"][3:6] == ["0.750", "0.500", "12.3"]         # no `*`: it had its device alone
    assert cells["shared"][5] == "8.0*" and cells["unknown"][5] == "8.0"
    assert cells["oom"] == ["oom", "64", "1.00e-03", "-", "-", "-", "-", "-", "1", "OOM"]
    assert len({len(line) for line in lines}) == 1                  # aligned columns
    with_wd = report.format_table([alone, _row("wd", 0.5, 8.0)], show_wd=True).splitlines()
    assert with_wd[0].split()[3] == "wd" and with_wd[2].split()[3] == "-"
    assert report.format_table([]).splitlines()[0].split()[0] == "trial"


def test_write_csv_round_trip(tmp_path):
    import csv

    rows = [_row("a", 0.75, 12.5, shared=2.0),
            report.TrialRow("b", 16, 3e-4, 0.05, math.nan, 0.25, math.nan, math.nan, 1, "OOM", "/ckpt/b",
                            node_id="node-1")]
    path = report.write_csv(rows, tmp_path / "deep" / "trials.csv")
    assert path == tmp_path / "deep" / "trials.csv"
    with open(path, newline="") as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == list(report.TrialRow.__dataclass_fields__)
    assert [r["trial_id"] for r in read] == ["a", "b"]
    assert float(read[0]["val_acc"]) == 0.75 and float(read[0]["clips_per_s"]) == 12.5
    assert float(read[0]["concurrent_trainings"]) == 2.0 and read[0]["weight_decay"] == ""
    assert (read[1]["batch_size"], read[1]["status"], read[1]["checkpoint"], read[1]["node_id"]) == \
        ("16", "OOM", "/ckpt/b", "node-1")
    assert float(read[1]["lr"]) == 3e-4 and float(read[1]["weight_decay"]) == 0.05
    assert math.isnan(float(read[1]["val_acc"])) and float(read[1]["val_f1"]) == 0.25


@pytest.mark.parametrize("rows, front_drawn", [
    ([_row("a", 0.6, 50.0, batch=4), _row("b", 0.9, 5.0, batch=8), _row("c", 0.5, 10.0, batch=8)], True),
    ([_row("oom", math.nan, math.nan, status="OOM")], False),     # nothing usable: a placeholder plot
    ([], False),
], ids=["trials", "none_usable", "empty"])
def test_plot_scatter_writes_a_png(tmp_path, rows, front_drawn):
    import numpy as np
    from PIL import Image

    path = report.plot_scatter(rows, tmp_path / "plots" / "scatter.png", title="t")
    assert path == tmp_path / "plots" / "scatter.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        assert image.width > 300 and image.height > 200
        pixels = np.asarray(image.convert("RGB")).astype(int)
    crimson = (np.abs(pixels - (220, 20, 60)).sum(axis=2) < 30).sum()   # the Pareto front's line and rings
    assert (crimson > 50) == front_drawn, crimson
