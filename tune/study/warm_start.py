"""`--warm-start SOURCE`: seed a new search's Optuna study with an earlier search's finished trials.

SOURCE is an earlier search's folder (`<storage>/<name>`, where the search writes trials.csv;
the trials.csv file itself also works), or an Optuna storage URL with the study's name after a
`#` (`sqlite:///optuna.db#rwf-mvit`; the name may be left out when the storage holds one study).
`load_warm_start` returns the trials that lie inside the new search space as Ray's
`OptunaSearch(points_to_evaluate=..., evaluated_rewards=...)` takes them: the searcher adds each
point with its value to the study as a finished trial when it gets its space
(`OptunaSearch._setup_study` -> `add_evaluated_point`), so TPE starts from them and counts them
among its random start trials. Nothing is rerun.

Which trials: DONE and STOPPED (ASHA) trials with a value; out of memory, diverged, errored and
unfinished ones carry no result and are left out, as are those outside the new space (a batch
size not among the new choices, a learning rate or weight decay outside the new bounds). The
value is trials.csv's objective column (`best_val_acc` or `best_val_f1`, formerly `val_acc` or `val_f1`: the
trial's best epoch), or what the Optuna study recorded (Ray tells it each trial's last report).
Single objective only: Ray's `add_evaluated_point` takes one value per trial.
"""
from __future__ import annotations

import csv
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from vidtune.flags import ConfigError
from vidtune.trainer.training.report_keys import Key
from vidtune.tune.config import searched
from vidtune.tune.outputs.status import WITH_RESULT

FLAG = "--warm-start"
SOURCES = ("give an earlier search's folder (<storage>/<name>, holding its trials.csv) or its Optuna "
           "storage and study (sqlite:///optuna.db#study-name)")
# trials.csv's value column per objective, newest name first (tune/outputs/tables.py csv_columns).
VALUE_COLUMNS = {Key.VAL_ACC.value: (Key.BEST_VAL_ACC.value, Key.VAL_ACC.value),
                 Key.VAL_F1.value: (Key.BEST_VAL_F1.value, Key.VAL_F1.value)}
CONSTRAINTS_KEY = "constraints"   # Optuna's system attribute of a trial's constraints (> 0: infeasible)


@dataclass(frozen=True)
class WarmStart:
    """The earlier trials for OptunaSearch, and what was left out ({reason: count})."""

    source: str
    points_to_evaluate: list[dict[str, Any]]
    evaluated_rewards: list[float]
    left_out: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        """One line for the console: how many trials seed the study, how many were left out, why."""
        n = len(self.points_to_evaluate)
        text = f"{FLAG}: {n} finished trial{'s' if n != 1 else ''} of {self.source} seed the study"
        if self.left_out:
            reasons = ", ".join(f"{count} {reason}" for reason, count in self.left_out.items())
            text += f"; {sum(self.left_out.values())} left out ({reasons})"
        return text


def load_warm_start(source: str, space: Any, objective: str, *, own_storage: str | None = None,
                    own_study: str | None = None) -> WarmStart:
    """The earlier search's trials inside `space` (a `tune.config.options.SearchSpace`, its batch sizes
    resolved; see the module docstring), for `objective`
    (val_acc or val_f1). `own_storage` / `own_study`: the new search's --optuna-storage and
    study name, which SOURCE must not be. ConfigError naming --warm-start on any problem."""
    if objective not in VALUE_COLUMNS:
        raise ConfigError(FLAG, f"not with --objective {objective}: an earlier trial seeds the study with "
                          f"one value, so use --objective {' or '.join(VALUE_COLUMNS)}")
    if "://" in source:
        candidates = _from_study(source, objective, own_storage=own_storage, own_study=own_study)
    else:
        candidates = _from_folder(source, objective)
    points, rewards, left_out = [], [], Counter()
    for params, value, no_result in candidates:
        if no_result:
            left_out[f"without a result ({no_result})"] += 1
            continue
        point, outside = _in_space(params, space)
        if point is None:
            left_out[f"outside the new space ({outside})"] += 1
            continue
        points.append(point)
        rewards.append(value)
    if not points:
        why = "; ".join(f"{n} {reason}" for reason, n in left_out.items()) or "it has no trials"
        raise ConfigError(FLAG, f"no usable trial in {source} ({why}); start without {FLAG}, or widen the "
                          "space (--batch-sizes, --lr-min/--lr-max) to include the earlier trials")
    return WarmStart(source, points, rewards, dict(left_out))


Candidate = tuple[dict[str, Any], float, str]   # (params, value, why it has no result or "")


def _from_folder(source: str, objective: str) -> list[Candidate]:
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(FLAG, f"{source} does not exist; {SOURCES}")
    csv_path = path / "trials.csv" if path.is_dir() else path
    if not csv_path.is_file():
        raise ConfigError(FLAG, f"{path} has no trials.csv (a search writes it when it ends; continue an "
                          f"interrupted one with --resume first); {SOURCES}")
    try:
        with open(csv_path, newline="", encoding="utf-8") as f:
            records = list(csv.DictReader(f))
            columns = set(records[0]) if records else set()
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ConfigError(FLAG, f"cannot read {csv_path}: {e}") from None
    value_column = next((c for c in VALUE_COLUMNS[objective] if c in columns), None)
    missing = [c for c in ("status", "batch_size", "lr") if c not in columns]
    if records and (missing or value_column is None):
        missing += [] if value_column else [" or ".join(VALUE_COLUMNS[objective])]
        raise ConfigError(FLAG, f"{csv_path} is not a vidtune trials.csv: no column {', '.join(missing)}")
    candidates = []
    for i, r in enumerate(records, start=2):   # line 1 is the header
        try:
            params = {p.name: p.parse(r[p.name]) for p in searched.PARAMS if r.get(p.name)}
            value = float(r[value_column] or "nan")
        except (TypeError, ValueError) as e:
            raise ConfigError(FLAG, f"cannot read {csv_path} line {i}: {e}") from None
        status = (r["status"] or "").strip()
        no_result = status if status not in WITH_RESULT else ("no value" if not math.isfinite(value) else "")
        candidates.append((params, value, no_result))
    return candidates


def _from_study(source: str, objective: str, *, own_storage: str | None, own_study: str | None
                ) -> list[Candidate]:
    url, _, name = source.partition("#")
    try:
        names = optuna.get_all_study_names(storage=url)
    except Exception as e:   # a bad URL, a missing driver, a file that is not a study database
        raise ConfigError(FLAG, f"cannot open the Optuna storage {url}: {e}") from None
    if not name:
        if len(names) != 1:
            raise ConfigError(FLAG, f"{url} holds {len(names)} studies ({', '.join(names) or 'none'}); name "
                              f"one after a #: {url}#{names[0] if names else 'study-name'}")
        name = names[0]
    if name not in names:
        raise ConfigError(FLAG, f"{url} has no study {name!r} (it has: {', '.join(names) or 'none'})")
    if url == own_storage and name == own_study:
        raise ConfigError(FLAG, f"{source} is the new search's own study (--optuna-storage, --study-name), "
                          "which already holds its trials; pass another --study-name")
    study = optuna.load_study(study_name=name, storage=url)
    if len(study.directions) != 1:
        raise ConfigError(FLAG, f"{source} is a multi-objective study (--objective pareto); seed a "
                          f"--objective {objective} search from a single-objective one")
    candidates = []
    for t in study.get_trials(deepcopy=False):
        infeasible = any(c > 0 for c in t.system_attrs.get(CONSTRAINTS_KEY) or ())
        value = t.value if t.value is not None else math.nan
        no_result = (t.user_attrs.get("failure_reason") or "infeasible") if infeasible else \
            ("" if t.state == optuna.trial.TrialState.COMPLETE and math.isfinite(value) else t.state.name)
        candidates.append((dict(t.params), value, no_result))
    return candidates


def _in_space(params: dict[str, Any], space: Any) -> tuple[dict[str, Any] | None, str]:
    """(the point with the new space's searched keys, "") when `params` lie inside `space`
    (`tune.config.searched.domains`; a range within trials.csv's rounding, clipped in); (None, which
    bound they break) otherwise. A fixed range (min == max) is not searched: the trial must match
    it and the point leaves it out, as Tune's space does."""
    assert space.batch_sizes, "batch sizes are resolved before the searcher is built"
    point: dict[str, Any] = {}
    for name, d in searched.domains(space).items():
        value, words = params.get(name), d.param.words
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return None, f"no {words} (the earlier search did not search it)"
        if not d.contains(value):
            return None, f"{words} {'not in' if d.param.is_choice else 'outside'} {d.where}"
        if not d.fixed:
            point[name] = d.clip(value)
    return point, ""
