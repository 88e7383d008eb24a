"""vidtune.tune.plots: the history plot (objective by trial in start order, best so far never going
down, unusable trials at the bottom), readable log-lr ticks, the best trial ringed."""
from __future__ import annotations

import math

import numpy as np
from matplotlib.image import imread

from vidtune.tune import plots, results


def _row(n: int, acc: float, *, status: str = "DONE", batch: int = 8, lr: float = 1e-3) -> results.TrialRow:
    return results.TrialRow(trial_id=f"id{n}", batch_size=batch, lr=lr, weight_decay=None, val_acc=acc,
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
