"""Drawing shared by the search's plots (`tune.outputs.plots`, `tune.outputs.importance`): figures on their
own
Agg canvas saved at PLOT_DPI, one colour per batch size, a marker per status, the legend, labels
placed clear of the points, lines and each other, and the bottom band that holds the trials
without a value (OOM, DIVERGED)."""
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
from matplotlib.transforms import Bbox, Transform

from vidtune.tune.outputs.results import NO_RESULT, TrialResult
from vidtune.tune.outputs.uncertainty import accuracy_interval

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


def batch_colours(rows: Iterable[TrialResult]) -> dict[int, str]:
    sizes = sorted({r.batch_size for r in rows})
    return {b: _PALETTE[i % len(_PALETTE)] for i, b in enumerate(sizes)}


def new_figure(width: float, height: float, ncols: int = 1,
                sharey: bool = False) -> tuple[Figure, list[Axes]]:
    """A figure on its own Agg canvas (no pyplot state, nothing to close), constrained layout."""
    fig = Figure(figsize=(width, height), dpi=PLOT_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, sharey=sharey, squeeze=False)[0]
    return fig, list(axes)


def draw_point(ax: Axes, x: float, y: float, r: TrialResult, colour: str,
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


def draw_interval(ax: Axes, x: float, acc: float, val_clips: int, colour: str) -> bool:
    """The 95% interval of accuracy `acc` on `val_clips` clips (Wilson's, `tune.outputs.uncertainty`:
    not symmetric about `acc`) as a bar through the point at `x`; a line, so labels keep clear of
    it. False (nothing drawn) without an interval (no accuracy, or the clip count unknown)."""
    low, high = accuracy_interval(acc, val_clips)
    if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(x)):
        return False
    ax.plot([x, x], [low, high], color=colour, alpha=0.45, linewidth=1.8, zorder=2, solid_capstyle="butt",
            gid="interval")
    return True


def interval_handle() -> Line2D:
    """The legend's entry for `draw_interval`'s bars."""
    return Line2D([], [], color="#444444", alpha=0.45, linewidth=1.8, label="95% interval of the\naccuracy")


def ring_best(ax: Axes, x: float, y: float) -> None:
    """A black ring around the best trial's point (`_legend` names it)."""
    ax.scatter([x], [y], marker="o", s=_MARKER_S * 4.5, facecolors="none", edgecolors="black",
               linewidths=1.4, zorder=4, clip_on=False, gid="best_trial")


def draw_legend(ax: Axes, rows: list[TrialResult], colours: dict[int, str], *, front: bool,
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


def not_plotted_note(ax: Axes, rows: list[TrialResult]) -> None:
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


def label_points(fig: Figure, ax: Axes, points: list[tuple[float, float, str, Any, bool]]) -> None:
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


def no_ticks_in_band(ax: Axes) -> None:
    """Drop the y ticks inside the bottom band of trials without a value: their height there is
    no accuracy. Call once the y limits are final."""
    lo, hi = ax.get_ylim()
    top = lo + OOM_BAND * (hi - lo)
    ax.set_yticks([t for t in ax.get_yticks() if top < t <= hi])
    ax.set_ylim(lo, hi)


def save_png(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI, facecolor="white")
    return path


def strip_label(rows: list[TrialResult]) -> str:
    """The label of the strip holding the trials without a result: the statuses among them."""
    return " / ".join(s for s in NO_RESULT if any(r.status == s for r in rows))
