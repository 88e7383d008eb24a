"""vidtune.tune.outputs.results and tune.outputs.plots: a trial's row takes its steady-state speed,
not its last (or first) epoch's."""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pandas as pd
import pytest

from vidtune.tune.outputs import plot_drawing, plots, results, tables


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
    row = results.row_from_result(result, trial_id="t", epochs=4, finished=True)
    assert row.clips_per_s == 22.0 and row.compute_clips_per_s == 44.0
    assert row.epoch_time_s == 100.0 / 22.0
    assert row.val_acc == 0.5 + 0.4 and row.status == "DONE" and row.concurrent_trainings == 1.0


def test_one_epoch_trial_uses_epoch_1_and_a_resumed_epoch_counts_once():
    row = results.row_from_result(_result([_epoch(1, 5.0)]), trial_id="t", epochs=3, finished=True)
    assert row.clips_per_s == 5.0 and row.status == "STOPPED"
    # a resumed trial re-reports its last checkpointed epoch: the later report of epoch 2 wins
    result = _result([_epoch(1, 5.0), _epoch(2, 10.0), _epoch(2, 12.0), _epoch(3, 30.0)])
    assert results.row_from_result(result, trial_id="t", epochs=3, finished=True).clips_per_s == 21.0


def test_oom_trial_has_no_speed_and_sharing_is_flagged_in_the_table():
    oom = results.row_from_result(_result([_epoch(1, 0.0, oom=1)]), trial_id="o", epochs=3, finished=True)
    assert oom.status == "OOM" and math.isnan(oom.clips_per_s)
    shared = results.row_from_result(_result([_epoch(1, 5.0), _epoch(2, 9.0, concurrent_trainings=2.0)]),
                                    trial_id="s", epochs=2, finished=True)
    assert shared.concurrent_trainings == 2.0
    table = tables.format_table([shared, oom])
    assert "9.0*" in table and "compute/s" not in table              # one speed: the steady clips/s


def test_pareto_front_and_best_use_the_steady_speed():
    fast_late = results.row_from_result(_result([_epoch(1, 1.0), _epoch(2, 50.0)]), trial_id="a", epochs=2,
                                        finished=True)
    fast_first = results.row_from_result(_result([_epoch(1, 99.0), _epoch(2, 10.0)]), trial_id="b", epochs=2,
                                         finished=True)
    front = results.pareto_front([fast_late, fast_first])
    assert [r.trial_id for r in front] == ["a"]          # same accuracy; a is faster in steady state


# --- status rules, ranking, the front, the table, the CSV and the plot ----------------------


def _row(trial_id: str, acc: float, speed: float, *, f1: float = 0.5, status: str = "DONE",
         batch: int = 8, shared: float = 1.0) -> results.TrialResult:
    return results.TrialResult(trial_id=trial_id, batch_size=batch, lr=1e-3, val_acc=acc,
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
    row = results.row_from_result(_result(epochs, error=error), trial_id="t", epochs=3, finished=finished)
    assert row.status == expected and row.epochs == epochs_run


def test_a_trial_that_reported_nothing():
    result = SimpleNamespace(metrics={}, config={"batch_size": 4, "lr": 0.01, "weight_decay": 0.05},
                             error=None, metrics_dataframe=None)
    row = results.row_from_result(result, trial_id="t", epochs=3, finished=True)
    assert (row.status, row.epochs, row.batch_size, row.lr, row.value("weight_decay")) == \
        ("STOPPED", 0, 4, 0.01, 0.05)
    assert math.isnan(row.val_acc) and math.isnan(row.clips_per_s) and row.checkpoint is None
    assert results.usable([row]) == []                 # no accuracy: nothing to rank
    unfinished = results.row_from_result(result, trial_id="u", epochs=3, finished=False)
    assert unfinished.status == "UNFINISHED"


def test_usable_keeps_ranked_statuses_with_an_accuracy():
    rows = [_row(s.lower(), 0.7, 10.0, status=s) for s in results.STATUSES] + [_row("nan", math.nan, 10.0)]
    assert [r.trial_id for r in results.usable(rows)] == ["done", "stopped", "unfinished"]


def test_best_trial_per_objective():
    accurate = _row("accurate", 0.9, 5.0, f1=0.6)
    balanced = _row("balanced", 0.8, 20.0, f1=0.85)
    fast = _row("fast", 0.6, 50.0, f1=0.5)
    rows = [fast, accurate, balanced]
    assert results.best_trial(rows, "val_acc") is accurate
    assert results.best_trial(rows, "val_f1") is balanced
    assert results.best_trial(rows, "pareto") is accurate          # the most accurate on the front


def test_best_trial_tie_goes_to_the_faster_trial():
    slow, quick = _row("slow", 0.8, 10.0), _row("quick", 0.8, 30.0)
    assert results.best_trial([slow, quick], "val_acc") is quick
    assert results.best_trial([quick, slow], "val_acc") is quick   # not the order given
    no_speed = _row("no_speed", 0.8, math.nan)
    assert results.best_trial([no_speed, slow], "val_acc") is slow  # a known speed beats none
    assert results.best_trial([_row("a", 0.7, 1.0, f1=0.9), _row("b", 0.7, 9.0, f1=0.9)],
                              "val_f1").trial_id == "b"


def test_best_trial_is_never_an_oom_or_error_trial():
    ok = _row("ok", 0.6, 10.0)
    rows = [_row("oom", 0.99, 99.0, status="OOM"), _row("err", 0.98, 99.0, status="ERROR"), ok]
    for objective in ("val_acc", "val_f1", "pareto"):
        assert results.best_trial(rows, objective) is ok
    assert results.best_trial(rows[:2], "val_acc") is None
    assert results.best_trial([], "pareto") is None
    assert results.best_trial([_row("nan", math.nan, 5.0)], "val_acc") is None
    # pareto needs a speed: a trial with an accuracy but no clips/s is not on the front
    assert results.best_trial([_row("no_speed", 0.9, math.nan)], "pareto") is None
    assert results.best_trial([_row("no_speed", 0.9, math.nan)], "val_acc").trial_id == "no_speed"


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
    front = results.pareto_front(rows)
    assert [r.trial_id for r in front] == ["accurate", "middle", "equal_middle", "fast"]
    assert results.pareto_front([]) == []


def test_format_table_marks_shared_speed_and_missing_numbers():
    alone = _row("alone", 0.75, 12.34, shared=1.0)
    shared = _row("shared", 0.5, 8.0, shared=2.0)
    unknown = _row("unknown", 0.5, 8.0, shared=math.nan)
    oom = results.TrialResult("oom", 64, 1e-3, math.nan, math.nan, math.nan, math.nan, 1, "OOM", None)
    *lines, legend = tables.format_table([alone, shared, unknown, oom]).splitlines()
    assert legend.startswith("* shared its device")                   # what the mark means, once
    assert lines[0].split() == ["trial", "batch", "lr", "best", "val_acc", "epoch", "best", "val_f1",
                                "clips/s", "s/epoch", "epochs", "status"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    cells = {line.split()[0]: line.split() for line in lines[2:]}
    assert cells["alone"][3:7] == ["0.750", "-", "0.500", "12.3"]    # no `*`: it had its device alone
    assert cells["shared"][6] == "8.0*" and cells["unknown"][6] == "8.0"
    assert cells["oom"] == ["oom", "64", "1.00e-03", "-", "-", "-", "-", "-", "1", "OOM"]
    assert len({len(line) for line in lines}) == 1                  # aligned columns
    searched_wd = dataclasses.replace(_row("wd", 0.5, 8.0), params={"weight_decay": 0.01})
    with_wd = tables.format_table([alone, searched_wd]).splitlines()     # a row with a weight decay: a column
    assert with_wd[0].split()[3] == "wd" and with_wd[2].split()[3] == "-"
    assert with_wd[3].split()[3] == "1.00e-02"
    assert tables.format_table([]).splitlines()[0].split()[0] == "trial"


def test_speed_measured_beside_other_work_is_marked_from_the_steady_epochs():
    # epoch 1 ran while the next trial started beside it (1.2 cores); epochs 2.. had the machine
    quiet = results.row_from_result(_result([_epoch(1, 5.0, other_cpu_cores=1.2),
                                             _epoch(2, 9.0, other_cpu_cores=0.1),
                                             _epoch(3, 9.0, other_cpu_cores=0.2)]),
                                    trial_id="q", epochs=3, finished=True)
    assert quiet.other_cpu_cores == pytest.approx(0.15) and tables.speed_marks(quiet) == ""
    busy = results.row_from_result(_result([_epoch(1, 5.0, other_cpu_cores=0.1),
                                            _epoch(2, 4.0, other_cpu_cores=0.9),
                                            _epoch(3, 4.5, other_cpu_cores=0.7)]),
                                   trial_id="b", epochs=3, finished=True)
    assert busy.other_cpu_cores == pytest.approx(0.8) and tables.speed_marks(busy) == "~"
    unmeasured = results.row_from_result(_result([_epoch(1, 5.0)]), trial_id="u", epochs=1, finished=True)
    assert math.isnan(unmeasured.other_cpu_cores) and tables.speed_marks(unmeasured) == ""
    *table, legend = tables.format_table([quiet, busy, unmeasured]).splitlines()
    assert "4.2~" in table[3] and legend.startswith("~ other processes")
    assert "4.2~" in tables.format_markdown([busy])
    # its meaning
    assert tables.format_markdown([busy]).splitlines()[-1].startswith("- `~` other processes")
    assert "`~`" not in tables.format_markdown([quiet])
    assert tables.csv_record(busy)["other_cpu_cores"] == "0.80"
    assert "~" not in tables.format_table([quiet])                   # no mark, no legend


def test_write_csv_round_trip(tmp_path):
    import csv

    # the columns are tables.csv_columns (name first, best_epoch for the best epoch), no longer
    # TrialResult's fields in order; rows come best first and floats are rounded
    rows = [results.TrialResult("b", 16, 3e-4, math.nan, 0.25, math.nan, math.nan, 1, "OOM", "/ckpt/b",
                            node_id="node-1", params={"weight_decay": 0.05}),
            _row("a", 0.75, 12.5, shared=2.0)]
    path = tables.write_csv(rows, tmp_path / "deep" / "trials.csv")
    assert path == tmp_path / "deep" / "trials.csv"
    with open(path, newline="") as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == list(tables.csv_columns([]))
    assert list(read[0])[:6] == ["name", "trial_id", "status", "batch_size", "lr", "weight_decay"]
    assert [r["trial_id"] for r in read] == ["a", "b"]            # the OOM trial last
    assert [r["name"] for r in read] == ["a", "b"]                # no name given: the trial id
    assert float(read[0]["best_val_acc"]) == 0.75 and float(read[0]["speed_clips_per_s"]) == 12.5
    assert float(read[0]["concurrent_trainings"]) == 2.0 and read[0]["weight_decay"] == ""
    assert (read[1]["batch_size"], read[1]["status"], read[1]["checkpoint"], read[1]["node_id"]) == \
        ("16", "OOM", "/ckpt/b", "node-1")
    assert float(read[1]["lr"]) == 3e-4 and float(read[1]["weight_decay"]) == 0.05
    assert math.isnan(float(read[1]["best_val_acc"])) and float(read[1]["best_val_f1"]) == 0.25


def _named(name: str, acc: float, speed: float, *, f1: float = 0.5, status: str = "DONE", batch: int = 8,
           lr: float = 2.5e-4, wd: float | None = None, best_epoch: int = 2) -> results.TrialResult:
    return results.TrialResult(trial_id=f"id_{name}", batch_size=batch, lr=lr, val_acc=acc,
                           val_f1=f1, clips_per_s=speed, epoch_time_s=100.0 / speed if speed else math.nan,
                           epochs=4, status=status, checkpoint=f"/ckpt/{name}/epoch_{best_epoch:04d}",
                           name=name, best_epoch=best_epoch,
                           params={"weight_decay": wd} if wd is not None else {})


def _search_rows() -> list[results.TrialResult]:
    """A realistic search: DONE, STOPPED, OOM, ERROR, two batch sizes, a front of 2."""
    return [
        _named("t01-bs8-lr2.5e-4", 0.81234567, 41.2345, f1=0.79, wd=0.05),
        _named("t02-bs16-lr1e-3", 0.77341, 63.456, f1=0.80, batch=16, lr=1e-3, wd=0.01, best_epoch=4),
        _named("t03-bs8-lr5e-5", 0.6012, 40.1, f1=0.55, status="STOPPED", lr=5e-5, wd=0.1, best_epoch=1),
        _named("t04-bs32-lr3e-4", 0.0, math.nan, f1=0.0, status="OOM", batch=32, lr=3e-4, wd=0.02,
               best_epoch=0),
        _named("t05-bs16-lr7e-4", math.nan, math.nan, f1=math.nan, status="ERROR", batch=16, lr=7e-4, wd=0.03,
               best_epoch=0),
        _named("t06-bs16-lr4e-4", 0.7001, 30.0, f1=0.70, batch=16, lr=0.000412345, wd=0.0333333),
    ]


def _read_csv(path):
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("objective, order", [
    ("val_acc", ["t01", "t02", "t06", "t03", "t04", "t05"]),
    ("pareto", ["t01", "t02", "t06", "t03", "t04", "t05"]),     # pareto ranks by val_acc
    ("val_f1", ["t02", "t01", "t06", "t03", "t04", "t05"]),
])
def test_write_csv_sorted_by_the_objective_unusable_last(tmp_path, objective, order):
    read = _read_csv(tables.write_csv(_search_rows(), tmp_path / "trials.csv", objective=objective))
    assert [r["name"].split("-")[0] for r in read] == order


def test_write_csv_rounds_and_names_the_best_epoch(tmp_path):
    read = _read_csv(tables.write_csv(_search_rows(), tmp_path / "trials.csv"))
    first = read[0]
    assert (first["name"], first["trial_id"]) == ("t01-bs8-lr2.5e-4", "id_t01-bs8-lr2.5e-4")
    assert (first["best_val_acc"], first["best_val_f1"]) == ("0.8123", "0.7900")        # 4 decimals
    assert (first["speed_clips_per_s"], first["epoch_time_s"]) == ("41.23", "2.43")  # 2 decimals
    assert (first["best_epoch"], first["epochs"]) == ("2", "4")
    t06 = next(r for r in read if r["name"].startswith("t06"))
    assert (t06["lr"], t06["weight_decay"]) == ("0.000412", "0.0333")          # 3 significant digits
    oom = next(r for r in read if r["status"] == "OOM")
    assert oom["best_epoch"] == "nan" and math.isnan(float(oom["speed_clips_per_s"]))
    assert "best_epoch" in tables.__doc__ and \
        "best_val_acc, best_val_f1 and the checkpoint are from it" in " ".join(tables.__doc__.split())
    with pytest.raises(ValueError, match="objective"):
        tables.write_csv([], tmp_path / "x.csv", objective="speed")


def test_name_defaults_to_the_trial_id_and_leads_the_table():
    result = _result([_epoch(1, 5.0), _epoch(2, 9.0)])
    assert results.row_from_result(result, trial_id="abc_00001", epochs=2, finished=True).name == "abc_00001"
    named = results.row_from_result(result, trial_id="abc_00001", epochs=2, finished=True,
                                    name="t01-bs8-lr1e-3")
    assert named.name == "t01-bs8-lr1e-3" and named.trial_id == "abc_00001"
    lines = tables.format_table([named]).splitlines()
    assert lines[0].split()[0] == "trial" and lines[2].split()[0] == "t01-bs8-lr1e-3"


# --- the best epoch by val_acc: its metrics, with its checkpoint -----------------------------


def test_row_reports_the_best_epoch_by_val_acc():
    # val_acc peaks at epoch 2 of 4: the row reports epoch 2's val_acc and val_f1 (the epoch of
    # the checkpoint Ray Train keeps as the best), not the last epoch's; epochs stays 4
    accs, f1s = [0.60, 0.82, 0.75, 0.70], [0.55, 0.81, 0.74, 0.69]
    result = _result([_epoch(e, 10.0 + e, val_acc=a, val_f1=f)
                      for e, a, f in zip(range(1, 5), accs, f1s, strict=True)])
    row = results.row_from_result(result, trial_id="t", epochs=4, finished=True)
    assert (row.val_acc, row.val_f1, row.best_epoch, row.epochs, row.status) == (0.82, 0.81, 2, 4, "DONE")
    assert row.clips_per_s == 13.0                        # speeds stay steady state (epochs 2..4)
    assert results.best_epoch_record(result)[0] == 2


# accuracy peaks at epoch 2, F1 at epoch 3: the two objectives name different epochs
DISAGREE = [(0.60, 0.40), (0.85, 0.50), (0.80, 0.78), (0.70, 0.60)]


@pytest.mark.parametrize("objective, epoch", [("val_acc", 2), ("val_f1", 3), ("pareto", 2)])
def test_the_best_epoch_follows_the_objective(objective, epoch, tmp_path):
    """One rule per objective (pareto: val_acc, the front's accuracy axis): the row's epoch and
    metrics, the live row MLflow shows while it runs, what Optuna is told, and what ranks the
    checkpoints Ray Train keeps all name the same epoch."""
    from vidtune.trainer.cluster.build_trainer import build_torch_trainer
    from vidtune.trainer.training.config import TrainConfig
    from vidtune.trainer.training.history import write_history
    from vidtune.tune.study import space

    metric = results.objective_key(objective)
    epochs = [_epoch(e, 10.0, val_acc=a, val_f1=f) for e, (a, f) in enumerate(DISAGREE, start=1)]
    row = results.row_from_result(_result(epochs), trial_id="t", epochs=4, finished=True, metric=metric)
    acc, f1 = DISAGREE[epoch - 1]
    assert (row.best_epoch, row.val_acc, row.val_f1) == (epoch, acc, f1)
    live = results.live_row("t", {"batch_size": 8, "lr": 1e-3}, dict(enumerate(epochs, start=1)), "DONE",
                            metric=metric)
    assert (live.best_epoch, live.val_acc, live.val_f1) == (epoch, acc, f1)
    write_history(tmp_path, dict(enumerate(epochs, start=1)))
    from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY

    told = space.whole_history_result({**epochs[-1], CHECKPOINT_PATH_KEY: str(tmp_path)}, metric)
    assert told[metric] == (acc if metric == "val_acc" else f1)
    trainer = build_torch_trainer(TrainConfig(), score_metric=metric)
    assert trainer.run_config.checkpoint_config.checkpoint_score_attribute == metric


def test_a_best_epoch_needs_a_metric_it_can_be_chosen_by():
    from vidtune.trainer.training.history import best_epoch

    with pytest.raises(ValueError, match="val_acc.*val_f1.*not 'clips_per_s'"):
        best_epoch({1: {"val_acc": 0.5}}, "clips_per_s")


def test_best_epoch_ties_go_to_the_later_epoch_and_a_re_reported_epoch_counts_once():
    tie = _result([_epoch(1, 10.0, val_acc=0.8, val_f1=0.1), _epoch(2, 10.0, val_acc=0.8, val_f1=0.2),
                   _epoch(3, 10.0, val_acc=0.7)])
    row = results.row_from_result(tie, trial_id="t", epochs=3, finished=True)
    assert (row.best_epoch, row.val_f1) == (2, 0.2)
    # resumed: epoch 2 was re-reported after the restart; its later report (0.7) wins over 0.9
    resumed = _result([_epoch(1, 10.0, val_acc=0.6), _epoch(2, 10.0, val_acc=0.9),
                       _epoch(2, 10.0, val_acc=0.7), _epoch(3, 10.0, val_acc=0.65)])
    row = results.row_from_result(resumed, trial_id="t", epochs=3, finished=True)
    assert (row.best_epoch, row.val_acc) == (2, 0.7)


def test_best_epoch_without_a_dataframe_and_for_oom():
    # only the last result (no per-epoch records): that epoch is the best one
    result = SimpleNamespace(metrics=_epoch(3, 10.0, val_acc=0.7, val_f1=0.6),
                             config={"batch_size": 8, "lr": 1e-3}, error=None, metrics_dataframe=None)
    row = results.row_from_result(result, trial_id="t", epochs=3, finished=True)
    assert (row.best_epoch, row.val_acc, row.val_f1) == (3, 0.7, 0.6)
    # out of memory keeps its behaviour: the OOM report's metrics, no best epoch, no speed
    oom = results.row_from_result(_result([_epoch(1, 10.0, val_acc=0.9), _epoch(2, 0.0, oom=1, val_acc=0.0,
                                                                                 val_f1=0.0)]),
                                 trial_id="o", epochs=3, finished=True)
    assert (oom.status, oom.val_acc, oom.val_f1, oom.best_epoch, oom.epochs) == ("OOM", 0.0, 0.0, 0, 2)
    assert math.isnan(oom.clips_per_s)
    nothing = results.row_from_result(SimpleNamespace(metrics={}, config={}, error=None,
                                                      metrics_dataframe=None),
                                     trial_id="n", epochs=3, finished=True)
    assert nothing.best_epoch == 0 and math.isnan(nothing.val_acc)


# --- plots ----------------------------------------------------------------------------------


def _annotations(fig) -> list[str]:
    from matplotlib.text import Annotation

    return [t.get_text() for ax in fig.axes for t in ax.texts if isinstance(t, Annotation)]


def _png_size(path):
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        return image.size, image.info.get("dpi")


@pytest.mark.parametrize("rows", [
    _search_rows(),
    [_row("oom", math.nan, math.nan, status="OOM")],               # nothing usable: a placeholder plot
    [],
], ids=["trials", "none_usable", "empty"])
def test_plot_scatter_writes_a_png_at_150_dpi(tmp_path, rows):
    path = plots.plot_scatter(rows, tmp_path / "plots" / "scatter.png", title="t")
    assert path == tmp_path / "plots" / "scatter.png"
    size, dpi = _png_size(path)
    width, height = plots.scatter_figure(rows, title="t").get_size_inches()
    assert plot_drawing.PLOT_DPI >= 150 and size == (round(width * 150), round(height * 150))
    assert dpi is not None and round(dpi[0]) == 150


def _front_lines(fig) -> list:
    return [line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == "pareto_front"]


def _legend_texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def test_scatter_front_line_only_with_two_or_more_front_points():
    rows = _search_rows()
    assert len(results.pareto_front(rows)) == 2
    fig = plots.scatter_figure(rows)
    (line,) = _front_lines(fig)
    assert sorted(line.get_xdata()) == [41.2345, 63.456] and "Pareto front" in _legend_texts(fig)
    one = [_row("best", 0.9, 50.0), _row("worse", 0.5, 10.0)]          # best dominates: a front of 1
    assert len(results.pareto_front(one)) == 1
    fig = plots.scatter_figure(one)
    assert _front_lines(fig) == [] and "Pareto front" not in _legend_texts(fig)
    assert _front_lines(plots.scatter_figure([])) == []


def test_scatter_labels_every_trial_and_marks_status():
    rows = _search_rows()
    fig = plots.scatter_figure(rows)
    texts = " ".join(_annotations(fig))
    for r in rows:                       # ERROR is not plotted but named in a note
        assert r.name in texts
    assert "not plotted" in texts and "(ERROR)" in texts
    legend = " ".join(_legend_texts(fig))
    assert all(s in legend for s in ("DONE", "STOPPED", "OOM", "batch 8", "batch 16", "batch 32"))
    (ax,) = [a for a in fig.axes]
    markers = {c.get_paths()[0].vertices.shape for c in ax.collections}  # circle vs x: different shapes
    assert len(markers) >= 2


def test_scatter_has_no_yellow():
    import matplotlib.colors as mcolors

    rows = [_row(f"b{b}", 0.5 + b / 100, float(b), batch=b) for b in range(1, 12)]
    fig = plots.scatter_figure(rows)
    for c in fig.axes[0].collections:
        for rgba in list(c.get_facecolors()) + list(c.get_edgecolors()):
            r, g, b = mcolors.to_rgb(rgba)
            assert not (r > 0.6 and g > 0.6 and b < 0.4), rgba   # yellow / olive


def test_plot_objective_vs_params(tmp_path):
    rows = _search_rows()
    path = plots.plot_objective_vs_params(rows, tmp_path / "params.png", objective="val_f1", title="s")
    size, dpi = _png_size(path)
    fig = plots.params_figure(rows, objective="val_f1", title="s")
    width, height = fig.get_size_inches()
    assert size == (round(width * 150), round(height * 150)) and round(dpi[0]) == 150
    lr_ax, wd_ax, batch_ax = fig.axes
    assert (lr_ax.get_xscale(), wd_ax.get_xscale(), batch_ax.get_xscale()) == ("log", "log", "linear")
    assert [t.get_text() for t in batch_ax.get_xticklabels()] == ["8", "16", "32"]
    assert "F1" in lr_ax.get_ylabel()
    texts = _annotations(fig)
    for r in rows:
        if r.status != "ERROR":
            assert sum(r.name in t for t in texts) == 3      # labelled in every subplot
    # without weight decay searched: lr and batch size only; pareto plots val_acc
    no_wd = [dataclasses.replace(r, params={}) for r in rows]
    fig = plots.params_figure(no_wd, objective="pareto")
    assert len(fig.axes) == 2 and "accuracy" in fig.axes[0].get_ylabel()
    assert plots.plot_objective_vs_params([], tmp_path / "none.png", objective="val_acc") is None
    assert not (tmp_path / "none.png").exists()


# --- divergence and GPU ids -----------------------------------------------------------------


def _diverged_result():
    """Epoch 1 trained (val_acc 0.9); epoch 2's loss went NaN: the worker's one diverged report."""
    return _result([_epoch(1, 10.0, val_acc=0.9, gpu_ids="0"),
                    _epoch(2, 0.0, val_acc=0.0, val_f1=0.0, diverged=1, train_loss=math.nan, gpu_ids="0")])


def test_a_diverged_trial_has_no_accuracy_nor_speed_and_is_never_best(tmp_path):
    row = results.row_from_result(_diverged_result(), trial_id="d", epochs=3, finished=True)
    assert (row.status, row.val_acc, row.best_epoch, row.epochs) == ("DIVERGED", 0.0, 0, 2)
    assert math.isnan(row.clips_per_s) and "DIVERGED" in results.STATUSES
    # even with an accuracy above every other trial's it is never ranked, best or on the front
    high = dataclasses.replace(row, val_acc=0.99, clips_per_s=99.0)
    ok = _row("ok", 0.6, 10.0)
    assert results.usable([high, ok]) == [ok]
    for objective in ("val_acc", "val_f1", "pareto"):
        assert results.best_trial([high, ok], objective) is ok
    assert results.pareto_front([high, ok]) == [ok]
    assert [r.trial_id for r in results.ranked([high, ok])] == ["ok", "d"]
    assert tables.format_table([ok, row]).splitlines()[-1].split()[-1] == "DIVERGED"
    read = _read_csv(tables.write_csv([row, ok], tmp_path / "trials.csv"))
    assert [(r["trial_id"], r["status"]) for r in read] == [("ok", "DONE"), ("d", "DIVERGED")]


def test_diverged_status_wins_over_unfinished_and_stopped():
    epochs = [_epoch(1, 10.0, diverged=1)]
    assert results.row_from_result(_result(epochs), trial_id="t", epochs=3,
                                   finished=False).status == "DIVERGED"
    assert results.row_from_result(_result(epochs, error=RuntimeError("x")), trial_id="t", epochs=3,
                                  finished=True).status == "ERROR"


def test_plots_show_diverged_trials_in_the_no_result_strip():
    rows = _search_rows() + [_named("t07-bs8-lr1e6", 0.0, math.nan, f1=0.0, status="DIVERGED", lr=1e6,
                                    best_epoch=0)]
    for fig in (plots.scatter_figure(rows), plots.params_figure(rows, objective="val_acc")):
        legend = " ".join(_legend_texts(fig))
        assert "DIVERGED" in legend and "OOM" in legend
        texts = [t.get_text() for ax in fig.axes for t in ax.texts]
        assert "OOM / DIVERGED" in texts and any("t07-bs8-lr1e6" in t for t in texts)


def test_gpu_column_only_when_some_trial_had_a_gpu(tmp_path):
    row = results.row_from_result(_result([_epoch(1, 10.0, gpu_ids="2,3")]), trial_id="g", epochs=1,
                                  finished=True)
    assert row.gpu_ids == "2,3"
    cpu = _row("cpu", 0.5, 8.0)
    head, _, *body = tables.format_table([row, cpu]).splitlines()
    assert head.split()[-2:] == ["gpu", "status"]
    assert [line.split()[-2] for line in body] == ["2,3", "-"]
    assert "| gpu |" in tables.format_markdown([row, cpu]) and \
        "| 2,3 |" in tables.format_markdown([row, cpu])
    read = _read_csv(tables.write_csv([row, cpu], tmp_path / "gpu.csv"))
    columns = list(read[0])
    assert columns[columns.index("node_id") + 1] == "gpu_ids" and [r["gpu_ids"] for r in read] == ["2,3", ""]
    # CPU only: no GPU column anywhere
    assert "gpu" not in tables.format_table([cpu]) and "gpu" not in tables.format_markdown([cpu])
    assert list(_read_csv(tables.write_csv([cpu], tmp_path / "cpu.csv"))[0]) == list(tables.csv_columns([]))
    # a string metric read back from a dataframe as NaN is no GPU id
    nan_ids = results.row_from_result(_result([_epoch(1, 10.0, gpu_ids=math.nan)]), trial_id="n", epochs=1,
                                     finished=True)
    assert nan_ids.gpu_ids == ""


def test_a_resumed_trial_keeps_the_epochs_from_before_its_interruption(tmp_path):
    """After --resume, Tune's results for a trial start again at the epoch it resumed from; the
    epochs before live in the checkpoint's epochs.json (trainer.training.history). The row, its best epoch
    and its epoch count come from both: here epoch 1 (0.500) stays the best of 4."""
    from vidtune.trainer.training.history import write_history

    before = {1: _epoch(1, 10.0, val_acc=0.5, val_f1=0.45), 2: _epoch(2, 12.0, val_acc=0.45)}
    after = [_epoch(3, 12.0, val_acc=0.40), _epoch(4, 12.0, val_acc=0.375)]
    run = tmp_path / "train_runs" / "t01"
    for epoch in (2, 4):   # each checkpoint carries the record of every epoch up to it
        folder = run / f"epoch_{epoch:04d}"
        folder.mkdir(parents=True)
        write_history(folder, {e: r for e, r in {**before, 3: after[0], 4: after[1]}.items() if e <= epoch})
    resumed = _result(after)                   # what Tune holds after the resume: epochs 3 and 4
    lost = results.row_from_result(resumed, trial_id="t01", epochs=4, finished=True)
    assert (lost.best_epoch, lost.val_acc) == (3, 0.40)   # without the record: the wrong answer
    row = results.row_from_result(resumed, trial_id="t01", epochs=4, finished=True, train_run=str(run))
    assert (row.best_epoch, row.val_acc, row.val_f1, row.epochs) == (1, 0.5, 0.45, 4)
    assert row.clips_per_s == 12.0                        # steady state over epochs 2..4, all of them
    # Tune's report of an epoch wins over the record's: a re-reported epoch 4 counts once, Tune's
    records = results.epoch_records(_result([*after[:1], {**after[1], "val_acc": 0.6}]), str(run))
    assert sorted(records) == [1, 2, 3, 4] and records[4]["val_acc"] == 0.6
