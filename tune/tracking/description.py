"""The parent run as the MLflow UI opens it: the search's saved runs-table view (an experiment
tag), the links into the model-training UI, and the parent's description (MLflow's note,
markdown): the answer, the best run, the trials table, each plot with a sentence under it, and
what the columns and tags mean. The view's JSON and the link formats are `tune.tracking.view`'s;
`tune.tracking.tracker.MLflowTracker` calls these with its client and its runs' ids.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

from mlflow.tracking import MlflowClient
from PIL import Image

from vidtune.servers import ui_line
from vidtune.trainer.training.report_keys import Key
from vidtune.tune.tracking import view
from vidtune.tune.tracking.schema import BEST_TAG, GPU_IDS_TAG, INTERVAL_TAG, NODE_TAG, OUTCOME_TAG
from vidtune.tune.tracking.store import sqlite_path

# The plots the parent run may hold (`tune.summary` logs them at its root), in the description's
# order, each with the sentence under it; {objective} is the search's.
PLOT_SENTENCES = (
    ("objective_history.png", "Each trial's {objective} in the order the trials started, and the best so far "
                              "as a line: a line still rising at the end says more trials may find better."),
    ("objective_vs_params.png", "Each trial's {objective} against its lr (log scale) and batch size (trials "
                                "of one size spread a little apart), the best marked: a best value at the "
                                "edge of an axis says to widen that range."),
    ("accuracy_vs_speed.png", "Validation accuracy against steady-state speed (clips/s), each with its 95% "
                              "interval: the trials on the front (up and to the right) are the ones worth "
                              "choosing between; the bands at the bottom are each batch size's speed over "
                              "its trials, the noise a speed difference must beat."),
)
PLOT_NAMES = {name for name, _ in PLOT_SENTENCES}


PREVIEW_FOLDER = "previews"   # the parent run's artifact folder of the plots' narrow copies
PREVIEW_WIDTH_PX = 760        # narrow enough that the run page keeps its side panel on a 1600 px screen


def write_previews(files: Sequence[Path], folder: Path) -> list[Path]:
    """Narrow copies (PREVIEW_WIDTH_PX wide, same aspect) of the plots the description embeds, in
    `folder`. MLflow's markdown keeps no width on an image (its sanitizer drops the attribute), so
    the 1290-1410 px plots would widen the run page past its side panel; the description shows
    these and links each to its full-size plot. Returns the copies written."""
    out = []
    for path in files:
        path = Path(path)
        if path.name not in PLOT_NAMES or not path.is_file():
            continue
        try:
            with Image.open(path) as img:
                if img.width > PREVIEW_WIDTH_PX:
                    img = img.resize((PREVIEW_WIDTH_PX, round(img.height * PREVIEW_WIDTH_PX / img.width)),
                                     Image.Resampling.LANCZOS)
                img.save(folder / path.name)
        except OSError:   # not an image PIL reads (or a full disk): the description embeds the plot itself
            continue
        out.append(folder / path.name)
    return out


CELL_PAD = "&ensp;"   # an en space, as an entity: the markdown converter trims plain spaces in a cell


def spaced_table(markdown: str) -> str:
    """`markdown` with a space kept on each side of every table cell's text. MLflow's UI renders a
    description's markdown table as a bare HTML table (its sanitizer allows no style, its page
    sets no cell padding), so adjacent cells' text runs together ("t04-bs8-lr2.1e-48"); an
    entity survives the converter's trimming of the cells and the sanitizer. Rule rows
    (`|---:|`) and lines outside tables are kept as they are."""
    out = []
    for line in markdown.splitlines():
        cells = line.strip().strip("|").split("|") if line.lstrip().startswith("|") else None
        if cells is None or all(set(c.strip()) <= set("-:") for c in cells):
            out.append(line)
            continue
        out.append("| " + " | ".join(f"{CELL_PAD}{c.strip()}{CELL_PAD}" for c in cells) + " |")
    return "\n".join(out)


def save_view(client: MlflowClient, *, tracking_uri: str, experiment_id: str, parent_run_id: str,
              experiment_path: str, objective: str) -> str:
    """Write the search's saved runs-table view (`tune.tracking.view`: this search's trials,
    batch size, lr, the objective, speed and outcome, best first) as an experiment tag, and
    mark the experiment a model-training one (unless someone chose its kind), when the UI
    showing the store reads that format; else say once that the links open the plain table.
    Returns the view's id; "" for none (the links open the plain table)."""
    version = view.ui_version(tracking_uri)
    if not view.view_verified(version):
        checked = ", ".join(view.VERIFIED_UI)
        print(f"MLflow: the UI of MLflow {version or '(unknown version)'} was not checked to read "
              f"vidtune's saved runs-table view (checked: {checked}); the links open the plain runs "
              "table", flush=True)
        return ""
    share_key = view.view_id(parent_run_id)
    state = view.view_state(parent_run_id=parent_run_id, objective=objective, tags=(OUTCOME_TAG,))
    ranked_by = view.objective_metric(objective)
    name = f"vidtune {Path(experiment_path).name}: trials by {ranked_by}"
    client.set_experiment_tag(experiment_id, *view.view_tag(share_key, name=name, state=state))
    if view.EXPERIMENT_KIND_TAG not in client.get_experiment(experiment_id).tags:
        client.set_experiment_tag(experiment_id, view.EXPERIMENT_KIND_TAG, view.EXPERIMENT_KIND)
    return share_key


def ui_base(tracking_uri: str) -> str:
    """Where the MLflow UI of this store answers: the tracking server itself, or the address
    `mlflow ui --backend-store-uri ...` serves a SQLite store on by default."""
    if urlparse(tracking_uri).scheme in ("http", "https"):
        return tracking_uri.rstrip("/")
    return "http://127.0.0.1:5000"


def ui_hint(tracking_uri: str) -> str:
    """For the console, after a link: how to start the UI of a SQLite store ("" for a server)."""
    path = sqlite_path(tracking_uri)
    # `vidtune ui` runs MLflow's UI from vidtune's environment: the line works without the venv active
    return f"  (after: {ui_line(f'sqlite:///{path}')})" if path is not None else ""


def runs_table_url(tracking_uri: str, experiment_id: str, view_id: str | None, *,
                   charts: bool = False) -> str:
    """The experiment's runs table in the model-training UI, on the search's saved view when
    there is one (MLflow 3 opens an experiment on its GenAI overview); `charts`: on the view's
    Charts tab."""
    return f"{ui_base(tracking_uri)}/{view.runs_link(experiment_id, view_id, charts=charts)}"


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{ui_base(tracking_uri)}/{view.run_link(experiment_id, run_id)}"


def publish_view(client: MlflowClient, *, parent_run_id: str, child_runs: dict[str, str], experiment_id: str,
                 experiment_path: str, view_id: str | None, table_markdown: str, best_trial_id: str | None,
                 objective: str, answer: Sequence[str] = ()) -> None:
    """The parent run's description (MLflow's note, markdown): the `answer` sentences first,
    the best child run and the saved runs-table view (links relative to the UI, so they work
    on any address, port or tunnel), the trials table, each plot the parent holds with one
    sentence under it, and what the columns mean. The best child run gets `vidtune.best`.
    `child_runs`: trial id -> run id."""
    c, parent = client, parent_run_id
    best_run = child_runs.get(best_trial_id) if best_trial_id else None
    for run_id in child_runs.values():
        if run_id == best_run:
            c.set_tag(run_id, BEST_TAG, "true")
        elif BEST_TAG in c.get_run(run_id).data.tags:
            c.delete_tag(run_id, BEST_TAG)
    best_line = (f"Best trial by {objective}: [{c.get_run(best_run).info.run_name}]"
                 f"({view.run_link(experiment_id, best_run)}) (tag `{BEST_TAG}`)." if best_run
                 else "No trial produced a usable result.")
    # Every link opens a page that shows the objective: the view's charts and table, a run's page.
    # (MLflow's side-by-side Compare page opened on train_loss, not the objective.)
    table_line = (f"[Compare the trials]({view.runs_link(experiment_id, view_id, charts=True)}) in charts "
                  f"(best {objective} against speed, batch size and lr against both, coloured by "
                  f"{objective}; {objective} per epoch) or in "
                  f"[the runs table]({view.runs_link(experiment_id, view_id)}) "
                  f"(best {objective} first, with its 95% interval).")
    held = {a.path for a in c.list_artifacts(parent)}
    previews = ({Path(a.path).name for a in c.list_artifacts(parent, PREVIEW_FOLDER)}
                if PREVIEW_FOLDER in held else set())

    def image(name: str) -> str:   # the narrow copy, linked to the full-size plot, when there is one
        full = f"get-artifact?path={name}&run_uuid={parent}"
        if name not in previews:
            return f"![{name}]({full})"
        return f"[![{name}](get-artifact?path={PREVIEW_FOLDER}/{name}&run_uuid={parent})]({full})"

    plots = [f"{image(name)}\n\n{sentence.format(objective=objective)}\n"
             for name, sentence in PLOT_SENTENCES if name in held]
    note = "\n".join([
        *[f"{line}\n" for line in answer],
        f"**vidtune search** `{Path(experiment_path).name}` ({experiment_path})", "",
        best_line + " " + table_line, "", spaced_table(table_markdown), "",
        *plots,
        f"Each trial's run holds its summary (`{Key.BEST_VAL_ACC}`, its 95% interval as the tag "
        f"`{INTERVAL_TAG}` and as the metrics `{Key.BEST_VAL_ACC_LOW}` / `_high`, `{Key.BEST_EPOCH}`, "
        f"`{Key.BEST_VAL_F1}`, `{Key.SPEED_CLIPS_PER_S}`: the steady-state clips/s) and its "
        f"history per epoch (step = epoch; `{Key.LR.mlflow}` is the schedule's learning rate, the param "
        f"`{Key.LR}` its peak). `{OUTCOME_TAG}` says how it ended: done, stopped early (by ASHA; FINISHED), "
        "out of memory, diverged (its loss became inf or NaN), failed (FAILED; see "
        "`vidtune.failure_reason`), interrupted (KILLED; see `vidtune.stop_reason`). Also there: "
        f"`{BEST_TAG}`, `{GPU_IDS_TAG}`, `{NODE_TAG}`.",
    ])
    c.set_tag(parent, "mlflow.note.content", note[:60000])
