"""The end of a search: one row per trial, the best trial, the Pareto front (accuracy vs clips/s),
the table as text and CSV, and the scatter plot (matplotlib Agg, no display needed)."""
from __future__ import annotations

import csv
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

# What each status means: DONE ran all epochs; STOPPED was stopped early by ASHA; OOM ran out
# of memory (infeasible); ERROR raised; UNFINISHED was interrupted (continue with --resume).
STATUSES = ("DONE", "STOPPED", "OOM", "ERROR", "UNFINISHED")


@dataclass(frozen=True)
class TrialRow:
    trial_id: str
    batch_size: int
    lr: float
    weight_decay: float | None
    val_acc: float          # last reported (nan when none)
    val_f1: float
    clips_per_s: float      # steady state: median over epochs 2.. (epoch 1 alone when only it ran)
    epoch_time_s: float     # steady state, like clips_per_s
    epochs: int             # epochs reported
    status: str             # one of STATUSES
    checkpoint: str | None  # best-val_acc checkpoint of the trial that still exists
    node_id: str | None = None
    compute_clips_per_s: float = math.nan   # steady state of clips / time not waiting for data
    concurrent_trainings: float = math.nan  # most trainings on its device at once, any epoch (1 = alone)


def trial_status(last: dict[str, Any], *, epochs: int, error: bool = False, finished: bool = True) -> str:
    """One of STATUSES from a trial's last report: the one rule the table and MLflow share.
    `error`: the trial raised; `finished`: Tune ended it (False: the search was interrupted)."""
    if error:
        return "ERROR"
    if int(last.get("oom", 0) or 0) == 1:
        return "OOM"
    if not finished:
        return "UNFINISHED"
    if int(last.get("epoch") or 0) < epochs:
        return "STOPPED"
    return "DONE"


def _f(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def row_from_result(result: Any, *, trial_id: str, epochs: int, finished: bool,
                    train_run: str | None = None) -> TrialRow:
    """One Tune `Result` -> TrialRow. `finished`: Tune ended the trial (not interrupted).
    `train_run`: the folder of the trial's Ray Train run (its checkpoints)."""
    m = dict(result.metrics or {})
    cfg = dict(result.config or {})
    epoch = int(m.get("epoch") or 0)
    status = trial_status(m, epochs=epochs, error=result.error is not None, finished=finished)
    speed = steady_speeds(result)
    return TrialRow(
        trial_id=trial_id,
        batch_size=int(cfg.get("batch_size", m.get("batch_size", 0)) or 0),
        lr=_f(cfg.get("lr", m.get("lr"))),
        weight_decay=_f(cfg["weight_decay"]) if "weight_decay" in cfg else None,
        val_acc=_f(m.get("val_acc")), val_f1=_f(m.get("val_f1")),
        clips_per_s=speed["clips_per_s"], epoch_time_s=speed["epoch_time_s"],
        epochs=epoch, status=status, checkpoint=best_checkpoint(train_run, result),
        node_id=m.get("node_id"), compute_clips_per_s=speed["compute_clips_per_s"],
        concurrent_trainings=speed["concurrent_trainings"],
    )


SPEED_KEYS = ("clips_per_s", "compute_clips_per_s", "epoch_time_s")


def steady_speeds(result: Any) -> dict[str, float]:
    """A trial's steady-state speed (`trainer.metrics.steady_state` of each of SPEED_KEYS over
    its reported epochs) and the most trainings that shared its device in any epoch.

    Read from every epoch Tune recorded (`metrics_dataframe`, one row per report; a resumed
    trial re-reports an epoch, the last report of an epoch wins), falling back to the last
    result alone. An out-of-memory trial reports 0 clips/s: it has no speed (NaN)."""
    from trainer.metrics import steady_state

    m = dict(result.metrics or {})
    if int(m.get("oom", 0) or 0) == 1:
        return {**{k: math.nan for k in SPEED_KEYS}, "concurrent_trainings": _f(m.get("concurrent_trainings"))}
    df = getattr(result, "metrics_dataframe", None)
    by_epoch: dict[str, dict[int, float]] = {k: {} for k in (*SPEED_KEYS, "concurrent_trainings")}
    if df is not None and "epoch" in getattr(df, "columns", ()):
        for _, row in df.iterrows():
            epoch = int(_f(row.get("epoch")) if math.isfinite(_f(row.get("epoch"))) else 0)
            for key in by_epoch:
                if epoch >= 1 and key in row:
                    by_epoch[key][epoch] = _f(row[key])
    last_epoch = int(_f(m.get("epoch")) if math.isfinite(_f(m.get("epoch"))) else 0)
    for key in by_epoch:
        if last_epoch >= 1 and key in m:
            by_epoch[key].setdefault(last_epoch, _f(m[key]))
    shared = [v for v in by_epoch["concurrent_trainings"].values() if math.isfinite(v)]
    return {**{k: steady_state(by_epoch[k]) for k in SPEED_KEYS},
            "concurrent_trainings": max(shared) if shared else math.nan}


def best_checkpoint(train_run: str | None, result: Any) -> str | None:
    """The trial's best-val_acc checkpoint: Ray Train's own pick among the checkpoints its run
    kept (`ray.train.Result.from_path(train_run).get_best_checkpoint`). Without a readable run
    folder (none given, or gone), the last checkpoint the trial reported, if it still exists."""
    if train_run:
        import ray.train

        quiet = logging.getLogger("ray.train")   # from_path logs a paragraph per run read at INFO
        level = quiet.level
        quiet.setLevel(logging.WARNING)
        try:
            run = ray.train.Result.from_path(train_run)
            if run.best_checkpoints:
                return run.get_best_checkpoint(metric="val_acc", mode="max").path
        except (RuntimeError, OSError, ValueError):
            pass   # an interrupted run may have no checkpoint manager snapshot yet
        finally:
            quiet.setLevel(level)
    last = (result.metrics or {}).get("checkpoint_path")
    if last and ("://" in last or Path(last).exists()):
        return last
    return None


def usable(rows: Iterable[TrialRow]) -> list[TrialRow]:
    """Trials with results worth ranking (not OOM, not errored, with a finite accuracy)."""
    return [r for r in rows if r.status in ("DONE", "STOPPED", "UNFINISHED") and math.isfinite(r.val_acc)]


def best_trial(rows: list[TrialRow], objective: str) -> TrialRow | None:
    """Highest objective among usable trials; pareto: the most accurate trial on the front.
    Ties go to the faster trial (clips/s)."""
    key = "val_acc" if objective == "pareto" else objective
    pool = pareto_front(rows) if objective == "pareto" else usable(rows)
    pool = [r for r in pool if math.isfinite(getattr(r, key))]
    if not pool:
        return None
    return max(pool, key=lambda r: (getattr(r, key), _f(r.clips_per_s) if math.isfinite(r.clips_per_s) else -1))


def pareto_front(rows: list[TrialRow]) -> list[TrialRow]:
    """Trials no other trial beats on both val_acc and clips_per_s (both maximised), by accuracy."""
    pool = [r for r in usable(rows) if math.isfinite(r.clips_per_s)]

    def dominated(a: TrialRow) -> bool:
        return any(b.val_acc >= a.val_acc and b.clips_per_s >= a.clips_per_s and
                   (b.val_acc > a.val_acc or b.clips_per_s > a.clips_per_s) for b in pool)

    return sorted((r for r in pool if not dominated(r)), key=lambda r: (-r.val_acc, -r.clips_per_s))


def format_table(rows: list[TrialRow], *, show_wd: bool = False) -> str:
    """Plain-text table: trial, batch size, lr, (weight decay), val_acc, val_f1, steady clips/s
    (end to end, and compute only), steady epoch time, epochs, status. A `*` after clips/s marks
    a trial that shared its device with another training (its speed is not its own)."""
    head = ["trial", "batch", "lr"] + (["wd"] if show_wd else []) + \
        ["val_acc", "val_f1", "clips/s", "compute/s", "epoch_s", "epochs", "status"]
    body = []
    for r in rows:
        # "*": the trial shared its device with another training in some epoch (packed trials)
        shared = "*" if math.isfinite(r.concurrent_trainings) and r.concurrent_trainings > 1 else ""
        body.append([r.trial_id, str(r.batch_size), f"{r.lr:.2e}"] +
                    ([f"{r.weight_decay:.2e}" if r.weight_decay is not None else "-"] if show_wd else []) +
                    [_num(r.val_acc, 3), _num(r.val_f1, 3), _num(r.clips_per_s, 1) + shared,
                     _num(r.compute_clips_per_s, 1), _num(r.epoch_time_s, 1), str(r.epochs), r.status])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def _num(x: float, digits: int) -> str:
    return f"{x:.{digits}f}" if math.isfinite(x) else "-"


def write_csv(rows: list[TrialRow], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(TrialRow.__dataclass_fields__))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    return path


def plot_scatter(rows: list[TrialRow], path: Path, *, title: str = "") -> Path | None:
    """val_acc against clips/s, coloured by batch size, the Pareto front joined and ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pool = [r for r in usable(rows) if math.isfinite(r.clips_per_s)]
    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=100)
    try:
        if pool:
            sizes = sorted({r.batch_size for r in pool})
            cmap = plt.get_cmap("viridis", max(len(sizes), 2))
            for i, b in enumerate(sizes):
                pts = [r for r in pool if r.batch_size == b]
                ax.scatter([r.clips_per_s for r in pts], [r.val_acc for r in pts], color=cmap(i),
                           label=f"batch {b}", s=40, zorder=3)
            front = sorted(pareto_front(rows), key=lambda r: r.clips_per_s)
            ax.plot([r.clips_per_s for r in front], [r.val_acc for r in front], "--", color="crimson",
                    zorder=2, label="Pareto front")
            ax.scatter([r.clips_per_s for r in front], [r.val_acc for r in front], s=140,
                       facecolors="none", edgecolors="crimson", zorder=4)
            ax.legend(loc="best", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no trial produced results", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("training throughput (clips/s)")
        ax.set_ylabel("validation accuracy")
        ax.set_title(title or "trials: accuracy vs speed")
        ax.grid(alpha=0.3)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path
