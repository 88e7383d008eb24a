"""What a search or a training run gives back to Python: `SearchResult` (`vidtune.search`,
`vidtune.load`) and `TrainResult` (`vidtune.train`), read from the files the run wrote, so a
result is the same whether it was just returned or loaded a week later from its folder.

A search's folder (<storage>/<name>) holds, at its top: trials.csv (one row per trial, best first:
`SearchResult.trials`), best_config.json (the best trial's row and TrainConfig: `best`,
`best_config`, `best_checkpoint`) and search.json (the summary's answer, the MLflow store, the
runs-table link and the registered model: `tune.state.search_record`).
"""
from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import pandas as pd

from vidtune.errors import ConfigError
from vidtune.trainer.training.report_keys import Key
from vidtune.tune.outputs.results import RECORD_NAMES, TrialResult
from vidtune.tune.state import search_record
from vidtune.tune.summary import REMOTE_COPIES

TRIALS_FILE = "trials.csv"
BEST_CONFIG_FILE = "best_config.json"
SHOWN_ROWS = 20     # trials in the notebook view; `.trials` holds them all


@dataclass(frozen=True, repr=False, eq=False)
class SearchResult:
    """A search, finished or interrupted, as it stands in its folder.

    `trials`: one row per trial, best first by the objective: the columns of trials.csv
    (docs/quickstart.md says each). `best`: the best trial (None when no trial has a result).
    `best_config`: the best trial's whole training configuration (TrainConfig's fields, as
    `vidtune.train(config=result)` and `vidtune train --config best_config.json` read it).
    `best_checkpoint`: the folder of the search's best whole checkpoint. `model_uri`: the best
    model in MLflow's registry (`models:/NAME/VERSION`; None when not logged). `mlflow_uri`: the
    tracking store; `mlflow_url`: the runs table in MLflow's UI (`vidtune.ui(result)` starts it).
    `answer`: the summary's first sentences. `interrupted`: stopped before its end; continue it
    with `vidtune.search(..., resume=True)` (same name and storage).
    """

    path: Path
    name: str
    objective: str
    trials: pd.DataFrame
    best: TrialResult | None
    best_config: dict[str, Any] | None
    best_checkpoint: str | None
    model_uri: str | None
    mlflow_uri: str | None
    mlflow_url: str | None
    interrupted: bool
    answer: list[str] = field(default_factory=list)

    @property
    def best_config_file(self) -> Path | None:
        """best_config.json, or None without a best trial."""
        file = self.path / BEST_CONFIG_FILE
        return file if file.is_file() else None

    def __repr__(self) -> str:
        best = (f"best {self.best.label} (batch {self.best.batch_size}, lr {self.best.lr:.3g}), "
                f"val_acc {self.best.val_acc:.3f}" if self.best else "no best trial")
        state = ", interrupted" if self.interrupted else ""
        return f"SearchResult({self.name!r}: {len(self.trials)} trial(s), {best}{state}; {self.path})"

    def _repr_html_(self) -> str:
        """A notebook's view: the answer, the trials table, the links."""
        state = " (interrupted: continue with <code>resume=True</code>)" if self.interrupted else ""
        parts = [f"<p><b>vidtune search {html.escape(self.name)}</b>{state}</p>"]
        answer = self.answer or ([repr(self)] if self.best is None else [])
        parts += [f"<p>{html.escape(line)}</p>" for line in answer]
        shown = self.trials.head(SHOWN_ROWS)
        parts.append(shown.to_html(index=False, na_rep="", float_format=lambda x: f"{x:.4g}", border=0))
        if len(self.trials) > SHOWN_ROWS:
            parts.append(f"<p>({len(self.trials) - SHOWN_ROWS} more in <code>.trials</code>)</p>")
        links = [("folder", str(self.path)), ("best checkpoint", self.best_checkpoint),
                 ("best model", self.model_uri), ("MLflow store", self.mlflow_uri)]
        items = [f"<li>{k}: <code>{html.escape(v)}</code></li>" for k, v in links if v]
        if self.mlflow_url:
            url = html.escape(self.mlflow_url, quote=True)
            items.append(f'<li>compare the trials in MLflow: <a href="{url}" target="_blank">{url}</a> '
                         "(start the UI with <code>vidtune.ui(result)</code>)</li>")
        parts.append(f"<ul>{''.join(items)}</ul>")
        return "\n".join(parts)


@dataclass(frozen=True, repr=False, eq=False)
class TrainResult:
    """One training run (`vidtune.train`): `checkpoint`, the folder of its best whole checkpoint
    (by val_acc, ties to the later epoch), and that `epoch` and `val_acc`; `history`, one row per
    epoch with every key the workers reported (docs/mlflow.md lists them); `path`, the run's folder
    under its storage; `name`, the run's name."""

    name: str
    path: str
    checkpoint: str
    epoch: int
    val_acc: float
    history: pd.DataFrame

    def __repr__(self) -> str:
        return (f"TrainResult({self.name!r}: {len(self.history)} epoch(s), best val_acc {self.val_acc:.3f} "
                f"at epoch {self.epoch}; checkpoint {self.checkpoint})")


def load(path: str | Path) -> SearchResult:
    """The search in folder `path` (<storage>/<name>, as the search printed it), finished or
    interrupted, read from its files. ConfigError naming the path when it holds no search."""
    if "://" in str(path):
        raise ConfigError("path", f"{path}: vidtune.load reads a local folder; a search on remote storage "
                          f"leaves a local copy of its results in {REMOTE_COPIES}/<name> on the machine that "
                          "ran it, and in its MLflow run (open it with vidtune.ui)")
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise ConfigError("path", f"{folder} is not a folder; pass the search's folder, <storage>/<name>, "
                          "as the search printed it (e.g. vidtune-results/vidtune-20261207-101500)")
    table = folder / TRIALS_FILE
    if not table.is_file():
        what = ("it holds a search that has not finished a summary yet (running, or stopped before its "
                "first trial ended); continue it with vidtune.search(..., resume=True)"
                if (folder / "ray").is_dir() else "it is not a search's folder (no trials.csv)")
        raise ConfigError("path", f"{folder}: {what}")
    try:
        record = search_record.read(folder)
        best_doc = _read_json(folder / BEST_CONFIG_FILE)
    except ValueError as e:
        raise ConfigError("path", str(e)) from None
    trials = pd.read_csv(table)
    best = trial_from_record(best_doc) if best_doc else None
    return SearchResult(
        path=folder, name=record.name if record else folder.name,
        objective=(record.objective if record else (best_doc or {}).get("objective", Key.VAL_ACC.value)),
        trials=trials, best=best,
        best_config=(best_doc or {}).get("train_config"),
        best_checkpoint=(best_doc or {}).get("checkpoint"),
        model_uri=record.model_uri if record else None,
        mlflow_uri=record.mlflow_uri if record else None,
        mlflow_url=record.mlflow_url if record else None,
        interrupted=record.interrupted if record else "UNFINISHED" in set(trials.get("status", [])),
        answer=record.answer if record else [])


def trial_from_record(doc: dict[str, Any]) -> TrialResult:
    """The TrialResult that best_config.json was written from (`tune.outputs.results.named_record`: the
    summary numbers under their summary names)."""
    back = {summary: name for name, summary in RECORD_NAMES.items()}
    known = {f.name for f in fields(TrialResult)}
    values = {back.get(k, k): v for k, v in doc.items()}
    values = {k: (math.nan if v is None and k not in ("checkpoint", Key.NODE_ID) else v)
              for k, v in values.items() if k in known}
    return TrialResult(**values)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e}); the search's resume=True writes it again") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} is not a best_config.json (not an object)")
    return doc
