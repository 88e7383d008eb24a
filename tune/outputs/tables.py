"""The trials as tables: plain text for the console (`format_table`, with `column_notes` and the
speed marks under it), markdown for the parent run's MLflow description (`format_markdown`),
and trials.csv (`write_csv`). The rows, their ranking and their summary: `tune.outputs.results`.

trials.csv (`write_csv`), one row per trial, best first by the search's objective (unusable
trials, OOM, DIVERGED and ERROR, and those without a value last):
  name           the trial's short readable name (e.g. t03-bs8-lr2.5e-4)
  trial_id       Tune's trial id
  status         DONE, STOPPED, OOM, DIVERGED, ERROR or UNFINISHED (see STATUSES)
  batch_size, lr, weight_decay   the trial's configuration, a column per parameter a search may
                 search (`tune.config.searched.PARAMS`; numbers to 3 significant digits); a parameter this
                 search did not search holds the value every trial trained with
  best_val_acc   validation accuracy of the trial's best epoch by the search's objective (val_acc or
                 val_f1; pareto: val_acc) (4 decimals; nan when none)
  best_val_acc_low, best_val_acc_high   its 95% Wilson interval from the validation clip count
                 (4 decimals; nan when none or the count is unknown)
  best_val_f1    macro F1 of the same epoch
  best_epoch     that best epoch (by the objective): best_val_acc, best_val_f1 and the checkpoint are
                 from it; nan when none
  epochs         epochs trained (the last epoch reported)
  speed_clips_per_s   the one speed: steady-state clips/s end to end (2 decimals; nan for OOM
                 and DIVERGED)
  compute_clips_per_s, epoch_time_s   steady state too: clips/s counting only the time not spent
                 waiting for data (what a faster loader could reach), and seconds per epoch
  concurrent_trainings   most trainings sharing its device in any epoch (1 = alone)
  other_cpu_cores        cores other processes kept busy on its machine, steady state like the speed
  node_id, checkpoint    where it ran; its best checkpoint that still exists (empty when none)
  gpu_ids        the physical GPU ids it trained on ("0", "2,3"); a column only when some trial
                 had a GPU
"""
from __future__ import annotations

import csv
import math
import textwrap
from collections.abc import Mapping
from pathlib import Path

from vidtune.numbers import significant
from vidtune.trainer.training.report_keys import Key
from vidtune.tune.config import searched
from vidtune.tune.config.searched import Param
from vidtune.tune.outputs.results import (
    NO_RESULT,
    SPEED_DECIMALS,
    STATUSES,
    TrialResult,
    ranked,
    summary_metrics,
)
from vidtune.tune.outputs.uncertainty import format_accuracy

# Steady-state other_cpu_cores from which the table marks a trial's speed with "~": half a core
# of other work slows a training on every core by ~5-15 % (bench/cpu_noise.py).
OTHER_LOAD_MARK = 0.5


def shown_params(rows: list[TrialResult]) -> list[Param]:
    """The searched parameters the tables show: those some row has a value of (batch size and lr
    always; weight decay when searched), in `tune.config.searched.PARAMS` order."""
    return [p for p in searched.PARAMS if any(r.value(p.name) is not None for r in rows)
            or p.name in ("batch_size", "lr")]


def format_table(rows: list[TrialResult], *, val_clips: int = 0) -> str:
    """Plain-text table, one line per trial: trial (its name), each searched value (`shown_params`),
    best val_acc (`0.750 [0.58, 0.87]`: the best epoch's accuracy and its 95% interval on `val_clips`
    validation clips; no interval when 0), that epoch, best val_f1 (same epoch), steady clips/s, steady
    seconds per epoch, epochs trained, (the GPUs it trained on, when some trial had one), status.
    `column_notes` says what each column means. After clips/s, `*` marks a trial that shared its
    device with another training and `~` one that trained beside other work on its machine
    (`speed_marks`), with a line saying so under the table: their speed is not the model's alone."""
    show_gpu = any(r.gpu_ids for r in rows)
    params = shown_params(rows)
    head = ["trial"] + [p.column for p in params] + \
        ["best val_acc", "epoch", "best val_f1", "clips/s", "s/epoch", "epochs"] + \
        (["gpu"] if show_gpu else []) + ["status"]
    body = []
    for r in rows:
        body.append([r.label] + [p.cell(r.value(p.name)) for p in params] +
                    [_accuracy_cell(r, val_clips), str(r.best_epoch or "-"), _num(r.val_f1, 3),
                     _num(r.clips_per_s, 1) + speed_marks(r), _num(r.epoch_time_s, 1), str(r.epochs)] +
                    ([r.gpu_ids or "-"] if show_gpu else []) + [r.status])
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        cols = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in cols)

    legend = [text for _, text in marks_used(rows)]
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body] + legend)


def column_notes(rows: list[TrialResult], *, val_clips: int = 0, width: int = 100) -> list[str]:
    """What each column of `format_table` means, said once under the trials table (the statuses
    present only), wrapped to `width`."""
    interval = " [its 95% interval]" if val_clips > 0 else ""
    statuses = ", ".join(f"{s} = {s.meaning}" for s in STATUSES if any(r.status == s for r in rows))
    parts = [f"best val_acc = validation accuracy at the trial's best epoch (column epoch){interval}",
             "best val_f1 = macro F1 at that epoch",
             "clips/s = speed_clips_per_s, training speed in steady state (median of epochs 2 and later)",
             "s/epoch = seconds per training epoch (without validation), steady state",
             "epochs = epochs trained"] + ([f"status: {statuses}"] if statuses else [])
    return textwrap.wrap("; ".join(parts), width=width, initial_indent="columns: ", subsequent_indent="  ",
                         break_on_hyphens=False)


def _accuracy_cell(r: TrialResult, val_clips: int) -> str:
    """`0.750 [0.58, 0.87]` (`tune.outputs.uncertainty.format_accuracy`); `-` for none (an OOM / DIVERGED
    trial's)."""
    return format_accuracy(math.nan if r.status in NO_RESULT else r.val_acc, val_clips)


MARK_LEGEND = (
    ("*", "* shared its device with another training in some epoch: its speed is not its own"),
    ("~", f"~ other processes kept >= {OTHER_LOAD_MARK:g} cores busy on its machine while it trained "
          "(other_cpu_cores): its speed is not the model's alone"),
)


def marks_used(rows: list[TrialResult]) -> list[tuple[str, str]]:
    """The (mark, what it means) of MARK_LEGEND that some row's clips/s carries."""
    marks = "".join(speed_marks(r) for r in rows)
    return [(mark, text) for mark, text in MARK_LEGEND if mark in marks]


def speed_marks(r: TrialResult) -> str:
    """What follows a trial's clips/s in the tables: `*` when it shared its device with another
    training in some epoch (packed trials), `~` when other processes kept at least
    OTHER_LOAD_MARK cores busy on its machine over its steady-state epochs."""
    shared = "*" if math.isfinite(r.concurrent_trainings) and r.concurrent_trainings > 1 else ""
    busy = "~" if math.isfinite(r.other_cpu_cores) and r.other_cpu_cores >= OTHER_LOAD_MARK else ""
    return shared + busy


def format_markdown(rows: list[TrialResult], val_clips: int = 0) -> str:
    """The trials table in markdown (MLflow shows the parent run's description as markdown):
    name, each searched value (`shown_params`), best val_acc (with its 95% interval on
    `val_clips` clips; none when 0), its epoch, best val_f1 (same epoch), steady clips/s, epochs, (GPUs,
    when some trial had one), status; under it, what the marks after clips/s mean (a list, when a
    row carries one)."""
    show_gpu = any(r.gpu_ids for r in rows)
    params = shown_params(rows)
    gpu_head, gpu_rule = (" gpu |", "---|") if show_gpu else ("", "")
    param_head, param_rule = "".join(f" {p.column} |" for p in params), "---:|" * len(params)
    lines = [f"| trial |{param_head} best val_acc | epoch | best val_f1 | clips/s | epochs |{gpu_head}"
             " status |",
             f"|---|{param_rule}---:|---:|---:|---:|---:|{gpu_rule}---|"]
    for r in rows:
        gpu = f" {r.gpu_ids or '-'} |" if show_gpu else ""
        cells = "".join(f" {p.cell(r.value(p.name))} |" for p in params)
        lines.append(f"| {r.label} |{cells} {_accuracy_cell(r, val_clips)} | "
                     f"{r.best_epoch or '-'} | {_num(r.val_f1, 3)} | "
                     f"{_num(r.clips_per_s, 1)}{speed_marks(r)} | {r.epochs} |{gpu} {r.status} |")
    legend = [f"- `{mark}`{text[len(mark):]}" for mark, text in marks_used(rows)]
    return "\n".join(lines + ([""] + legend if legend else []))


def _num(x: float, digits: int) -> str:
    return f"{x:.{digits}f}" if math.isfinite(x) else "-"


# trials.csv's columns around the searched parameters' (one per `tune.config.searched.PARAMS`), in order
# (see the module docstring); gpu_ids follows node_id when some trial had a GPU (`csv_columns`)
CSV_HEAD = ("name", "trial_id", "status")
CSV_RESULTS = tuple(str(c) for c in (   # str: the columns are plain strings, the report keys' names
    Key.BEST_VAL_ACC, Key.BEST_VAL_ACC_LOW, Key.BEST_VAL_ACC_HIGH, Key.BEST_VAL_F1, Key.BEST_EPOCH, "epochs",
    Key.SPEED_CLIPS_PER_S, Key.COMPUTE_CLIPS_PER_S, Key.EPOCH_TIME_S, Key.CONCURRENT_TRAININGS,
    Key.OTHER_CPU_CORES, Key.NODE_ID, "checkpoint"))


def csv_columns(rows: list[TrialResult]) -> tuple[str, ...]:
    """trials.csv's columns: CSV_HEAD, a column per declared parameter, CSV_RESULTS, with gpu_ids
    after node_id when some trial trained on a GPU."""
    results = CSV_RESULTS
    if any(r.gpu_ids for r in rows):
        at = CSV_RESULTS.index(Key.NODE_ID) + 1
        results = CSV_RESULTS[:at] + (Key.GPU_IDS.value,) + CSV_RESULTS[at:]
    return CSV_HEAD + tuple(p.name for p in searched.PARAMS) + results


def _fixed(x: float | None, digits: int) -> str:
    if x is None:
        return ""
    return f"{x:.{digits}f}" if math.isfinite(x) else "nan"


def csv_record(r: TrialResult, val_clips: int = 0,
               fixed: Mapping[str, float] | None = None) -> dict[str, str]:
    """One TrialResult as trials.csv writes it (rounded, `csv_columns`); `val_clips`: the validation
    set's size, for the interval (0: unknown, nan); `fixed`: {parameter: value} every trial trained
    with, for a parameter the search did not search (the row has none)."""
    summary = summary_metrics(r, val_clips)
    fixed = fixed or {}
    return {
        "name": r.label, "trial_id": r.trial_id, "status": r.status,
        **{p.name: p.text(r.value(p.name) if r.value(p.name) is not None else fixed.get(p.name))
           for p in searched.PARAMS},
        **{k.value: _fixed(summary[k], 4)
           for k in (Key.BEST_VAL_ACC, Key.BEST_VAL_ACC_LOW, Key.BEST_VAL_ACC_HIGH)},
        Key.BEST_VAL_F1.value: _fixed(r.val_f1, 4), Key.BEST_EPOCH.value: _fixed(summary[Key.BEST_EPOCH], 0),
        "epochs": str(r.epochs),
        Key.SPEED_CLIPS_PER_S.value: _fixed(summary[Key.SPEED_CLIPS_PER_S], SPEED_DECIMALS),
        Key.COMPUTE_CLIPS_PER_S.value: _fixed(r.compute_clips_per_s, SPEED_DECIMALS),
        Key.EPOCH_TIME_S.value: _fixed(r.epoch_time_s, 2),
        Key.CONCURRENT_TRAININGS.value: significant(r.concurrent_trainings),
        Key.OTHER_CPU_CORES.value: _fixed(r.other_cpu_cores, 2),
        Key.NODE_ID.value: r.node_id or "", Key.GPU_IDS.value: r.gpu_ids, "checkpoint": r.checkpoint or "",
    }


def write_csv(rows: list[TrialResult], path: Path, objective: str = Key.VAL_ACC, val_clips: int = 0,
              fixed: Mapping[str, float] | None = None) -> Path:
    """trials.csv: one row per trial, best first by `objective` (`ranked`), rounded; its columns
    are described in the module docstring. `val_clips`: the validation set's size (0: unknown, no
    interval); `fixed`: {parameter: value} every trial trained with, for those not searched. A
    plain CSV (csv.DictReader, pandas.read_csv)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(csv_columns(rows)), extrasaction="ignore")
        w.writeheader()
        for r in ranked(rows, objective):
            w.writerow(csv_record(r, val_clips, fixed))
    return path
