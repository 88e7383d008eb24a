"""What the replays say: per strategy, time to come within 1 point of the best (median and
quartiles over the replay seeds), the judged val_acc at 10 / 30 / 50 % of the grid's device time,
the two ratios issue 17 sets goals for, a console table and the picture."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench.common import format_table
from bench.sq_replay import Trace
from bench.sq_table import TARGET_POINTS, Table

FRACTIONS = (0.1, 0.3, 0.5)        # of the grid's device time


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    """(25th, 50th, 75th percentile); inf (never reached) counts as larger than anything."""
    q = np.percentile(np.array(values, dtype=float), [25, 50, 75], method="lower")
    return float(q[0]), float(q[1]), float(q[2])


def summarise(table: Table, traces: dict[str, list[Trace]], grid_s: float, *,
              points: float = TARGET_POINTS) -> dict[str, Any]:
    """Per strategy: time to target (s and share of the grid's time), value at each fraction,
    trials started; plus `ratios` for the default against the grid and random + ASHA."""
    target = table.best_final_mean - points
    out: dict[str, Any] = {"best_final_mean": table.best_final_mean, "target": target, "grid_s": grid_s,
                           "strategies": {}}
    for name, runs in traces.items():
        times = [t.time_to(target) for t in runs]
        q1, med, q3 = _quartiles(times)
        at = {f"{int(f * 100)}%": [_or_nan(t.value_at(f * grid_s)) for t in runs] for f in FRACTIONS}
        out["strategies"][name] = {
            "time_to_1pt_s": {"q1": q1, "median": med, "q3": q3},
            "time_to_1pt_vs_grid": {"q1": q1 / grid_s, "median": med / grid_s, "q3": q3 / grid_s},
            "reached_share": float(np.mean([math.isfinite(t) for t in times])),
            "value_at": {k: {"median": float(np.nanmedian(v)) if not all(map(math.isnan, v)) else None,
                             "per_seed": v} for k, v in at.items()},
            "by_training_seed": by_training_seed(runs, times, grid_s),
            "trials_median": float(np.median([len(t.trials) for t in runs])),
            "end_s_median": float(np.median([t.end_s for t in runs])),
        }
    s = out["strategies"]
    if "random+asha" in s:
        theirs = s["random+asha"]["value_at"]["30%"]["per_seed"]
        for entry in s.values():   # share of seeds at least as good as random + ASHA at 30 % (same seed)
            mine = entry["value_at"]["30%"]["per_seed"]
            entry["beats_random_asha_at_30%"] = float(np.mean(
                [_or_zero(a) >= _or_zero(b) for a, b in zip(mine, theirs, strict=True)]))
    if "default" in s and "random+asha" in s:
        out["ratios"] = {"default_time_to_1pt_vs_grid": s["default"]["time_to_1pt_vs_grid"]["median"],
                         "default_beats_random_asha": s["default"]["beats_random_asha_at_30%"]}
    return out


def by_training_seed(runs: list[Trace], times: list[float], grid_s: float) -> dict[str, dict[str, Any]]:
    """Per training seed of the table (the curves a replay read): the share of its replays that got
    within the target and their median time (share of the grid's; None: the median one never
    did). How much a table's verdict rests on one lucky run: a search sees one seed's curves and
    is judged on the seed mean, so where one seed's run of a weaker configuration ends high, every
    search that meets it (the grid too) picks it and stays below the target."""
    out = {}
    for seed in sorted({t.table_seed for t in runs}):
        mine = [when for t, when in zip(runs, times, strict=True) if t.table_seed == seed]
        median = _quartiles(mine)[1] / grid_s
        out[str(seed)] = {"replays": len(mine),
                          "reached_share": float(np.mean([math.isfinite(x) for x in mine])),
                          "time_to_1pt_vs_grid_median": median if math.isfinite(median) else None}
    return out


def one_seed_warning(summary: dict[str, Any], *, below: float = 0.5) -> str | None:
    """A line when, under some training seed of the table, even the grid (every configuration)
    gets within the target in fewer than `below` of its replays; else None."""
    grid = summary["strategies"].get("grid")
    if grid is None:
        return None
    weak = {seed: v["reached_share"] for seed, v in grid["by_training_seed"].items()
            if v["reached_share"] < below}
    if not weak:
        return None
    seeds = " and ".join(f"training seed {seed} in only {share:.0%}" for seed, share in weak.items())
    return (f"even the grid gets within the target, reading {seeds} of its replays: there a run "
            "of a weaker configuration ends higher than the best one does, so the table's verdict rests "
            "on that run")


def _or_nan(v: float) -> float:
    return v if math.isfinite(v) else float("nan")


def _or_zero(v: float) -> float:
    return v if math.isfinite(v) else 0.0


def grid_table(table: Table) -> str:
    """The recorded grid: seed-mean val_acc at the middle and the last epoch, per batch size and lr."""
    mid = table.epochs // 2
    rows = []
    for batch in table.batch_sizes:
        for epoch in (mid, table.epochs):
            rows.append([f"batch {batch}, epoch {epoch}", *[
                f"{np.mean([table.runs[(batch, lr, s)].val_acc[epoch - 1] for s in table.seeds]):.3f}"
                for lr in table.lrs]])
    return format_table(["seed-mean val_acc", *[f"{lr:.2g}" for lr in table.lrs]], rows)


def console_table(summary: dict[str, Any]) -> str:
    """One row per strategy: time to within 1 point (share of the grid's time: quartiles), share
    of seeds that got there (and per training seed of the table), median judged val_acc at
    10/30/50 %, share of seeds at least as good as random + ASHA at 30 %, median trials started."""
    rows = []
    for name, s in summary["strategies"].items():
        t = s["time_to_1pt_vs_grid"]
        per_seed = "/".join(f"{v['reached_share']:.0%}" for v in s["by_training_seed"].values())
        rows.append([name, pct(t["q1"]), pct(t["median"]), pct(t["q3"]), f"{s['reached_share']:.0%}",
                     per_seed,
                     *[_acc(s["value_at"][k]["median"]) for k in ("10%", "30%", "50%")],
                     _share(s.get("beats_random_asha_at_30%")), f"{s['trials_median']:.0f}"])
    head = ["strategy", "target q1", "median", "q3", "reached", "by seed", "acc@10%", "acc@30%", "acc@50%",
            ">=r+a@30%", "trials"]
    return format_table(head, rows)


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def pct(v: float) -> str:
    return f"{v:.0%}" if math.isfinite(v) else "never"


def _acc(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.3f}"


def plot_tables(panels: list[tuple[str, Table, dict[str, list[Trace]], float]], path: str | Path, *,
                names: list[str] | None = None, points: float = TARGET_POINTS) -> Path:
    """One panel per (name, table, traces, grid seconds): best-so-far (judged) against device time
    as a share of the grid's, median line and quartile band per strategy, the target dashed."""
    cols = min(2, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(7.5 * cols, 4.6 * rows))
    FigureCanvasAgg(fig)
    for i, (title, table, traces, grid_s) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        _panel(ax, table, traces, grid_s, [n for n in (names or list(traces)) if n in traces], points)
        ax.set_title(f"{title}: {len(table.configs)} configs x {table.epochs} epochs, best "
                     f"{table.best_final_mean:.3f}", fontsize=9)
    fig.suptitle("best so far: median and quartiles over replay seeds", fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))   # 0.4 in. for the suptitle
    fig.savefig(path, dpi=100)
    return path


def plot(table: Table, traces: dict[str, list[Trace]], grid_s: float, path: str | Path, *,
         names: list[str] | None = None, points: float = TARGET_POINTS) -> Path:
    """`plot_tables` for one table."""
    return plot_tables([("table", table, traces, grid_s)], path, names=names, points=points)


def _panel(ax: Any, table: Table, traces: dict[str, list[Trace]], grid_s: float, names: list[str],
           points: float) -> None:
    xs = np.linspace(0, 1.0, 201)
    for name in names:
        values = np.array([[_or_nan(t.value_at(x * grid_s)) for x in xs] for t in traces[name]])
        filled = np.where(np.isnan(values), np.nanmin(values) if np.isfinite(values).any() else 0.5, values)
        q1, med, q3 = np.percentile(filled, [25, 50, 75], axis=0)
        (line,) = ax.plot(xs * 100, med, label=name, lw=1.8 if name in ("default", "grid") else 1.2)
        ax.fill_between(xs * 100, q1, q3, color=line.get_color(), alpha=0.15)
    ax.axhline(table.best_final_mean - points, ls="--", color="k", lw=0.8,
               label=f"best - {points * 100:g} point(s)")
    ax.axvline(30, ls=":", color="grey", lw=0.8)
    ax.set_xlabel("device time, % of the full grid's")
    ax.set_ylabel("picked config's seed-mean final val_acc")
    ax.set_ylim(table.best_final_mean - 0.15, table.best_final_mean + 0.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
