"""vidtune.tune.outputs.plots: the history plot (objective by trial in start order, best so far never going
down, unusable trials at the bottom), readable log-lr ticks, the best trial ringed."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from matplotlib.image import imread

from vidtune.tune.config import searched as searched_params
from vidtune.tune.config.options import SearchSpace
from vidtune.tune.outputs import plots, results, tables


def _row(n: int, acc: float, *, status: str = "DONE", batch: int = 8,
         lr: float = 1e-3) -> results.TrialResult:
    return results.TrialResult(trial_id=f"id{n}", batch_size=batch, lr=lr, val_acc=acc,
                            val_f1=acc, clips_per_s=10.0 * batch if math.isfinite(acc) else math.nan,
                            epoch_time_s=5.0, epochs=3, status=status, checkpoint=None,
                            name=f"t{n:02d}-bs{batch}-lr1e-3", best_epoch=2 if math.isfinite(acc) else 0)


ROWS = [_row(3, 0.70, lr=5e-4), _row(1, 0.50, lr=2e-4), _row(2, math.nan, status="DIVERGED", lr=8e-3),
        _row(4, 0.60, batch=16, lr=1e-3), _row(5, 0.75, status="STOPPED", lr=3e-4), _row(6, 0.65, lr=2e-3)]


def test_history_plot_is_written_and_its_best_so_far_never_goes_down(tmp_path):
    path = plots.plot_history(ROWS, tmp_path / "objective_history.png", objective="val_acc", title="s")
    assert path == tmp_path / "objective_history.png" and imread(path).shape[0] > 300
    fig = plots.history_figure(ROWS, objective="val_acc")
    ax = fig.axes[0]
    (line,) = [ln for ln in ax.get_lines() if ln.get_gid() == "best_so_far"]
    xs, ys = line.get_data()
    assert list(xs[:6]) == [1, 2, 3, 4, 5, 6]                      # start order, not the rows' order
    assert list(ys[:6]) == [0.5, 0.5, 0.7, 0.7, 0.75, 0.75]        # the diverged t02 changes nothing
    assert np.all(np.diff(ys) >= 0)
    rings = [c for c in ax.collections if c.get_gid() == "best_trial"]
    assert len(rings) == 1 and tuple(rings[0].get_offsets()[0]) == (5.0, 0.75)
    assert "no result" in [t.get_text() for t in ax.texts]          # the diverged trial's band
    assert "best so far" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert plots.plot_history([], tmp_path / "none.png", objective="val_acc") is None


def test_params_plot_has_several_readable_lr_ticks_and_rings_the_best():
    fig = plots.params_figure(ROWS, objective="val_acc")
    lr_ax, batch_ax = fig.axes[:2]
    fig.canvas.draw()
    lo, hi = lr_ax.get_xlim()
    labels = [t.get_text() for t, v in zip(lr_ax.get_xticklabels(), lr_ax.get_xticks(), strict=True)
              if lo <= v <= hi and t.get_text()]
    assert len(labels) >= 4 and "1e-3" in labels and "5e-4" in labels, labels
    assert "spread" in batch_ax.get_xlabel()                        # the jitter is explained
    assert any(c.get_gid() == "best_trial" for c in lr_ax.collections)
    assert "best trial" in [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]


def test_the_lr_axis_spans_the_searched_range_with_its_ends_marked():
    searched = searched_params.domains(SearchSpace(lr_min=2e-4, lr_max=2e-3, batch_sizes=(8, 16)))
    rows = [_row(1, 0.70, lr=4e-4), _row(2, 0.60, lr=8e-4)]       # the data stop well inside the range
    lr_ax = plots.params_figure(rows, objective="val_acc", domains=searched).axes[0]
    lo, hi = lr_ax.get_xlim()
    assert lo < 2e-4 and hi > 2e-3                                  # the whole searched range is seen
    ends = sorted(ln.get_xdata()[0] for ln in lr_ax.get_lines() if ln.get_gid() == "searched_range")
    assert ends == pytest.approx([2e-4, 2e-3])
    assert "searched range" in [t.get_text() for t in lr_ax.texts]
    unmarked = plots.params_figure(rows, objective="val_acc").axes[0]   # no range given: none drawn
    assert not [ln for ln in unmarked.get_lines() if ln.get_gid() == "searched_range"]


def _intervals(ax) -> dict[float, tuple[float, float]]:
    """{x: (low, high)} of the interval bars an axes holds."""
    return {ln.get_xdata()[0]: tuple(ln.get_ydata()) for ln in ax.get_lines() if ln.get_gid() == "interval"}


def test_every_plot_of_accuracy_draws_each_trials_95_percent_interval():
    rows = [_row(1, 0.75, lr=5e-4), _row(2, 0.5, lr=1e-3, batch=16)]   # 24 and 16 of 32 clips
    scatter = plots.scatter_figure(rows, val_clips=32).axes[0]
    assert _intervals(scatter)[80.0] == pytest.approx((0.5789, 0.8674), abs=1e-4)    # Wilson, 24 of 32
    history = plots.history_figure(rows, objective="val_acc", val_clips=32).axes[0]
    assert _intervals(history)[1] == pytest.approx((0.5789, 0.8674), abs=1e-4)
    params = plots.params_figure(rows, objective="val_acc", val_clips=32)
    assert _intervals(params.axes[0])[5e-4] == pytest.approx((0.5789, 0.8674), abs=1e-4)
    assert "95% interval of the\naccuracy" in [t.get_text() for t in params.axes[-1].get_legend().get_texts()]
    # no clip count, no interval; F1 is no proportion of clips: none either
    assert not _intervals(plots.scatter_figure(rows).axes[0])
    assert not _intervals(plots.history_figure(rows, objective="val_f1", val_clips=32).axes[0])


def test_the_speed_plot_shows_each_batch_sizes_speed_spread_beside_the_front():
    rows = [_row(1, 0.70), _row(2, 0.72), _row(3, 0.60, batch=16)]
    rows[1] = dataclasses.replace(rows[1], clips_per_s=92.0)        # batch 8 at 80 and 92 clips/s
    ax = plots.scatter_figure(rows, val_clips=32).axes[0]
    spreads = {ln.get_gid(): tuple(ln.get_xdata()) for ln in ax.get_lines()
               if (ln.get_gid() or "").startswith("speed_spread_")}
    assert spreads == {"speed_spread_8": (80.0, 92.0)}             # batch 16 has one trial: no spread
    assert any("batch 8: 80.0 to 92.0 clips/s" in t.get_text() for t in ax.texts)
    assert [ln for ln in ax.get_lines() if ln.get_gid() == "pareto_front"]


def test_the_docs_say_the_best_epoch_is_the_objectives_not_val_accs():
    """Under --objective val_f1 the best epoch is the one with the best val_f1 (`objective_key`):
    trials.csv's columns and the plots' descriptions say so, not "best epoch by val_acc"."""
    for doc in (tables.__doc__, results.__doc__, plots.plot_objective_vs_params.__doc__,
                plots.plot_history.__doc__):
        text = " ".join((doc or "").split())
        assert "best epoch by val_acc" not in text, text[:200]
        assert "objective" in text
