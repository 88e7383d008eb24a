"""The end of a search: one row per trial, the best trial, the Pareto front (accuracy vs clips/s),
and the rows ranked by the search's objective (the tables and trials.csv of these rows:
`tune.outputs.tables`; their plots: `tune.outputs.plots`).

A row's val_acc and val_f1 are those of the trial's best epoch by the search's objective
(`objective_key`: val_acc or val_f1; pareto: val_acc; ties: the later epoch), the epoch whose
checkpoint Ray Train keeps as the best; its speeds are steady-state (per trial, not per epoch).

One number per trial everywhere: `summary_metrics` gives a row's SUMMARY_KEYS (its best epoch's
accuracy and that epoch, its steady speed, the accuracy's 95% interval), the values trials.csv,
the tables, the plots and each MLflow child run show under the same names.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray.train
from ray.tune import Result
from ray.tune.experiment import Trial

from vidtune.trainer.training.checkpointing import first_whole
from vidtune.trainer.training.history import best_epoch, latest_history
from vidtune.trainer.training.metrics import steady_state
from vidtune.trainer.training.report_keys import Key, number
from vidtune.tune.config import searched
from vidtune.tune.config.options import OBJECTIVES
from vidtune.tune.outputs.status import Status
from vidtune.tune.outputs.uncertainty import accuracy_interval
from vidtune.tune.running.faults import trial_unfinished

# What each status means: DONE ran all epochs; STOPPED was stopped early by ASHA; OOM ran out
# of memory (infeasible); DIVERGED had its training loss become inf or NaN (infeasible: the lr
# is too high for it); ERROR raised; UNFINISHED was interrupted (continue with --resume).
STATUSES = tuple(Status)
# The statuses whose last report stands for the trial: no accuracy, no speed, never ranked.
NO_RESULT = (Status.OOM, Status.DIVERGED)


@dataclass(frozen=True)
class TrialResult:
    trial_id: str
    batch_size: int
    lr: float
    val_acc: float          # at the best epoch (nan when none; OOM, DIVERGED: its report's)
    val_f1: float           # at the same epoch
    clips_per_s: float      # steady state: median over epochs 2.. (epoch 1 alone when only it ran)
    epoch_time_s: float     # steady state, like clips_per_s
    epochs: int             # epochs trained (the last epoch reported)
    status: str             # one of STATUSES
    checkpoint: str | None  # the trial's best whole checkpoint by the objective (best_checkpoint)
    node_id: str | None = None
    compute_clips_per_s: float = math.nan   # steady state of clips / time not waiting for data
    concurrent_trainings: float = math.nan  # most trainings on its device at once, any epoch (1 = alone)
    other_cpu_cores: float = math.nan       # steady state of the cores other processes kept busy beside it
    name: str = ""          # short readable name (e.g. t03-bs8-lr2.5e-4); "" reads as the trial_id
    # The best epoch by the objective's metric (`objective_key`: val_acc, val_f1; pareto: val_acc):
    # val_acc, val_f1 and the checkpoint are its (0: none)
    best_epoch: int = 0
    gpu_ids: str = ""       # physical ids of the GPUs it trained on ("0", "2,3"); "" on the CPU
    # The epoch and val_acc of `checkpoint`: best_epoch's, unless that checkpoint is damaged or gone
    checkpoint_epoch: int = 0
    checkpoint_val_acc: float = math.nan
    checkpoint_score: float = math.nan   # the objective's metric at checkpoint_epoch (what ranks it)
    # every searched value of its config by parameter name (`tune.config.searched.values_of`)
    params: Mapping[str, float] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The name shown in the table and plots: `name`, else the trial id."""
        return self.name or self.trial_id

    def value(self, name: str) -> float | None:
        """The trial's value of the searched parameter `name`; None when it has none. Batch size
        and lr, which every trial trains with, are also read from their fields."""
        if name in self.params:
            return self.params[name]
        return {"batch_size": self.batch_size, "lr": self.lr}.get(name)


def trial_status(last: dict[str, Any], *, epochs: int, error: bool = False, finished: bool = True) -> str:
    """One of STATUSES from a trial's last report: the one rule the table and MLflow share.
    `error`: the trial raised; `finished`: Tune ended it (False: the search was interrupted)."""
    if error:
        return "ERROR"
    if int(last.get(Key.OOM, 0) or 0) == 1:
        return "OOM"
    if int(last.get(Key.DIVERGED, 0) or 0) == 1:
        return "DIVERGED"
    if not finished:
        return "UNFINISHED"
    if int(last.get(Key.EPOCH) or 0) < epochs:
        return "STOPPED"
    return "DONE"


def completed_trial_status(trial: Trial, *, epochs: int) -> str:
    """`trial_status` of a trial Tune has just completed (a live Tune `Trial`, as its callbacks
    get it). Tune ends the trials it stops on Ctrl-C / SIGTERM as it ends finished ones; those
    are UNFINISHED (`tune.running.faults` remembers them), not done or stopped early."""
    return trial_status(trial.last_result or {}, epochs=epochs, finished=not trial_unfinished(trial.trial_id))


def _epoch_of(x: Any) -> int:
    e = number(x)
    return int(e) if math.isfinite(e) else 0


def row_from_result(result: Result, *, trial_id: str, epochs: int, finished: bool,
                    train_run: str | None = None, name: str | None = None,
                    metric: str = Key.VAL_ACC) -> TrialResult:
    """One Tune `Result` -> TrialResult. `finished`: Tune ended the trial (not interrupted).
    `train_run`: the folder of the trial's Ray Train run (its checkpoints). `name`: the trial's
    short readable name (default: the trial id). `metric`: what picks the best epoch, the
    search's `objective_key`.

    val_acc and val_f1 are those of the best epoch by `metric` (ties: the later epoch), the
    epoch of Ray Train's best checkpoint; an out-of-memory or diverged trial keeps its last
    report's (no accuracy). `epochs`: the latest epoch any report reached (Tune's per-epoch
    records, as MLflow logs them), also for a trial that failed after its last report."""
    m = dict(result.metrics or {})
    cfg = dict(result.config or {})
    # a trial stopped unfinished (Ctrl-C, a full disk: tune/running/disk_full.py) is continued, not failed
    status = trial_status(m, epochs=epochs, error=result.error is not None and finished, finished=finished)
    records = epoch_records(result, train_run)
    speed = steady_speeds(result, records)
    val_acc, val_f1, best_epoch = number(m.get(Key.VAL_ACC)), number(m.get(Key.VAL_F1)), 0
    if status not in NO_RESULT:
        best = best_epoch_record(result, records, metric)
        if best is not None:
            best_epoch, record = best
            val_acc, val_f1 = number(record.get(Key.VAL_ACC)), number(record.get(Key.VAL_F1))
    checkpoint, checkpoint_epoch, checkpoint_val_acc = best_checkpoint(train_run, result, name or trial_id,
                                                                       metric=metric)
    checkpoint_score = number(records.get(checkpoint_epoch, {}).get(metric))
    return TrialResult(
        trial_id=trial_id,
        batch_size=int(cfg.get("batch_size", m.get(Key.BATCH_SIZE, 0)) or 0),
        lr=number(cfg.get("lr", m.get(Key.LR))),
        params=searched.values_of(cfg),
        val_acc=val_acc, val_f1=val_f1,
        clips_per_s=speed[Key.CLIPS_PER_S], epoch_time_s=speed[Key.EPOCH_TIME_S],
        epochs=max(records, default=0), status=status,
        checkpoint=checkpoint, checkpoint_epoch=checkpoint_epoch, checkpoint_val_acc=checkpoint_val_acc,
        checkpoint_score=checkpoint_score,
        node_id=m.get(Key.NODE_ID), compute_clips_per_s=speed[Key.COMPUTE_CLIPS_PER_S],
        concurrent_trainings=speed[Key.CONCURRENT_TRAININGS], name=name or trial_id, best_epoch=best_epoch,
        other_cpu_cores=speed[Key.OTHER_CPU_CORES], gpu_ids=_text(m.get(Key.GPU_IDS)),
    )


def _text(x: Any) -> str:
    """A string metric as reported; "" for a missing one (NaN in a dataframe)."""
    return x if isinstance(x, str) else ""


def epoch_records(result: Result, train_run: str | None = None) -> dict[int, dict[str, Any]]:
    """{epoch: that epoch's report} of every epoch the trial trained, across interruptions.

    Two sources, one per kind of loss:
    - the trial's own record, `epochs.json` in its latest checkpoint (`trainer.training.history`, read
      from the Train run folder `train_run`): carried over from checkpoint to checkpoint when a
      trial resumes, so it holds the epochs from before an interruption, which Tune's results
      for the trial no longer do (after `--resume`, Tune restarts them at iteration 1);
    - what Tune recorded (`metrics_dataframe`, one row per report; a resumed trial re-reports an
      epoch: the later report wins), plus the last result (filling in what the dataframe lacks
      for its epoch): the epochs reported since the last checkpoint, and every key of a report.
    Tune's report of an epoch wins over the record's (the same epoch, with more keys); the
    record is the authority for the epochs Tune lost, since it is written with the checkpoint
    whose weights the next epoch continues from."""
    out: dict[int, dict[str, Any]] = {}
    df = getattr(result, "metrics_dataframe", None)
    if df is not None and Key.EPOCH in getattr(df, "columns", ()):
        for record in df.to_dict("records"):
            epoch = _epoch_of(record.get(Key.EPOCH))
            if epoch >= 1:
                out[epoch] = record
    m = dict(getattr(result, "metrics", None) or {})
    last = _epoch_of(m.get(Key.EPOCH))
    if last >= 1:
        out[last] = {**m, **out.get(last, {})}
    return {**(latest_history(train_run) if train_run else {}), **out}


def best_epoch_record(result: Result, records: dict[int, dict[str, Any]] | None = None,
                      metric: str = Key.VAL_ACC) -> tuple[int, dict[str, Any]] | None:
    """(epoch, report) of the trial's best epoch (`trainer.training.history.best_epoch`: by `metric`, ties
    to the later epoch, among the epochs that trained); None when no epoch has one.
    `records`: `epoch_records(result, train_run)` where already read."""
    return best_epoch(records if records is not None else epoch_records(result), metric)


SPEED_KEYS = (Key.CLIPS_PER_S.value, Key.COMPUTE_CLIPS_PER_S.value, Key.EPOCH_TIME_S.value)


def steady_speeds(result: Result, records: dict[int, dict[str, Any]] | None = None) -> dict[str, float]:
    """A trial's steady-state speed (`trainer.training.metrics.steady_state` of each of SPEED_KEYS over
    its reported epochs, and of other_cpu_cores: what ran beside those epochs) and the most
    trainings that shared its device in any epoch.

    Read from every epoch the trial trained (`records`: `epoch_records(result, train_run)`;
    default: Tune's alone). An out-of-memory or diverged trial reports 0 clips/s: it has no
    speed (NaN)."""
    m = dict(result.metrics or {})
    if int(m.get(Key.OOM, 0) or 0) == 1 or int(m.get(Key.DIVERGED, 0) or 0) == 1:
        return {**{k: math.nan for k in SPEED_KEYS},
                Key.CONCURRENT_TRAININGS.value: number(m.get(Key.CONCURRENT_TRAININGS)),
                Key.OTHER_CPU_CORES.value: math.nan}
    records = records if records is not None else epoch_records(result)
    by_epoch = {k: {e: number(rec[k]) for e, rec in records.items() if k in rec}
                for k in (*SPEED_KEYS, Key.OTHER_CPU_CORES.value, Key.CONCURRENT_TRAININGS.value)}
    shared = [v for v in by_epoch[Key.CONCURRENT_TRAININGS].values() if math.isfinite(v)]
    return {**{k: steady_state(by_epoch[k]) for k in (*SPEED_KEYS, Key.OTHER_CPU_CORES.value)},
            Key.CONCURRENT_TRAININGS.value: max(shared) if shared else math.nan}


def best_checkpoint(train_run: str | None, result: Result, name: str = "", *,
                    metric: str = Key.VAL_ACC) -> tuple[str | None, int, float]:
    """(path, epoch, val_acc) of the trial's best whole checkpoint by `metric`: the best of the
    checkpoints its Ray Train run kept (`ray.train.Result.from_path(train_run).best_checkpoints`)
    that `checkpoint_problem` finds whole, else the next best (ties: the later epoch). Without a
    readable run folder (none given, or gone), the last checkpoint the trial reported, if it still
    exists and is whole. (None, 0, nan) when none is; a damaged one skipped is said in one line
    (`name`: the trial's). Remote (s3://) checkpoints are not downloaded to be checked."""
    candidates: list[tuple[str, dict[str, Any]]] = []
    if train_run:
        quiet = logging.getLogger("ray.train")   # from_path logs a paragraph per run read at INFO
        level = quiet.level
        quiet.setLevel(logging.WARNING)
        try:
            run = ray.train.Result.from_path(train_run)
            # Later epochs first, so that the stable sort keeps the later of equal scores.
            by_epoch = sorted(run.best_checkpoints or [], key=lambda cm: number(cm[1].get(Key.EPOCH)),
                              reverse=True)
            ranked = sorted(by_epoch, key=lambda cm: _sort_score(cm[1], metric), reverse=True)
            candidates = [(c.path, m) for c, m in ranked]
        except (RuntimeError, OSError, ValueError):
            pass   # an interrupted run may have no checkpoint manager snapshot yet
        finally:
            quiet.setLevel(level)
    if not candidates:
        last = dict(result.metrics or {})
        path = last.get("checkpoint_path")
        if path and ("://" in path or Path(path).exists()):
            candidates = [(path, last)]
    found = _first_whole([path for path, _ in candidates], name)
    if found is None:
        return None, 0, math.nan
    metrics = next(m for path, m in candidates if path == found)
    return found, _epoch_of(metrics.get(Key.EPOCH)), number(metrics.get(Key.VAL_ACC))


def best_whole_checkpoint(rows: list[TrialResult], best: TrialResult | None) -> TrialResult | None:
    """The row whose checkpoint is the search's best whole one: the best trial's, when it is of
    its best epoch (the table's answer); else, since that one is damaged or gone, the whole
    checkpoint of highest score (`checkpoint_score`, the objective's metric) among all trials
    (ties: the best trial, then the earlier row),
    so that another trial's checkpoint as good as the answer is not passed over for a worse
    epoch of the best trial. None when no trial has a whole checkpoint."""
    if best is not None and best.checkpoint and best.checkpoint_epoch == best.best_epoch:
        return best
    kept = [r for r in rows if r.checkpoint]
    if not kept:
        return None
    return max(kept, key=lambda r: (_sort_score({"score": r.checkpoint_score}, "score"), r is best,
                                    -kept.index(r)))


def _sort_score(metrics: dict[str, Any], metric: str) -> float:
    value = number(metrics.get(metric))
    return value if math.isfinite(value) else -math.inf


def _first_whole(paths: list[str], name: str) -> str | None:
    """`trainer.training.checkpointing.first_whole` of `paths`, with a line for each damaged one skipped
    and for none left."""
    found, skipped = first_whole(paths)
    who = f"{name}: " if name else ""
    for i, why in enumerate(skipped):
        after = ("the next best instead" if found or i + 1 < len(skipped)
                 else "no whole checkpoint is left; none named best")
        print(f"{who}{why}; {after}", flush=True)
    return found


# What a trial's summary is computed from, kept per epoch while it runs (`live_row`)
SUMMARY_INPUTS = tuple(k.value for k in (Key.VAL_ACC, Key.VAL_F1, Key.CLIPS_PER_S, Key.EPOCH_TIME_S, Key.OOM,
                                          Key.DIVERGED))


def live_row(trial_id: str, config: dict[str, Any], records: dict[int, dict[str, Any]],
             status: str, metric: str = Key.VAL_ACC) -> TrialResult:
    """A trial's row from the epochs seen while it ran (epoch -> its report's SUMMARY_INPUTS;
    `tune.tracking.tracker` keeps them), by the rules of `row_from_result`: the best epoch by
    `metric` (ties: the later) among those that trained, the steady-state speeds
    (`trainer.training.metrics.steady_state`), none of either for out of memory or diverged (`status` in
    NO_RESULT). No checkpoint: the final row (`row_from_result`) has it."""
    trained = {e: r for e, r in records.items() if status not in NO_RESULT
               and not (number(r.get(Key.OOM)) == 1 or number(r.get(Key.DIVERGED)) == 1)}
    best_at, best = best_epoch(trained, metric) or (0, {})

    def steady(key: str) -> float:
        return steady_state({e: number(r.get(key)) for e, r in trained.items()})

    return TrialResult(trial_id=trial_id, batch_size=int(config.get("batch_size") or 0),
                    lr=number(config.get("lr")), params=searched.values_of(config),
                    val_acc=number(best.get(Key.VAL_ACC)), val_f1=number(best.get(Key.VAL_F1)),
                    clips_per_s=steady(Key.CLIPS_PER_S), epoch_time_s=steady(Key.EPOCH_TIME_S),
                    epochs=max(records, default=0), status=status, checkpoint=None, best_epoch=best_at)


def usable(rows: Iterable[TrialResult]) -> list[TrialResult]:
    """Trials with results worth ranking (not OOM, not diverged, not errored, with a finite
    accuracy)."""
    return [r for r in rows if r.status in ("DONE", "STOPPED", "UNFINISHED") and math.isfinite(r.val_acc)]


def objective_key(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, not {objective!r}")
    return Key.VAL_ACC.value if objective == "pareto" else objective


def _speed_rank(r: TrialResult) -> float:
    return r.clips_per_s if math.isfinite(r.clips_per_s) else -1.0


def best_trial(rows: list[TrialResult], objective: str) -> TrialResult | None:
    """Highest objective (at each trial's best epoch by it) among usable trials; pareto: the
    most accurate trial on the front. Ties go to the faster trial (clips/s)."""
    key = objective_key(objective)
    pool = pareto_front(rows) if objective == "pareto" else usable(rows)
    pool = [r for r in pool if math.isfinite(getattr(r, key))]
    if not pool:
        return None
    return max(pool, key=lambda r: (getattr(r, key), _speed_rank(r)))


def pareto_front(rows: list[TrialResult]) -> list[TrialResult]:
    """Trials no other trial beats on both val_acc and clips_per_s (both maximised), by accuracy."""
    pool = [r for r in usable(rows) if math.isfinite(r.clips_per_s)]

    def dominated(a: TrialResult) -> bool:
        return any(b.val_acc >= a.val_acc and b.clips_per_s >= a.clips_per_s and
                   (b.val_acc > a.val_acc or b.clips_per_s > a.clips_per_s) for b in pool)

    return sorted((r for r in pool if not dominated(r)), key=lambda r: (-r.val_acc, -r.clips_per_s))


# A trial's summary, under the same names in trials.csv, the tables and each MLflow child run:
# the best epoch's val_acc, that epoch, the steady clips/s, the accuracy's 95% interval. The names
# are trainer.training.report_keys' summary keys (plain strings here).
SPEED_METRIC = Key.SPEED_CLIPS_PER_S.value   # the one name speed has wherever a person reads it
# Decimals a speed (clips/s) is kept to wherever it is written: trials.csv, MLflow, Optuna. Epochs
# of one trial differ by far more than 0.01 clips/s, so 46.83094586854091 says no more than 46.83.
SPEED_DECIMALS = 2
SUMMARY_KEYS = tuple(k.value for k in (Key.BEST_VAL_ACC, Key.BEST_EPOCH, Key.SPEED_CLIPS_PER_S,
                                       Key.BEST_VAL_ACC_LOW, Key.BEST_VAL_ACC_HIGH))


# TrialResult's fields that are summary numbers, under their summary names: best_config.json writes a
# row with these (`named_record`), as trials.csv and MLflow name them
RECORD_NAMES = {Key.VAL_ACC.value: Key.BEST_VAL_ACC.value, Key.VAL_F1.value: Key.BEST_VAL_F1.value,
                Key.CLIPS_PER_S.value: SPEED_METRIC}


def named_record(row: TrialResult) -> dict[str, Any]:
    """A row's fields as a dict, the summary numbers under their summary names (RECORD_NAMES)."""
    return {RECORD_NAMES.get(k, k): v for k, v in vars(row).items()}


def summary_metrics(row: TrialResult, val_clips: int) -> dict[str, float]:
    """A trial's SUMMARY_KEYS: its best epoch's val_acc, that epoch, its steady clips/s (to
    SPEED_DECIMALS) and the 95% Wilson interval of the accuracy on `val_clips` validation clips;
    nan where there is none (no accuracy, no epoch, no speed, or val_clips 0: no interval)."""
    acc = math.nan if row.status in NO_RESULT else row.val_acc   # an OOM / DIVERGED report's 0 is no accuracy
    low, high = accuracy_interval(acc, val_clips)
    return {Key.BEST_VAL_ACC.value: acc,
            Key.BEST_EPOCH.value: float(row.best_epoch) if row.best_epoch else math.nan,
            Key.SPEED_CLIPS_PER_S.value: rounded_speed(row.clips_per_s), Key.BEST_VAL_ACC_LOW.value: low,
            Key.BEST_VAL_ACC_HIGH.value: high}


def ranked(rows: list[TrialResult], objective: str = Key.VAL_ACC) -> list[TrialResult]:
    """Rows best first by `objective` (val_acc or val_f1 descending; pareto: by val_acc), ties to
    the faster trial; then the unusable ones (OOM, DIVERGED, ERROR, no value) in the order given."""
    key = objective_key(objective)
    ranked_rows = [r for r in usable(rows) if math.isfinite(getattr(r, key))]
    ranked_ids = {id(r) for r in ranked_rows}
    return sorted(ranked_rows, key=lambda r: (-getattr(r, key), -_speed_rank(r))) + \
        [r for r in rows if id(r) not in ranked_ids]


def rounded_speed(clips_per_s: float) -> float:
    """A speed as it is written (trials.csv, MLflow, Optuna): SPEED_DECIMALS decimals; nan as is."""
    return round(clips_per_s, SPEED_DECIMALS) if math.isfinite(clips_per_s) else clips_per_s
