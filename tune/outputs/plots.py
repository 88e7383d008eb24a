"""The three plots of a search's trials (`tune.outputs.results.TrialResult`), PNG on matplotlib's Agg canvas
(no display, no pyplot state): accuracy against speed with the Pareto front (`plot_scatter`),
the objective against each searched parameter (`plot_objective_vs_params`), and the objective
of each trial in start order with the best so far (`plot_history`). Every accuracy is the
trial's best epoch's (its row's); the best trial (`tune.outputs.results.best_trial`) is ringed in each.
The drawing they share (colours, markers, legend, labels, saving): `tune.outputs.plot_drawing`."""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from vidtune.numbers import short_number
from vidtune.trainer.training.report_keys import Key
from vidtune.tune.config.searched import Domain, Param
from vidtune.tune.outputs.plot_drawing import (
    OOM_BAND,
    batch_colours,
    draw_interval,
    draw_legend,
    draw_point,
    interval_handle,
    label_points,
    new_figure,
    no_ticks_in_band,
    not_plotted_note,
    ring_best,
    save_png,
    strip_label,
)
from vidtune.tune.outputs.results import (
    NO_RESULT,
    TrialResult,
    best_trial,
    objective_key,
    pareto_front,
    usable,
)
from vidtune.tune.outputs.tables import shown_params


def _oom_y(i: int) -> float:
    """Where the i-th OOM / DIVERGED trial sits in the scatter's strip (axes fraction, from the top)."""
    return max(0.9 - 0.07 * i, 0.05)


def _speed_spreads(pool: list[TrialResult]) -> dict[int, tuple[float, float]]:
    """{batch size: (slowest, fastest) steady clips/s} over its trials, for sizes with 2 or more:
    one model at one batch size has one speed, so the spread is what the machine added (other
    trainings, other processes), the noise any speed difference must beat."""
    out = {}
    for b in sorted({r.batch_size for r in pool}):
        speeds = [r.clips_per_s for r in pool if r.batch_size == b]
        if len(speeds) >= 2:
            out[b] = (min(speeds), max(speeds))
    return out


def _draw_speed_spreads(ax: Axes, spreads: dict[int, tuple[float, float]], colours: dict[int, str]) -> None:
    """Each batch size's speed spread as a band under the points, named with its range."""
    lo, hi = ax.get_ylim()
    step = 0.055
    ax.set_ylim(lo - (step * len(spreads) + 0.03) / (1 - step * len(spreads) - 0.03) * (hi - lo), hi)
    left, right = ax.get_xlim()
    for i, (b, (slow, fast)) in enumerate(spreads.items()):
        y = 0.03 + step * i
        ax.plot([slow, fast], [y, y], transform=ax.get_xaxis_transform(), color=colours[b], alpha=0.5,
                linewidth=5, solid_capstyle="butt", zorder=1, gid=f"speed_spread_{b}")
        text = f"batch {b}: {slow:.1f} to {fast:.1f} clips/s over its trials"
        # beside the band, on the side with room: inside the axes
        room_right = (right - fast) > (slow - left)
        ax.text(fast if room_right else slow, y, f"  {text}  ", transform=ax.get_xaxis_transform(),
                ha="left" if room_right else "right", va="center", fontsize=6.5, color="#333333")


def scatter_figure(rows: list[TrialResult], *, title: str = "", val_clips: int = 0) -> Figure:
    """The figure `plot_scatter` saves (a matplotlib Figure on an Agg canvas)."""
    fig, (ax,) = new_figure(8.6, 5.2)
    colours = batch_colours(rows)
    pool = [r for r in usable(rows) if math.isfinite(r.clips_per_s)]
    oom = [r for r in rows if r.status in NO_RESULT]
    front = sorted(pareto_front(rows), key=lambda r: r.clips_per_s)
    on_front = {id(r) for r in front}
    ax.margins(x=0.12, y=0.15)
    intervals = False
    for r in pool:
        draw_point(ax, r.clips_per_s, r.val_acc, r, colours[r.batch_size])
        intervals |= draw_interval(ax, r.clips_per_s, r.val_acc, val_clips, colours[r.batch_size])
    best = best_trial(pool, Key.VAL_ACC)
    if best is not None:
        ring_best(ax, best.clips_per_s, best.val_acc)
    drawn = len(front) >= 2
    if drawn:
        ax.plot([r.clips_per_s for r in front], [r.val_acc for r in front], "--", color="black",
                linewidth=1.2, zorder=2, label="Pareto front", gid="pareto_front")
    if not pool:
        ax.set_ylim(0.0, 1.0)
        ax.text(0.5, 0.5, "no trial produced results", ha="center", va="center", transform=ax.transAxes,
                color="#444444")
    if oom:   # no speed, no accuracy: at 0 clips/s in a shaded strip, stacked down from the top
        right = max([r.clips_per_s for r in pool], default=1.0)
        ax.set_xlim(-0.08 * right, max(ax.get_xlim()[1], 1.08 * right) if pool else 1.1 * right)
        ax.axvspan(-0.08 * right, 0.04 * right, color="#ebebeb", zorder=0, linewidth=0)
        ax.text(-0.02 * right, 0.985, strip_label(oom), transform=ax.get_xaxis_transform(), ha="center",
                va="top", fontsize=7, color="#555555")
        for i, r in enumerate(oom):
            draw_point(ax, 0.0, _oom_y(i), r, colours[r.batch_size], transform=ax.get_xaxis_transform())
    spreads = _speed_spreads(pool)
    if spreads:
        _draw_speed_spreads(ax, spreads, colours)
    ax.set_xlabel("speed_clips_per_s (training clips/s, steady state)")
    ax.set_ylabel(_OBJECTIVE_LABEL[Key.VAL_ACC])
    ax.set_title(f"{title}: accuracy vs speed" if title else "trials: accuracy vs speed", fontsize=11)
    ax.grid(alpha=0.3)
    draw_legend(ax, pool + oom, colours, front=drawn, best=best is not None,
                extra=(interval_handle(),) if intervals else ())
    shown = {id(r) for r in pool + oom}
    not_plotted_note(ax, [r for r in rows if id(r) not in shown])
    points = [(r.clips_per_s, r.val_acc, r.label, "data", id(r) in on_front and drawn)
              for r in sorted(pool, key=lambda r: id(r) not in on_front)]
    points += [(0.0, _oom_y(i), r.label, ax.get_xaxis_transform(), False) for i, r in enumerate(oom)]
    label_points(fig, ax, points)
    return fig


def plot_scatter(rows: list[TrialResult], path: Path, *, title: str = "", val_clips: int = 0) -> Path | None:
    """Validation accuracy (best epoch) against steady clips/s, one labelled point per trial:
    colour = batch size, marker = status (DONE filled, STOPPED hollow, UNFINISHED triangle; OOM
    an x and DIVERGED a hollow diamond, at 0 clips/s in a shaded strip), each accuracy's 95%
    interval on `val_clips` clips as a bar (none when 0), the Pareto front dashed when it has 2
    or more trials, and under the points each batch size's speed spread over its trials (the
    noise a speed difference must beat). PNG at PLOT_DPI."""
    return save_png(scatter_figure(rows, title=title, val_clips=val_clips), path)


# the summary's names (trials.csv, MLflow) first, then what they mean
_OBJECTIVE_LABEL = {Key.VAL_ACC.value: f"{Key.BEST_VAL_ACC} (validation accuracy, best epoch)",
                    Key.VAL_F1.value: f"{Key.BEST_VAL_F1} (validation F1, best epoch)"}


def _searched_bounds(p: Param, domains: Mapping[str, Domain] | None) -> tuple[float, float] | None:
    d = (domains or {}).get(p.name)
    if d is None or p.is_choice or not d.low <= d.high or (p.scale == "log" and d.low <= 0):
        return None
    return d.low, d.high


def _mark_searched_range(ax: Axes, bounds: tuple[float, float], *, log: bool) -> None:
    """Widen an axis to the searched range (and a little beyond), shade what lies outside it and
    mark its ends: a best point at the edge of the data is then seen against the range."""
    lo, hi = bounds
    left, right = ax.get_xlim()
    if log:
        left, right = min(left, lo / 1.4), max(right, hi * 1.4)
    else:
        pad = 0.08 * (hi - lo or abs(hi) or 1.0)
        left, right = min(left, lo - pad), max(right, hi + pad)
    ax.set_xlim(left, right)
    for a, b in ((left, lo), (hi, right)):
        ax.axvspan(a, b, color="#e6e6e6", zorder=0, linewidth=0)
    for edge in (lo, hi):
        ax.axvline(edge, color="#777777", linestyle=":", linewidth=1.0, zorder=1, gid="searched_range")
    ax.text(math.sqrt(lo * hi) if log else (lo + hi) / 2, 1.0, "searched range",
            transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=7, color="#555555")


def _axis_label(p: Param) -> str:
    if p.is_choice:
        return f"{p.axis_label}\n(trials of one {p.words} spread sideways to be seen)"
    return f"{p.axis_label} ({p.scale} scale)"


def _spread(groups: tuple[tuple[list[TrialResult], float], ...], p: Param, key: str) -> dict[int, float]:
    """x of each trial on a choice parameter's axis: its value's place among the values, the
    trials of one value spread a little apart by their objective (`groups`: (rows, step); the
    OOM / DIVERGED ones, all on the bottom band, wider apart)."""
    values = sorted({r.value(p.name) for rows, _ in groups for r in rows} - {None})
    spread: dict[int, float] = {}
    for v in values:
        for group, step in groups:
            same = sorted((r for r in group if r.value(p.name) == v), key=lambda r: getattr(r, key))
            for k, r in enumerate(same):
                spread[id(r)] = values.index(v) + (k - (len(same) - 1) / 2) * min(step, 0.7 / len(same))
    return spread


def params_figure(rows: list[TrialResult], *, objective: str, title: str = "", val_clips: int = 0,
                  domains: Mapping[str, Domain] | None = None) -> Figure:
    """The figure `plot_objective_vs_params` saves."""
    key = objective_key(objective)
    shown = shown_params(rows)
    params = [p for p in shown if not p.is_choice] + [p for p in shown if p.is_choice]
    fig, axes = new_figure(3.6 * len(params) + 2.2, 4.4, ncols=len(params), sharey=True)
    colours = batch_colours(rows)
    pool = [r for r in usable(rows) if math.isfinite(getattr(r, key))]
    oom = [r for r in rows if r.status in NO_RESULT]
    best = best_trial(rows, objective)
    spread = {p.name: _spread(((pool, 0.12), (oom, 0.3)), p, key) for p in params if p.is_choice}

    def x_of(r: TrialResult, p: Param) -> float:
        if p.is_choice:
            return spread[p.name].get(id(r), math.nan)
        v = r.value(p.name)
        return float(v) if v is not None and (v > 0 or p.scale != "log") else math.nan

    intervals = False
    for ax, param in zip(axes, params, strict=True):
        ax.margins(x=0.15, y=0.15)
        if param.scale == "log":
            ax.set_xscale("log")
        for r in pool:
            if math.isfinite(x_of(r, param)):
                draw_point(ax, x_of(r, param), getattr(r, key), r, colours[r.batch_size])
                if key == Key.VAL_ACC:   # F1 is no proportion of clips: no Wilson interval
                    intervals |= draw_interval(ax, x_of(r, param), r.val_acc, val_clips,
                                               colours[r.batch_size])
        if best is not None and math.isfinite(x_of(best, param)):
            ring_best(ax, x_of(best, param), getattr(best, key))
        oom_here = [r for r in oom if math.isfinite(x_of(r, param))]
        if oom_here:   # no value: a mark in a shaded band along the bottom edge
            ax.margins(y=0.3)
            ax.add_patch(Rectangle((0, 0), 1, OOM_BAND, transform=ax.transAxes, color="#ebebeb", zorder=0,
                                   linewidth=0))
            ax.text(0.01, OOM_BAND / 2, strip_label(oom_here), transform=ax.transAxes, ha="left",
                    va="center", fontsize=7, color="#555555")
        for r in oom_here:
            draw_point(ax, x_of(r, param), OOM_BAND / 2, r, colours[r.batch_size],
                        transform=ax.get_xaxis_transform())
        if param.is_choice:
            values = sorted({r.value(param.name) for r in pool + oom} - {None})
            ax.set_xticks(range(len(values)), [param.cell(v) for v in values])
            if values:
                ax.set_xlim(-0.6, len(values) - 0.4)
        else:
            bounds = _searched_bounds(param, domains)
            if bounds is not None:
                _mark_searched_range(ax, bounds, log=param.scale == "log")
            if param.scale == "log":
                _log_ticks(ax)
        ax.set_xlabel(_axis_label(param))
        ax.grid(alpha=0.3)
        if not pool:
            ax.set_ylim(0.0, 1.0)
        if not pool and ax is axes[0]:
            ax.text(0.5, 0.5, "no trial produced results", ha="center", va="center", transform=ax.transAxes,
                    color="#444444")
    axes[0].set_ylabel(_OBJECTIVE_LABEL[key])
    if oom and pool:
        no_ticks_in_band(axes[0])
    fig.suptitle(f"{title}: " * bool(title) + f"{key} by searched parameter" +
                 " (objective: pareto)" * (objective == "pareto"), fontsize=11)
    draw_legend(axes[-1], pool + oom, colours, front=False, best=best is not None,
                extra=(interval_handle(),) if intervals else ())
    shown = {id(r) for r in pool + oom}
    not_plotted_note(axes[-1], [r for r in rows if id(r) not in shown])
    for ax, param in zip(axes, params, strict=True):
        points = [(x_of(r, param), getattr(r, key), r.label, "data", r is best) for r in pool
                  if math.isfinite(x_of(r, param))]
        points += [(x_of(r, param), OOM_BAND / 2, r.label, ax.get_xaxis_transform(), False) for r in oom
                   if math.isfinite(x_of(r, param))]
        label_points(fig, ax, points)
    return fig


def _log_ticks(ax: Axes) -> None:
    """Several labelled ticks on a log axis, written short (2e-4, 5e-4, 1e-3): 1-2-5 per decade
    over up to 3 decades (powers of ten only beyond), the axis at least a factor 4 wide."""
    lo, hi = ax.get_xlim()
    if lo > 0 and hi / lo < 4:
        mid = math.sqrt(lo * hi)
        lo, hi = mid / 2, mid * 2
        ax.set_xlim(lo, hi)
    decades = math.log10(hi / lo) if lo > 0 else 4.0
    subs = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0) if decades < 1 else (1.0, 2.0, 5.0) if decades <= 3 else (1.0,)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=30))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: short_number(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_objective_vs_params(rows: list[TrialResult], path: Path, *, objective: str, title: str = "",
                             val_clips: int = 0, domains: Mapping[str, Domain] | None = None
                             ) -> Path | None:
    """The objective (val_acc or val_f1, at each trial's best epoch by that objective; pareto:
    val_acc) against each searched parameter (`tune.outputs.tables.shown_params`), one subplot each: a range
    on
    a log or linear axis spanning what `domains` searched (its ends marked, outside shaded), a
    choice (batch size) as categories. Points coloured by batch size, marked by status and labelled like
    `plot_scatter`, an accuracy's 95% interval on `val_clips` clips as a bar; OOM and DIVERGED
    trials in a band on the bottom edge. PNG at PLOT_DPI. None (nothing written) without any
    trial."""
    if not rows:
        return None
    return save_png(params_figure(rows, objective=objective, title=title, val_clips=val_clips,
                                  domains=domains), path)


def _start_number(r: TrialResult, default: int) -> int:
    """The trial's number in the search from its name (t03-... -> 3); `default` without one."""
    head = r.label.split("-", 1)[0]
    return int(head[1:]) if head[:1] == "t" and head[1:].isdigit() else default


def history_figure(rows: list[TrialResult], *, objective: str, title: str = "", val_clips: int = 0) -> Figure:
    """The figure `plot_history` saves."""
    key = objective_key(objective)
    fig, (ax,) = new_figure(8.6, 4.4)
    colours = batch_colours(rows)
    order = sorted(rows, key=lambda r: _start_number(r, rows.index(r) + 1))
    number = {id(r): _start_number(r, i + 1) for i, r in enumerate(order)}
    pool = {id(r) for r in usable(rows) if math.isfinite(getattr(r, key))}
    ax.margins(x=0.05, y=0.15)
    running, steps, intervals = -math.inf, [], False
    for r in order:
        if id(r) in pool:
            draw_point(ax, number[id(r)], getattr(r, key), r, colours[r.batch_size])
            if key == Key.VAL_ACC:   # F1 is no proportion of clips: no Wilson interval
                intervals |= draw_interval(ax, number[id(r)], r.val_acc, val_clips, colours[r.batch_size])
            running = max(running, getattr(r, key))
        steps.append((number[id(r)], running))
    shown = [(x, y) for x, y in steps if math.isfinite(y)]
    if shown:
        xs, ys = zip(*shown, strict=True)
        ax.step([*xs, xs[-1] + 0.5], [*ys, ys[-1]], where="post", color="black", linewidth=1.3, zorder=2,
                gid="best_so_far")
    else:
        ax.set_ylim(0.0, 1.0)
        ax.text(0.5, 0.5, "no trial produced results", ha="center", va="center", transform=ax.transAxes,
                color="#444444")
    unusable = [r for r in order if id(r) not in pool]
    if unusable:   # no value: a mark in a shaded band along the bottom edge
        ax.add_patch(Rectangle((0, 0), 1, OOM_BAND, transform=ax.transAxes, color="#ebebeb", zorder=0,
                               linewidth=0))
        ax.text(0.01, OOM_BAND / 2, "no result", transform=ax.transAxes, ha="left", va="center", fontsize=7,
                color="#555555")
        for r in unusable:
            draw_point(ax, number[id(r)], OOM_BAND / 2, r, colours[r.batch_size],
                        transform=ax.get_xaxis_transform())
        ax.set_ylim(bottom=ax.get_ylim()[0] - 0.3 * (ax.get_ylim()[1] - ax.get_ylim()[0]))
        no_ticks_in_band(ax)
    best = best_trial(rows, objective)
    if best is not None:
        ring_best(ax, number[id(best)], getattr(best, key))
    numbers = sorted(number.values())
    ax.set_xticks(numbers if len(numbers) <= 30 else numbers[::max(1, len(numbers) // 15)])
    ax.set_xlabel("trial, in the order it started")
    ax.set_ylabel(_OBJECTIVE_LABEL[key])
    ax.set_title(f"{title}: " * bool(title) + f"{key} by trial, best so far", fontsize=11)
    ax.grid(alpha=0.3)
    line = Line2D([], [], color="black", linewidth=1.3, label="best so far")
    extra = ((line,) if shown else ()) + ((interval_handle(),) if intervals else ())
    draw_legend(ax, rows, colours, front=False, best=best is not None, extra=extra)
    labels = [(number[id(r)], getattr(r, key), r.label, "data", r is best) for r in order if id(r) in pool]
    labels += [(number[id(r)], OOM_BAND / 2, r.label, ax.get_xaxis_transform(), False) for r in unusable]
    if len(rows) <= 20:   # beyond, the labels crowd the points: the numbers on the axis say which
        label_points(fig, ax, labels)
    return fig


def plot_history(rows: list[TrialResult], path: Path, *, objective: str, title: str = "",
                 val_clips: int = 0) -> Path | None:
    """The objective (at each trial's best epoch by it; pareto: val_acc) of each trial in the
    order trials started (their number, t03 -> 3), as points marked like `plot_scatter`; the best
    so far as a black step line (never going down); an accuracy's 95% interval on `val_clips`
    clips as a bar; trials without a value (OOM, DIVERGED, ERROR) in a band along the bottom; the
    best trial ringed. PNG at PLOT_DPI. None (nothing written) without any trial."""
    if not rows:
        return None
    return save_png(history_figure(rows, objective=objective, title=title, val_clips=val_clips), path)

