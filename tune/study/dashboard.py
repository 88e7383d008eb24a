"""The search's Optuna study as optuna-dashboard shows it: where it is kept by default (beside the
MLflow store), what each Optuna trial carries as user attributes (its vidtune name, outcome,
speed, accuracy with its 95% interval, MLflow run id), the objective's names, and the command that
opens it.

`tune.study.space.VidtuneOptunaSearch` writes the attributes from a trial's last result
(`trial_attrs`); the MLflow run id reaches that result through the tracker, which adds it under
MLFLOW_RUN_KEY (Tune lets a callback add to a result in place: `Callback.on_trial_result`).

optuna-dashboard numbers trials from 0 and cannot rename them, so the names go into its notes
(`optuna_dashboard.save_note`, Markdown shown at the top of a page): each trial's note opens with
its vidtune name (`save_trial_note`), and the study's note, written when the search ends
(`save_study_note`), holds the search's answer, its MLflow links and the table from Optuna's
trial numbers to the vidtune names and MLflow runs.
"""
from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import optuna

try:   # optional (`vidtune[dashboard]`): without it no note is written, and none would be shown
    import optuna_dashboard
except ImportError:
    optuna_dashboard = None

from vidtune.trainer.training.report_keys import Key, number
from vidtune.tune.outputs.results import rounded_speed, trial_status
from vidtune.tune.outputs.status import Status
from vidtune.tune.outputs.uncertainty import accuracy_interval, format_interval
from vidtune.tune.running.trial import short_name
from vidtune.tune.tracking.schema import MLFLOW_RUN_KEY, OUTCOMES
from vidtune.tune.tracking.store import sqlite_path

STUDY_FILE = "optuna.db"          # the study's SQLite file, beside mlruns.db by default
NAME_ATTR, STATUS_ATTR = "vidtune_trial", "status"
RUNNING = "running"               # STATUS_ATTR until the trial ends
DASHBOARD_EXTRA = "pip install 'vidtune[dashboard]'"


def default_storage(tracking_uri: str, storage: str | None) -> str | None:
    """Where a search keeps its Optuna study when --optuna-storage is not given: STUDY_FILE beside
    a `sqlite:///` MLflow store's file, else in the search's local --storage folder; None (in
    memory) when both are remote (a tracking server and s3://...)."""
    db = sqlite_path(tracking_uri)
    if db is not None:
        return f"sqlite:///{db.parent / STUDY_FILE}"
    if storage and "://" not in storage:
        return f"sqlite:///{Path(storage).expanduser().resolve() / STUDY_FILE}"
    return None


def metric_names(metric: str | list[str]) -> list[str]:
    """The study's objective names (`Study.set_metric_names`), one per value Optuna is told:
    `val_acc`, `val_f1`, or pareto's accuracy and steady-state speed."""
    return list(metric) if isinstance(metric, (list, tuple)) else [metric]


def trial_name(trial_id: str, result: dict[str, Any] | None) -> str:
    """The trial's vidtune name (`tune.running.trial.short_name`: `t03-bs8-lr2.5e-4`) from a flattened
    Tune result, which carries Tune's experiment tag and the config as `config/<key>`; the Tune
    id when there is no result."""
    result = result or {}
    config = {k.split("/", 1)[1]: v for k, v in result.items() if k.startswith("config/")}
    config = config or dict(result.get("config") or {})
    trial = SimpleNamespace(trial_id=trial_id, experiment_tag=result.get("experiment_tag", ""), config=config)
    return short_name(trial)


def trial_attrs(trial_id: str, result: dict[str, Any] | None, *, epochs: int, val_clips: int,
                error: bool = False, finished: bool = True, best: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """The user attributes of a finished trial's Optuna trial: NAME_ATTR, STATUS_ATTR (the outcome
    as MLflow's `vidtune.outcome` words it: done, stopped early, out of memory, diverged, failed,
    interrupted), `val_acc` and its 95% interval (`val_acc_95ci`, on `val_clips` clips) at the
    best epoch (`best`: that epoch's report; else the last), `speed_clips_per_s` (steady state)
    and MLFLOW_RUN_KEY, each when known. `result`: the trial's last (flattened) Tune result."""
    last = result or {}
    # a result without an epoch (no report of the trainer) says nothing of a stop
    status = trial_status(last, epochs=epochs if last.get(Key.EPOCH) is not None else 0, error=error,
                          finished=finished)
    attrs: dict[str, Any] = {NAME_ATTR: trial_name(trial_id, result),
                             STATUS_ATTR: OUTCOMES.get(status, status)}
    acc = number((best or last).get(Key.VAL_ACC))
    if math.isfinite(acc) and status not in ("OOM", "ERROR"):
        attrs[Key.VAL_ACC.value] = round(acc, 4)
        interval = format_interval(*accuracy_interval(acc, val_clips))
        if interval:
            attrs["val_acc_95ci"] = interval
    speed = number(last.get(Key.STEADY_CLIPS_PER_S))
    if math.isfinite(speed) and speed > 0:
        attrs[Key.SPEED_CLIPS_PER_S.value] = rounded_speed(speed)   # as trials.csv and MLflow
    if isinstance(last.get(MLFLOW_RUN_KEY), str):
        attrs[MLFLOW_RUN_KEY] = last[MLFLOW_RUN_KEY]
    return attrs


def pruned(attrs: dict[str, Any]) -> bool:
    """The trial was stopped early by ASHA: Optuna's PRUNED, not COMPLETE."""
    return attrs.get(STATUS_ATTR) == Status.STOPPED.word


def dashboard_command() -> str:
    """optuna-dashboard by the path it is installed at beside this interpreter (it runs as
    printed without an activated environment), else by name."""
    beside = Path(sys.executable).parent / "optuna-dashboard"
    if beside.is_file():
        return str(beside)
    return shutil.which("optuna-dashboard") or "optuna-dashboard"


def dashboard_line(storage: str | None, study_name: str) -> str:
    """The summary's line opening the study in optuna-dashboard (with how to install it when it
    is not), or "" when `storage` holds no study `study_name` (in memory, or a study stored
    elsewhere by an older search)."""
    if not storage:
        return ""
    try:
        if study_name not in optuna.get_all_study_names(storage=storage):
            return ""
    except Exception:   # a database that cannot be read now: the search's own results stand
        return ""
    command = dashboard_command()
    missing = "" if Path(command).is_file() else f" (install it: {DASHBOARD_EXTRA})"
    return (f"the Optuna study {study_name!r} in optuna-dashboard: {command} {storage} --host 127.0.0.1 "
            f"--port 8080{missing}")


def trial_note(attrs: dict[str, Any]) -> str:
    """A trial's note in optuna-dashboard from its user attributes (`trial_attrs`): its vidtune
    name as the heading, then its outcome, accuracy, speed and MLflow run, each when known."""
    facts = [str(attrs.get(STATUS_ATTR, RUNNING))]
    if Key.VAL_ACC.value in attrs:
        facts.append(f"best val_acc {attrs[Key.VAL_ACC.value]:.3f} {attrs.get('val_acc_95ci', '')}".rstrip())
    if Key.SPEED_CLIPS_PER_S.value in attrs:
        facts.append(f"{attrs[Key.SPEED_CLIPS_PER_S.value]} clips/s")
    if MLFLOW_RUN_KEY in attrs:
        facts.append(f"MLflow run `{attrs[MLFLOW_RUN_KEY]}`")
    return f"## {attrs.get(NAME_ATTR, '')}\n\n" + "; ".join(facts) + "\n"


def save_trial_note(ot_trial: optuna.Trial, attrs: dict[str, Any]) -> None:
    """Write `trial_note` as the trial's optuna-dashboard note (nothing without optuna-dashboard)."""
    if optuna_dashboard is not None:
        optuna_dashboard.save_note(ot_trial, trial_note(attrs))


def study_note(name: str, trials: list[optuna.trial.FrozenTrial], *, answer: list[str], links: str) -> str:
    """The study's note: the search's answer, its MLflow links (`links`: the console's lines, each
    `what: where`) and a row per trial from Optuna's number to its vidtune name, outcome,
    accuracy, speed and MLflow run id (from each trial's user attributes)."""
    lines = [f"## vidtune search {name}", "", *answer, ""]
    for line in filter(None, (x.strip() for x in links.splitlines())):
        what, _, where = line.rpartition(": ")
        lines.append(f"- {what}: <{where}>" if where.startswith("http") else f"- {line}")
    lines += ["", "| Optuna trial | vidtune trial | outcome | best val_acc | clips/s | MLflow run |",
              "|---|---|---|---|---|---|"]
    for t in sorted(trials, key=lambda t: t.number):
        a = t.user_attrs
        run = f"`{a[MLFLOW_RUN_KEY]}`" if MLFLOW_RUN_KEY in a else ""
        acc = a.get(Key.VAL_ACC.value)
        cells = [a.get(NAME_ATTR, ""), a.get(STATUS_ATTR, ""), f"{acc:.3f}" if acc is not None else "",
                 a.get(Key.SPEED_CLIPS_PER_S.value, ""), run]
        lines.append(f"| {t.number} | " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def save_study_note(storage: str | None, study_name: str, *, answer: list[str], links: str) -> bool:
    """Write `study_note` as the study's optuna-dashboard note; False when it could not be (no
    optuna-dashboard, no stored study, a database that cannot be written now: the search's own
    results stand)."""
    if optuna_dashboard is None or not storage:
        return False
    try:
        ot_study = optuna.load_study(study_name=study_name, storage=storage)
        optuna_dashboard.save_note(ot_study, study_note(study_name, ot_study.get_trials(deepcopy=False),
                                                        answer=answer, links=links))
    except Exception:   # the note is a convenience; the study, MLflow and trials.csv hold the results
        return False
    return True
