"""The search's outcome as data: `search.json` at the top of its folder, written when the search
ends (finished, stopped early by the time budget, or interrupted), beside trials.csv and
best_config.json (on remote storage, beside their local copy: `tune.summary.results_folder`). It
holds what those files do not: the sentences the summary answered with,
whether the search was interrupted, its exit code, the MLflow store, the runs-table link and the
best model's URI. `vidtune.load` reads it back (with trials.csv and best_config.json) into a
`vidtune.SearchResult`, after the process that ran the search is gone.

Bookkeeping: a search whose record cannot be written (a full disk) loses nothing else, and says
so in one line.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vidtune.atomic import write_atomically
from vidtune.servers import absolute_store

RECORD_FILE = "search.json"
FORMAT = 1


@dataclass(frozen=True)
class SearchRecord:
    """What `search.json` holds (`FORMAT` 1)."""

    name: str                       # the search's --name
    path: str                       # its folder, <storage>/<name>
    objective: str                  # val_acc, val_f1 or pareto
    exit_code: int                  # the command's: 0 with a best trial, 1 without, 130 interrupted
    interrupted: bool               # Ctrl-C / SIGTERM / unfinished trials: continue with --resume
    mlflow_uri: str                 # the tracking store (a sqlite:/// path made absolute)
    mlflow_url: str | None = None   # the runs table in MLflow's UI; None when MLflow was not reached
    model_uri: str | None = None    # the best model (models:/NAME/VERSION); None when not logged
    answer: list[str] = field(default_factory=list)   # the summary's first sentences
    format: int = FORMAT
    mlflow_pending: str | None = None   # why MLflow is not up to date (a --resume writes it); None: it is


def record_path(folder: str | Path) -> Path:
    return Path(folder) / RECORD_FILE


def write(folder: Path | None, record: SearchRecord) -> Path | None:
    """Write `record` into `folder`, where the search's results files went (its own folder, or
    `tune.summary.results_folder`'s local copy for remote storage), whole or not at all; None (and
    one line on stderr) when it cannot be written, or `folder` is None."""
    if folder is None:
        return None
    try:
        return write_atomically(record_path(folder), json.dumps(asdict(record), indent=1) + "\n")
    except OSError as e:
        print(f"vidtune: could not write {record_path(folder)} ({e.strerror or e}); `vidtune.load` will "
              "read the search from trials.csv and best_config.json alone", file=sys.stderr)
        return None


def make(*, name: str, path: str, objective: str, exit_code: int, interrupted: bool, tracking_uri: str,
         tracker: Any, model_uri: str | None, answer: list[str], pending: str | None = None) -> SearchRecord:
    """The record of a search that just ended; `tracker`: its MLflow writer, whose runs-table link
    is kept when the store was reached (`experiment_id` known); `pending`: why MLflow is not up to
    date (the tracker's `record_summary`), None when it is."""
    url = None
    if getattr(tracker, "experiment_id", None):
        try:
            url = tracker.runs_table_url()
        except Exception:    # a link is a convenience: the record stands without it
            url = None
    return SearchRecord(name=name, path=path, objective=objective, exit_code=exit_code,
                        interrupted=interrupted, mlflow_uri=absolute_store(tracking_uri), mlflow_url=url,
                        model_uri=model_uri, answer=list(answer), mlflow_pending=pending)


def read(folder: str | Path) -> SearchRecord | None:
    """The record in `folder`, or None when there is none (a search still running, one that
    failed before its end, or one made before this file existed). ValueError naming the file when
    it is not a record this vidtune can read."""
    path = record_path(folder)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e}); run the search again with resume=True to "
                         "rewrite it") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"{path} is not a search record of format {FORMAT}; a newer vidtune wrote it?")
    known = set(SearchRecord.__dataclass_fields__)
    return SearchRecord(**{k: v for k, v in raw.items() if k in known})
