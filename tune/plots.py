"""The three plots of a search's trials (`tune.results.TrialRow`), PNG on matplotlib's Agg canvas
(no display, no pyplot state): accuracy against speed with the Pareto front (`plot_scatter`),
the objective against each searched parameter (`plot_objective_vs_params`), and the objective
of each trial in start order with the best so far (`plot_history`). Every accuracy is the
trial's best epoch's (its row's); the best trial (`tune.results.best_trial`) is ringed in each."""
from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from matplotlib.transforms import Bbox, Transform

from tune.results import NO_RESULT, TrialRow, best_trial, objective_key, pareto_front, usable
from tune.trial import short_lr

PLOT_DPI = 150
# tab10 without its olive (too light, yellowish, on white), then black: one colour per batch size
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
            "#7f7f7f", "#000000")
# how each status is drawn; OOM and DIVERGED have no speed (and no accuracy): an x or a hollow
# diamond in a shaded strip at the edge
_STATUS_STYLE = {
    "DONE": dict(marker="o", filled=True, legend="DONE (all epochs)"),
    "STOPPED": dict(marker="o", filled=False, legend="STOPPED early (ASHA)"),
    "UNFINISHED": dict(marker="^", filled=True, legend="UNFINISHED (interrupted)"),
    "OOM": dict(marker="x", filled=True, legend="OOM: out of memory\n(no speed or accuracy)"),
    "DIVERGED": dict(marker="D", filled=False, legend="DIVERGED: loss inf/NaN\n(no speed or accuracy)"),
}
_LABEL_SIZE = 6.5
OOM_BAND = 0.12         # params plot: the bottom band (axes fraction) that holds the OOM / DIVERGED trials
_MARKER_S = 42          # scatter marker area (points^2)


def _colours(rows: Iterable[TrialRow]) -> dict[int, str]:
    sizes = sorted({r.batch_size for r in rows})
    return {b: _PALETTE[i % len(_PALETTE)] for i, b in enumerate(sizes)}


def _new_figure(width: float, height: float, ncols: int = 1,
                sharey: bool = False) -> tuple[Figure, list[Axes]]:
    """A figure on its own Agg canvas (no pyplot state, nothing to close), constrained layout."""
    fig = Figure(figsize=(width, height), dpi=PLOT_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, sharey=sharey, squeeze=False)[0]
    return fig, list(axes)


def _draw_point(ax: Axes, x: float, y: float, r: TrialRow, colour: str,
                transform: Transform | None = None) -> None:
    style = _STATUS_STYLE.get(r.status, _STATUS_STYLE["DONE"])
    kw: dict[str, Any] = dict(marker=style["marker"], s=_MARKER_S, zorder=3, clip_on=False)
    if transform is not None:   # x in data, y in axes coordinates: the x axis must still cover x
        kw["transform"] = transform
        ax.update_datalim([(x, 0.0)], updatex=True, updatey=False)
        ax.autoscale_view()
    if style["marker"] == "x":
        kw.update(color=colour, linewidths=1.8, s=_MARKER_S * 1.2)
    elif style["filled"]:
        kw.update(color=colour, edgecolors="white", linewidths=0.6)
    else:
        kw.update(facecolors="white", edgecolors=colour, linewidths=1.6)
    ax.scatter([x], [y], **kw)


def _ring_best(ax: Axes, x: float, y: float) -> None:
    """A black ring around the best trial's point (`_legend` names it)."""
    ax.scatter([x], [y], marker="o", s=_MARKER_S * 4.5, facecolors="none", edgecolors="black",
               linewidths=1.4, zorder=4, clip_on=False, gid="best_trial")


def _legend(ax: Axes, rows: list[TrialRow], colours: dict[int, str], *, front: bool,
            best: bool = False, extra: tuple[Line2D, ...] = ()) -> None:
    """Colour = batch size, marker = status (those present), the front when drawn, the ring
    around the best trial when drawn, then `extra`."""
    handles = [Line2D([], [], linestyle="none", marker="s", markersize=7, color=c, label=f"batch {b}")
               for b, c in colours.items() if any(r.batch_size == b for r in rows)]
    for status, style in _STATUS_STYLE.items():
        if any(r.status == status for r in rows):
            hollow = not style["filled"]
            handles.append(Line2D([], [], linestyle="none", marker=style["marker"], markersize=7,
                                  color="#444444", markerfacecolor="white" if hollow else "#444444",
                                  markeredgewidth=1.6 if hollow or style["marker"] == "x" else 0.6,
                                  label=style["legend"]))
    if front:
        handles.append(Line2D([], [], linestyle="--", color="black", linewidth=1.2, label="Pareto front"))
    if best:
        handles.append(Line2D([], [], linestyle="none", marker="o", markersize=12, markerfacecolor="none",
                              markeredgecolor="black", markeredgewidth=1.4, label="best trial"))
    handles += extra
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8,
                  frameon=False, borderaxespad=0.0)


def _not_plotted_note(ax: Axes, rows: list[TrialRow]) -> None:
    """Say which trials the plot leaves out (errored, or no value to plot), under the legend."""
    if rows:
        names = ", ".join(f"{r.label} ({r.status})" for r in rows)
        ax.annotate("not plotted:\n" + _wrap(names, 30), (1.02, 0.0), xycoords="axes fraction",
                    ha="left", va="bottom", fontsize=7, color="#444444")


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width=width, break_on_hyphens=False, break_long_words=False))


# candidate label positions around a point: (dx, dy) in points, horizontal and vertical alignment
_LABEL_SPOTS = ((5, 4, "left", "bottom"), (5, -4, "left", "top"), (-5, 4, "right", "bottom"),
                (-5, -4, "right", "top"), (0, 7, "center", "bottom"), (0, -7, "center", "top"),
                (8, 0, "left", "center"), (-8, 0, "right", "center"))


def _label_points(fig: Figure, ax: Axes, points: list[tuple[float, float, str, Any, bool]]) -> None:
    """Annotate each (x, y, text, xycoords, bold) next to its point, choosing for each the spot
    (of _LABEL_SPOTS) that overlaps no point, no line of the axes, no label placed before and
    stays in the axes; the least overlapping spot when none is free. Call once the axes limits
    are final."""
    fig.canvas.draw()                     # lay the figure out: display coordinates are final
    renderer = fig.canvas.get_renderer()
    area = ax.get_window_extent(renderer)
    radius = math.sqrt(_MARKER_S) / 2 * fig.dpi / 72 + 1
    dots = []
    for x, y, _, coords, _ in points:
        trans = ax.transData if coords == "data" else coords
        px, py = trans.transform((x, y))
        dots.append(Bbox.from_extents(px - radius, py - radius, px + radius, py + radius))
    dots += [t.get_window_extent(renderer) for t in ax.texts]   # e.g. "OOM", "no trial produced results"
    ring = math.sqrt(_MARKER_S * 4.5) / 2 * fig.dpi / 72 + 1
    for c in ax.collections:             # the ring around the best trial
        if c.get_gid() == "best_trial":
            px, py = ax.transData.transform(c.get_offsets()[0])
            dots.append(Bbox.from_extents(px - ring, py - ring, px + ring, py + ring))
    for line in ax.get_lines():          # e.g. the Pareto front: a small box every few pixels
        xy = line.get_transform().transform(np.column_stack(line.get_data()))
        for (x0, y0), (x1, y1) in zip(xy[:-1], xy[1:], strict=True):
            for t in np.linspace(0, 1, max(2, int(math.hypot(x1 - x0, y1 - y0) / 3))):
                px, py = x0 + t * (x1 - x0), y0 + t * (y1 - y0)
                dots.append(Bbox.from_extents(px - 1.5, py - 1.5, px + 1.5, py + 1.5))

    def overlap(a: Bbox, b: Bbox) -> float:
        w = min(a.x1, b.x1) - max(a.x0, b.x0)
        h = min(a.y1, b.y1) - max(a.y0, b.y0)
        return w * h if w > 0 and h > 0 else 0.0

    placed: list[Any] = []
    for x, y, text, coords, bold in points:
        best = None
        for dx, dy, ha, va in _LABEL_SPOTS:
            ann = ax.annotate(text, (x, y), xycoords=coords, xytext=(dx, dy), textcoords="offset points",
                              ha=ha, va=va, fontsize=_LABEL_SIZE, fontweight="bold" if bold else "normal",
                              color="#222222", zorder=5, annotation_clip=False)
            ann.set_in_layout(False)
            box = ann.get_window_extent(renderer).padded(1.5)
            outside = box.width * box.height - overlap(box, area)
            cost = 4 * outside + sum(overlap(box, b) for b in (*dots, *placed))
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, ann, box)
            else:
                ann.remove()
            if cost == 0:
                break
        placed.append(best[2])


def _no_ticks_in_band(ax: Axes) -> None:
    """Drop the y ticks inside the bottom band of trials without a value: their height there is
    no accuracy. Call once the y limits are final."""
    lo, hi = ax.get_ylim()
    top = lo + OOM_BAND * (hi - lo)
    ax.set_yticks([t for t in ax.get_yticks() if top < t <= hi])
    ax.set_ylim(lo, hi)


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI, facecolor="white")
    return path


def _strip_label(rows: list[TrialRow]) -> str:
    """The label of the strip holding the trials without a result: the statuses among them."""
    return " / ".join(s for s in NO_RESULT if any(r.status == s for r in rows))


def _oom_y(i: int) -> float:
    """Where the i-th OOM / DIVERGED trial sits in the scatter's strip (axes fraction, from the top)."""
    return max(0.9 - 0.07 * i, 0.05)


def scatter_figure(rows: list[TrialRow], *, title: str = "") -> Figure:
    """The figure `plot_scatter` saves (a matplotlib Figure on an Agg canvas)."""
    fig, (ax,) = _new_figure(8.6, 5.2)
    colours = _colours(rows)
    pool = [r for r in usable(rows) if math.isfinite(r.clips_per_s)]
    oom = [r for r in rows if r.status in NO_RESULT]
    front = sorted(pareto_front(rows), key=lambda r: r.clips_per_s)
    on_front = {id(r) for r in front}
    ax.margins(x=0.12, y=0.15)
    for r in pool:
        _draw_point(ax, r.clips_per_s, r.val_acc, r, colours[r.batch_size])
    best = best_trial(pool, "val_acc")
    if best is not None:
        _ring_best(ax, best.clips_per_s, best.val_acc)
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
        ax.text(-0.02 * right, 0.985, _strip_label(oom), transform=ax.get_xaxis_transform(), ha="center",
                va="top", fontsize=7, color="#555555")
        for i, r in enumerate(oom):
            _draw_point(ax, 0.0, _oom_y(i), r, colours[r.batch_size], transform=ax.get_xaxis_transform())
    ax.set_xlabel("steady-state training throughput (clips/s)")
    ax.set_ylabel("validation accuracy (best epoch)")
    ax.set_title(f"{title}: accuracy vs speed" if title else "trials: accuracy vs speed", fontsize=11)
    ax.grid(alpha=0.3)
    _legend(ax, pool + oom, colours, front=drawn, best=best is not None)
    shown = {id(r) for r in pool + oom}
    _not_plotted_note(ax, [r for r in rows if id(r) not in shown])
    points = [(r.clips_per_s, r.val_acc, r.label, "data", id(r) in on_front and drawn)
              for r in sorted(pool, key=lambda r: id(r) not in on_front)]
    points += [(0.0, _oom_y(i), r.label, ax.get_xaxis_transform(), False) for i, r in enumerate(oom)]
    _label_points(fig, ax, points)
    return fig


def plot_scatter(rows: list[TrialRow], path: Path, *, title: str = "") -> Path | None:
    """Validation accuracy (best epoch) against steady clips/s, one labelled point per trial:
    colour = batch size, marker = status (DONE filled, STOPPED hollow, UNFINISHED triangle; OOM
    an x and DIVERGED a hollow diamond, at 0 clips/s in a shaded strip), the Pareto front dashed
    when it has 2 or more trials. PNG at PLOT_DPI."""
    return _save(scatter_figure(rows, title=title), path)


_OBJECTIVE_LABEL = {"val_acc": "validation accuracy (best epoch)",
                    "val_f1": "validation F1 (best epoch by val_acc)"}


def params_figure(rows: list[TrialRow], *, objective: str, title: str = "") -> Figure:
    """The figure `plot_objective_vs_params` saves."""
    key = objective_key(objective)
    params = [("lr", "learning rate (log scale)")]
    if any(r.weight_decay is not None for r in rows):
        params.append(("weight_decay", "weight decay (log scale)"))
    params.append(("batch_size", "batch size\n(trials of one size spread sideways to be seen)"))
    fig, axes = _new_figure(3.6 * len(params) + 2.2, 4.4, ncols=len(params), sharey=True)
    colours = _colours(rows)
    pool = [r for r in usable(rows) if math.isfinite(getattr(r, key))]
    oom = [r for r in rows if r.status in NO_RESULT]
    best = best_trial(rows, objective)
    sizes = sorted({r.batch_size for r in pool + oom})
    # batch sizes are categories: spread the trials of one size a little apart, by value (the
    # OOM / DIVERGED ones, all on the bottom band, wider apart)
    spread: dict[int, float] = {}
    for b in sizes:
        for group, step in ((pool, 0.12), (oom, 0.3)):
            same = sorted((r for r in group if r.batch_size == b), key=lambda r: getattr(r, key))
            for k, r in enumerate(same):
                spread[id(r)] = sizes.index(b) + (k - (len(same) - 1) / 2) * min(step, 0.7 / len(same))

    def x_of(r: TrialRow, param: str) -> float:
        if param == "batch_size":
            return spread[id(r)]
        v = getattr(r, param)
        return float(v) if v is not None and v > 0 else math.nan

    for ax, (param, label) in zip(axes, params, strict=True):
        ax.margins(x=0.15, y=0.15)
        if param != "batch_size":
            ax.set_xscale("log")
        for r in pool:
            if math.isfinite(x_of(r, param)):
                _draw_point(ax, x_of(r, param), getattr(r, key), r, colours[r.batch_size])
        if best is not None and math.isfinite(x_of(best, param)):
            _ring_best(ax, x_of(best, param), getattr(best, key))
        oom_here = [r for r in oom if math.isfinite(x_of(r, param))]
        if oom_here:   # no value: a mark in a shaded band along the bottom edge
            ax.margins(y=0.3)
            ax.add_patch(Rectangle((0, 0), 1, OOM_BAND, transform=ax.transAxes, color="#ebebeb", zorder=0,
                                   linewidth=0))
            ax.text(0.01, OOM_BAND / 2, _strip_label(oom_here), transform=ax.transAxes, ha="left",
                    va="center", fontsize=7, color="#555555")
        for r in oom_here:
            _draw_point(ax, x_of(r, param), OOM_BAND / 2, r, colours[r.batch_size],
                        transform=ax.get_xaxis_transform())
        if param == "batch_size":
            ax.set_xticks(range(len(sizes)), [str(b) for b in sizes])
            if sizes:
                ax.set_xlim(-0.6, len(sizes) - 0.4)
        else:
            _log_ticks(ax)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        if not pool:
            ax.set_ylim(0.0, 1.0)
        if not pool and ax is axes[0]:
            ax.text(0.5, 0.5, "no trial produced results", ha="center", va="center", transform=ax.transAxes,
                    color="#444444")
    axes[0].set_ylabel(_OBJECTIVE_LABEL[key])
    if oom and pool:
        _no_ticks_in_band(axes[0])
    fig.suptitle(f"{title}: " * bool(title) + f"{key} by searched parameter" +
                 " (objective: pareto)" * (objective == "pareto"), fontsize=11)
    _legend(axes[-1], pool + oom, colours, front=False, best=best is not None)
    shown = {id(r) for r in pool + oom}
    _not_plotted_note(axes[-1], [r for r in rows if id(r) not in shown])
    for ax, (param, _) in zip(axes, params, strict=True):
        points = [(x_of(r, param), getattr(r, key), r.label, "data", r is best) for r in pool
                  if math.isfinite(x_of(r, param))]
        points += [(x_of(r, param), OOM_BAND / 2, r.label, ax.get_xaxis_transform(), False) for r in oom
                   if math.isfinite(x_of(r, param))]
        _label_points(fig, ax, points)
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
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: short_lr(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_objective_vs_params(rows: list[TrialRow], path: Path, *, objective: str,
                             title: str = "") -> Path | None:
    """The objective (val_acc or val_f1, at each trial's best epoch by val_acc; pareto: val_acc)
    against each searched parameter, one subplot each: lr and weight decay (when searched) on
    log axes, batch size as categories. Points coloured by batch size, marked by status and
    labelled like `plot_scatter`; OOM and DIVERGED trials in a band on the bottom edge. PNG at
    PLOT_DPI. None (nothing written) without any trial."""
    if not rows:
        return None
    return _save(params_figure(rows, objective=objective, title=title), path)


def _start_number(r: TrialRow, default: int) -> int:
    """The trial's number in the search from its name (t03-... -> 3); `default` without one."""
    head = r.label.split("-", 1)[0]
    return int(head[1:]) if head[:1] == "t" and head[1:].isdigit() else default


def history_figure(rows: list[TrialRow], *, objective: str, title: str = "") -> Figure:
    """The figure `plot_history` saves."""
    key = objective_key(objective)
    fig, (ax,) = _new_figure(8.6, 4.4)
    colours = _colours(rows)
    order = sorted(rows, key=lambda r: _start_number(r, rows.index(r) + 1))
    number = {id(r): _start_number(r, i + 1) for i, r in enumerate(order)}
    pool = {id(r) for r in usable(rows) if math.isfinite(getattr(r, key))}
    ax.margins(x=0.05, y=0.15)
    running, steps = -math.inf, []
    for r in order:
        if id(r) in pool:
            _draw_point(ax, number[id(r)], getattr(r, key), r, colours[r.batch_size])
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
            _draw_point(ax, number[id(r)], OOM_BAND / 2, r, colours[r.batch_size],
                        transform=ax.get_xaxis_transform())
        ax.set_ylim(bottom=ax.get_ylim()[0] - 0.3 * (ax.get_ylim()[1] - ax.get_ylim()[0]))
        _no_ticks_in_band(ax)
    best = best_trial(rows, objective)
    if best is not None:
        _ring_best(ax, number[id(best)], getattr(best, key))
    numbers = sorted(number.values())
    ax.set_xticks(numbers if len(numbers) <= 30 else numbers[::max(1, len(numbers) // 15)])
    ax.set_xlabel("trial, in the order it started")
    ax.set_ylabel(_OBJECTIVE_LABEL[key])
    ax.set_title(f"{title}: " * bool(title) + f"{key} by trial, best so far", fontsize=11)
    ax.grid(alpha=0.3)
    line = Line2D([], [], color="black", linewidth=1.3, label="best so far")
    _legend(ax, rows, colours, front=False, best=best is not None, extra=(line,) if shown else ())
    labels = [(number[id(r)], getattr(r, key), r.label, "data", r is best) for r in order if id(r) in pool]
    labels += [(number[id(r)], OOM_BAND / 2, r.label, ax.get_xaxis_transform(), False) for r in unusable]
    if len(rows) <= 20:   # beyond, the labels crowd the points: the numbers on the axis say which
        _label_points(fig, ax, labels)
    return fig


def plot_history(rows: list[TrialRow], path: Path, *, objective: str, title: str = "") -> Path | None:
    """The objective (at each trial's best epoch by val_acc; pareto: val_acc) of each trial in the
    order trials started (their number, t03 -> 3), as points marked like `plot_scatter`; the best
    so far as a black step line (never going down); trials without a value (OOM, DIVERGED,
    ERROR) in a band along the bottom; the best trial ringed. PNG at PLOT_DPI. None (nothing
    written) without any trial."""
    if not rows:
        return None
    return _save(history_figure(rows, objective=objective, title=title), path)

