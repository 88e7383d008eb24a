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

The same view carries the Charts tab's layout (`chart_layout`), which the link opens with
`compareRunsMode=CHART` (module 13627): `compareRunCharts` (one card per chart: `type` SCATTER,
PARALLEL, LINE or BAR, a `uuid`, the `metricSectionId` of its section; the fields of each type in
`runs-charts.types.ts`) and `compareRunSections` (`uuid`, `name`, `display`: open in the
accordion), with `isAccordionReordered` true so the UI keeps the sections' order rather than
sorting them by name. On every load the UI gives each metric the runs have and no card names
(`metricKey`) a chart of its own in the section its name says ("Model metrics" for a name without
a "/"), so every metric the trials log gets a card here, in its section; a card with `deleted`
true keeps a metric out of sight (the UI's own way of remembering a removed chart).
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode, urlparse
from uuid import NAMESPACE_URL, uuid5

import mlflow
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from vidtune.trainer.training.report_keys import Key
from vidtune.tune.config import searched
from vidtune.tune.outputs.results import objective_key
from vidtune.tune.tracking.schema import INTERVAL_TAG

WORKFLOW_QUERY = {"workflowType": "machine_learning"}   # MLflow 3's model-training UI, not GenAI's
SHARE_KEY_PARAM = "viewStateShareKey"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"      # the UI opens an experiment of this kind on Runs
EXPERIMENT_KIND = "custom_model_development"
VERIFIED_UI = ("3.17",)          # MLflow UI versions (major.minor) whose saved-view format was read
MODE_PARAM, CHART_MODE = "compareRunsMode", "CHART"   # a runs link's query that opens the Charts tab
ALL_RUNS = 100                   # a chart's `runsCountToCompare`: every trial of a search, not the UI's 10


def _mlflow(*keys: Key) -> tuple[str, ...]:
    """The names MLflow logs `keys` under (`lr` as lr_current: trainer/training/report_keys.py)."""
    return tuple(k.mlflow for k in keys)


# The Charts tab's sections, in order: (name, open, the metrics charted there). The first holds
# the three comparison charts (`comparison_cards`); "Model metrics" is MLflow's own name, where a
# metric not placed here lands. Summary metrics (one value a trial, step 0) are bars; the rest
# are one line a trial over the epochs.
COMPARE_SECTION = "Compare the trials"
MODEL_SECTION = "Model metrics"
SUMMARY_BARS = _mlflow(Key.BEST_VAL_ACC, Key.BEST_VAL_F1, Key.BEST_EPOCH, Key.SPEED_CLIPS_PER_S)
SECTIONS = (
    (COMPARE_SECTION, True, ()),
    (MODEL_SECTION, True, _mlflow(Key.VAL_ACC, Key.VAL_F1, Key.VAL_RECALL, Key.VAL_AUC, Key.VAL_LOSS,
                                  Key.TRAIN_LOSS, Key.LR)),
    ("Trial summary", True, SUMMARY_BARS),
    ("Speed and memory per epoch", False, _mlflow(Key.CLIPS_PER_S, Key.EPOCH_TIME_S, Key.PEAK_MEM_MB,
                                                  Key.COMPUTE_CLIPS_PER_S, Key.DATA_WAIT_FRAC)),
    ("Operations: cache, threads, waits", False, _mlflow(
        Key.CACHE_HIT_FRAC, Key.CACHE_REPAIRS, Key.CONCURRENT_TRAININGS, Key.DEVICE_WAIT_S,
        Key.DEVICE_UTIL_PCT, Key.TORCH_THREADS, Key.OTHER_CPU_CORES, Key.PEAK_ALLOCATED_MB,
        Key.NONFINITE_STEPS)),
    ("System metrics", False, ()),
)
# Logged, and not charted: the accuracy's interval bounds (columns of the table, beside it)
HIDDEN = _mlflow(Key.BEST_VAL_ACC_LOW, Key.BEST_VAL_ACC_HIGH)
VERSION_TIMEOUT_S = 3.0


def column(kind: str, key: str) -> str:
    """A runs-table column's key in a view: `kind` is params, metrics, tags or attributes."""
    return f"{kind}.`{key}`"


def objective_metric(objective: str) -> str:
    """The child runs' summary metric that ranks them: best_val_f1 for val_f1, else best_val_acc
    (pareto ranks by accuracy)."""
    return Key.BEST_VAL_F1.mlflow if objective_key(objective) == Key.VAL_F1 else Key.BEST_VAL_ACC.mlflow


def view_columns(objective: str, tags: Sequence[str] = ()) -> list[str]:
    """The view's columns, in order: each declared parameter (`tune.config.searched.PARAMS`: every child
    run has them, searched or fixed), the objective (and the accuracy beside an
    F1 objective), the accuracy's 95% interval as one column (the tag INTERVAL_TAG, "[0.58,
    0.87]", not the two unrounded bounds), the best epoch, the one speed, then `tags` (the
    trial's outcome)."""
    ranked_by = objective_metric(objective)
    accuracy = [ranked_by] + ([Key.BEST_VAL_ACC.mlflow] if ranked_by != Key.BEST_VAL_ACC else [])
    return ([column("params", p.name) for p in searched.PARAMS] +
            [column("metrics", m) for m in accuracy] + [column("tags", INTERVAL_TAG)] +
            [column("metrics", m) for m in _mlflow(Key.BEST_EPOCH, Key.SPEED_CLIPS_PER_S)] +
            [column("tags", t) for t in tags])


def view_state(*, parent_run_id: str, objective: str, tags: Sequence[str] = ()) -> dict[str, Any]:
    """The saved view's state: the parent's children, best objective first, `view_columns` (in
    that order after the run's name: the table's column ids are the same keys)."""
    columns = view_columns(objective, tags)
    return {**chart_layout(view_id(parent_run_id), objective),
        "searchFilter": f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent_run_id}'",
        "orderByKey": column("metrics", objective_metric(objective)),
        "orderByAsc": False,
        "selectedColumns": columns,
        "columnOrder": [column("attributes", "Run Name"), *columns],
        "runListHidden": False,
    }


def _uuid(view: str, name: str) -> str:
    """A card's or section's id: the same on every write of one view (a rewrite keeps what the
    UI has of it)."""
    return str(uuid5(NAMESPACE_URL, f"vidtune/{view}/{name}"))


def _card(view: str, name: str, section: str, kind: str, **fields: Any) -> dict[str, Any]:
    return {"uuid": _uuid(view, "card/" + name), "type": kind,
            "metricSectionId": _uuid(view, "section/" + section), "runsCountToCompare": ALL_RUNS,
            "deleted": False, "isGenerated": False, **fields}


def _line(view: str, metric: str, section: str, **fields: Any) -> dict[str, Any]:
    """One line a run over the epochs (MLflow's step is the epoch)."""
    return _card(view, metric, section, "LINE", metricKey=metric, selectedMetricKeys=[metric],
                 xAxisKey="step", lineSmoothness=0, scaleType="linear", xAxisScaleType="linear",
                 useGlobalXaxisKey=False, useGlobalLineSmoothing=False, **fields)


def comparison_cards(view: str, objective: str) -> list[dict[str, Any]]:
    """The three charts a person compares trials with: the best objective against the one speed
    (each point a trial, named on hover), parallel coordinates of batch size and lr to the speed
    and the best objective, and the objective per epoch, one line a trial. The parallel chart
    colours its lines by its last metric (MLflow 3.17's bundle, chunk 7417: `S=h[h.length-1]`
    over the selected metrics), so the objective comes last."""
    best, speed = objective_metric(objective), Key.SPEED_CLIPS_PER_S.mlflow
    per_epoch = Key.VAL_F1.mlflow if objective_key(objective) == Key.VAL_F1 else Key.VAL_ACC.mlflow
    return [
        _card(view, "scatter", COMPARE_SECTION, "SCATTER", displayName=f"{best} against {speed}",
              xaxis={"key": speed, "type": "METRIC"}, yaxis={"key": best, "type": "METRIC"}),
        _card(view, "parallel", COMPARE_SECTION, "PARALLEL", displayName="batch size and lr against "
              f"speed and {best} (coloured by {best})", selectedParams=["batch_size", "lr"],
              selectedMetrics=[speed, best], showAllRuns=True),
        _line(view, per_epoch, COMPARE_SECTION, displayName=f"{per_epoch} per epoch, every trial",
              displayPoints=True),
    ]


def chart_layout(view: str, objective: str) -> dict[str, Any]:
    """The saved view's Charts tab (see the module docstring): SECTIONS in order, the comparison
    charts first, every metric a trial logs in its section, operational ones folded away."""
    cards = comparison_cards(view, objective)
    placed = {c.get("metricKey") for c in cards}
    for name, _, metrics in SECTIONS:
        for metric in metrics:
            if metric in placed:
                continue
            if metric in SUMMARY_BARS:
                cards.append(_card(view, metric, name, "BAR", metricKey=metric))
            else:
                cards.append(_line(view, metric, name))
            placed.add(metric)
    cards += [{**_card(view, metric, MODEL_SECTION, "BAR", metricKey=metric), "deleted": True}
              for metric in HIDDEN]
    sections = [{"uuid": _uuid(view, "section/" + name), "name": name, "display": open_, "isReordered": True,
                 "deleted": False, "isGenerated": False} for name, open_, _ in SECTIONS]
    return {"compareRunCharts": cards, "compareRunSections": sections, "isAccordionReordered": True,
            "hideEmptyCharts": True}


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


def runs_link(experiment_id: str, view: str | None = None, *, charts: bool = False) -> str:
    """The runs table's link inside the UI (`#/...`: relative, as the description's links are),
    on the saved view when given; `charts`: open its Charts tab (only with a view: without one
    the UI would chart every metric alphabetically)."""
    query = {**WORKFLOW_QUERY, **({SHARE_KEY_PARAM: view} if view else {}),
             **({MODE_PARAM: CHART_MODE} if view and charts else {})}
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
