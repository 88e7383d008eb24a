"""The MLflow UI's side of a search: links that open its model-training UI, and a saved view of
the runs table that opens ready to compare (this search's trials, the columns that answer
"which batch size and lr, how good, how fast", sorted by the objective).

MLflow 3 opens an experiment in its GenAI mode (an empty Traces overview) unless the link
carries `?workflowType=machine_learning` (WORKFLOW_QUERY). Its runs table loads a saved view
when the link carries `?viewStateShareKey=<id>`: the view is the experiment tag
`mlflow.sharedViewState.<id>`, an envelope `{"name", "createdAt", "updatedAt", "state"}` whose
`state` is a JSON string of the search facets (`searchFilter`, `orderByKey`, `orderByAsc`) and
the table's UI state (`selectedColumns`, ...), columns keyed like params.`lr`. That format is the
UI's internal one, read from MLflow 3.17's bundle (`server/js/build/static/js`: the envelope in
module 53787, the keys a view may set in 3793 and main's `HC`), so it is written only for the UI
versions in VERIFIED_UI; another version gets the plain runs-table link and one line saying so.

The UI drops `runsExpanded` from a saved view (main's `hN`), so a view cannot open a parent run
expanded. It filters to the parent's children instead: a child whose parent is not in the
table shows as a row of its own, so the trials show flat, sorted by the objective across them.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode, urlparse

import mlflow
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from vidtune.tune.results import objective_key

WORKFLOW_QUERY = {"workflowType": "machine_learning"}   # MLflow 3's model-training UI, not GenAI's
SHARE_KEY_PARAM = "viewStateShareKey"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"      # the UI opens an experiment of this kind on Runs
EXPERIMENT_KIND = "custom_model_development"
VERIFIED_UI = ("3.17",)          # MLflow UI versions (major.minor) whose saved-view format was read
VERSION_TIMEOUT_S = 3.0


def column(kind: str, key: str) -> str:
    """A runs-table column's key in a view: `kind` is params, metrics, tags or attributes."""
    return f"{kind}.`{key}`"


def objective_metric(objective: str) -> str:
    """The child runs' summary metric that ranks them: best_val_f1 for val_f1, else best_val_acc
    (pareto ranks by accuracy)."""
    return "best_val_f1" if objective_key(objective) == "val_f1" else "best_val_acc"


def view_columns(objective: str, tags: Sequence[str] = ()) -> list[str]:
    """The view's columns, in order: batch size, lr, the objective (and the accuracy beside an
    F1 objective), the accuracy's 95% interval, the best epoch, the one speed, then `tags` (the
    trial's outcome)."""
    ranked_by = objective_metric(objective)
    metrics = [ranked_by] + (["best_val_acc"] if ranked_by != "best_val_acc" else []) + \
        ["best_val_acc_low", "best_val_acc_high", "best_epoch", "speed_clips_per_s"]
    return ([column("params", "batch_size"), column("params", "lr")] +
            [column("metrics", m) for m in metrics] + [column("tags", t) for t in tags])


def view_state(*, parent_run_id: str, objective: str, tags: Sequence[str] = ()) -> dict[str, Any]:
    """The saved view's state: the parent's children, best objective first, `view_columns` (in
    that order after the run's name: the table's column ids are the same keys)."""
    columns = view_columns(objective, tags)
    return {
        "searchFilter": f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent_run_id}'",
        "orderByKey": column("metrics", objective_metric(objective)),
        "orderByAsc": False,
        "selectedColumns": columns,
        "columnOrder": [column("attributes", "Run Name"), *columns],
        "runListHidden": False,
    }


def view_id(parent_run_id: str) -> str:
    """The saved view's id (its tag's suffix, the link's share key): one per search."""
    return f"vidtune-{parent_run_id}"


def view_tag(view: str, *, name: str, state: dict[str, Any], now_ms: int | None = None) -> tuple[str, str]:
    """(key, value) of the experiment tag holding a saved view (the envelope the UI parses)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    envelope = {"name": name, "createdAt": now_ms, "updatedAt": now_ms, "state": json.dumps(state)}
    return VIEW_TAG_PREFIX + view, json.dumps(envelope)


def read_view(value: str) -> dict[str, Any]:
    """The state of a saved view's tag value (an envelope, or a bare state as older UIs wrote)."""
    doc = json.loads(value)
    return json.loads(doc["state"]) if isinstance(doc.get("state"), str) else doc


def runs_link(experiment_id: str, view: str | None = None) -> str:
    """The runs table's link inside the UI (`#/...`: relative, as the description's links are),
    on the saved view when given."""
    query = {**WORKFLOW_QUERY, **({SHARE_KEY_PARAM: view} if view else {})}
    return f"#/experiments/{experiment_id}/runs?{urlencode(query)}"


def run_link(experiment_id: str, run_id: str) -> str:
    """A run's page inside the UI (`#/...`, relative)."""
    return f"#/experiments/{experiment_id}/runs/{run_id}?{urlencode(WORKFLOW_QUERY)}"


def ui_version(tracking_uri: str) -> str:
    """The MLflow version whose UI shows this store: a tracking server's (`GET /version`; "" when
    it does not answer), else this process's (`mlflow ui` is run from the same environment)."""
    if urlparse(tracking_uri).scheme not in ("http", "https"):
        return mlflow.__version__
    try:
        with urllib.request.urlopen(tracking_uri.rstrip("/") + "/version", timeout=VERSION_TIMEOUT_S) as resp:
            return resp.read().decode("utf-8", "replace").strip()
    except (urllib.error.URLError, OSError, ValueError):
        return ""


def view_verified(version: str) -> bool:
    """The UI of MLflow `version` reads the saved-view format written here (VERIFIED_UI)."""
    return any(version == v or version.startswith(v + ".") for v in VERIFIED_UI)
