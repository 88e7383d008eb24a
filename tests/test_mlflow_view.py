"""MLflow opens ready: the saved runs-table view a search writes (read back from the store, and
its filter and sort run through MLflow's own search), links that open the model-training UI,
the fallback on an MLflow whose UI was not checked, and the parent's description (the answer
first, relative links, a sentence under each plot). A SQLite store, no Ray."""
from __future__ import annotations

import math
import re
from types import SimpleNamespace
from urllib.parse import parse_qs, urlparse

import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

from vidtune.tune.outputs.results import TrialResult
from vidtune.tune.outputs.tables import format_markdown
from vidtune.tune.tracking import view
from vidtune.tune.tracking.description import CELL_PAD, spaced_table
from vidtune.tune.tracking.schema import INTERVAL_TAG, OUTCOME_TAG
from vidtune.tune.tracking.tracker import MLflowTracker
from vidtune.tune.tracking.view import SHARE_KEY_PARAM, VIEW_TAG_PREFIX, read_view


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    """One store for the module (an MLflow SQLite schema costs seconds); one experiment a test."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlruns.db'}"


def _tracker(uri: str, experiment: str, objective: str = "val_acc") -> MLflowTracker:
    return MLflowTracker(tracking_uri=uri, experiment=experiment, experiment_path=f"/results/{experiment}",
                         epochs=3, parent_params={}, parent_tags={}, child_params={}, objective=objective,
                         val_clips=32)


def _row(trial_id: str, val_acc: float, clips_per_s: float, status: str = "DONE") -> TrialResult:
    return TrialResult(trial_id=trial_id, batch_size=4, lr=1e-3, val_acc=val_acc,
                    val_f1=val_acc - 0.1, clips_per_s=clips_per_s, epoch_time_s=2.0, epochs=3, status=status,
                    checkpoint=None, best_epoch=2, name=trial_id)


def _result(row: TrialResult):
    """What `reconcile` reads of a Tune Result: the config and the last report (no dataframe)."""
    last = {"epoch": row.epochs, "val_acc": row.val_acc, "clips_per_s": row.clips_per_s}
    return SimpleNamespace(config={"batch_size": row.batch_size, "lr": row.lr}, metrics=last,
                           metrics_dataframe=None, error=None)


def _search(uri: str, experiment: str, rows: list[TrialResult], objective: str = "val_acc") -> MLflowTracker:
    t = _tracker(uri, experiment, objective)
    t.setup()
    t.reconcile([(r, _result(r), None) for r in rows])
    return t


def _link_query(url: str) -> dict[str, list[str]]:
    """The query of a UI link, which sits inside its `#/...` fragment."""
    return parse_qs(urlparse(urlparse(url).fragment).query)


def test_the_saved_view_in_the_store_shows_the_columns_and_sorts_by_the_objective(uri):
    rows = [_row("slow", 0.70, 10.0), _row("best", 0.80, 20.0), _row("oom", math.nan, math.nan, "OOM")]
    t = _search(uri, "view", rows)
    _search(uri, "view-other", [_row("elsewhere", 0.99, 5.0)])      # another search, other experiment
    c = MlflowClient(uri)
    exp = c.get_experiment(t.experiment_id)
    views = {k: v for k, v in exp.tags.items() if k.startswith(VIEW_TAG_PREFIX)}
    assert list(views) == [VIEW_TAG_PREFIX + t.view_id]
    state = read_view(views[VIEW_TAG_PREFIX + t.view_id])
    assert {"params.`batch_size`", "params.`lr`", "metrics.`best_val_acc`", "metrics.`speed_clips_per_s`",
            f"tags.`{OUTCOME_TAG}`"} <= set(state["selectedColumns"])
    assert state["orderByKey"] == "metrics.`best_val_acc`" and state["orderByAsc"] is False
    assert exp.tags[view.EXPERIMENT_KIND_TAG] == "custom_model_development"
    # The UI asks the store with the view's filter and sort: this search's trials, best first.
    found = c.search_runs([t.experiment_id], filter_string=state["searchFilter"],
                          order_by=[f"{state['orderByKey']} DESC"])
    assert [r.info.run_name for r in found] == ["best", "slow", "oom"]


def test_an_f1_search_sorts_its_view_by_the_best_f1():
    state = view.view_state(parent_run_id="abc", objective="val_f1", tags=(OUTCOME_TAG,))
    assert state["orderByKey"] == "metrics.`best_val_f1`"
    assert state["selectedColumns"][:5] == ["params.`batch_size`", "params.`lr`", "params.`weight_decay`",
                                            "metrics.`best_val_f1`", "metrics.`best_val_acc`"]


def test_every_link_the_tracker_builds_opens_the_model_training_ui_on_the_view(uri):
    t = _search(uri, "links", [_row("a", 0.5, 10.0)])
    urls = [t.runs_table_url(), t.run_url(t.parent_run_id), *(t.run_url(r) for r in t.child_runs.values())]
    assert all(_link_query(u)["workflowType"] == ["machine_learning"] for u in urls), urls
    assert _link_query(t.runs_table_url())[SHARE_KEY_PARAM] == [t.view_id]
    assert urlparse(t.runs_table_url()).fragment.startswith(f"/experiments/{t.experiment_id}/runs?")


def test_an_mlflow_ui_not_checked_gets_plain_links_and_one_line(uri, monkeypatch, capsys):
    monkeypatch.setattr(view.mlflow, "__version__", "4.0.0")
    t = _search(uri, "unchecked", [_row("a", 0.5, 10.0)])
    exp = MlflowClient(uri).get_experiment(t.experiment_id)
    assert not any(k.startswith(VIEW_TAG_PREFIX) for k in exp.tags) and t.view_id == ""
    assert _link_query(t.runs_table_url()) == {"workflowType": ["machine_learning"]}
    lines = [line for line in capsys.readouterr().out.splitlines() if "saved runs-table view" in line]
    assert len(lines) == 1 and "MLflow 4.0.0" in lines[0]


def test_the_description_opens_with_the_answer_and_its_links_are_relative(uri, tmp_path):
    rows = [_row("best", 0.8, 20.0), _row("next", 0.7, 30.0)]
    t = _search(uri, "description", rows)
    history = tmp_path / "objective_history.png"
    history.write_bytes(b"\x89PNG\r\n\x1a\n")
    t.log_summary(files=[history])
    answer = ["Best: best (batch 4, lr 1.00e-03), val_acc 0.800 [0.65, 0.91] at epoch 2.",
              "The validation set has 32 clips: one clip is 3.1 points of accuracy."]
    t.publish_view(table_markdown="| trial |\n|---|\n| best |", best_trial_id="best", objective="val_acc",
                   answer=answer)
    note = MlflowClient(uri).get_run(t.parent_run_id).data.tags["mlflow.note.content"]
    assert note.startswith(answer[0]) and note.index(answer[1]) < note.index(f"| {CELL_PAD}trial{CELL_PAD} |")
    assert "127.0.0.1" not in note and "http" not in note
    best_run = t.child_runs["best"]
    assert f"](#/experiments/{t.experiment_id}/runs/{best_run}?workflowType=machine_learning)" in note
    assert f"](#/experiments/{t.experiment_id}/runs?workflowType=machine_learning&{SHARE_KEY_PARAM}=" in note
    image = f"![objective_history.png](get-artifact?path=objective_history.png&run_uuid={t.parent_run_id})"
    assert image in note and "best so far" in note.split(image, 1)[1].split("\n\n")[1]
    assert "objective_vs_params.png" not in note          # a sentence only under a plot the run holds


def _logged_metric_names() -> set[str]:
    """Every metric name a trial's run gets: each numeric key a worker reports (as
    `numeric_metrics` keeps and renames it) and the run's summary."""
    from vidtune.trainer.cluster.worker import METRIC_KEYS
    from vidtune.tune.outputs.results import SUMMARY_KEYS
    from vidtune.tune.tracking.schema import numeric_metrics
    report = dict.fromkeys(METRIC_KEYS, 1.0)
    return set(numeric_metrics(report)) | set(SUMMARY_KEYS) | {"best_val_f1"}


@pytest.mark.parametrize("objective", ["val_acc", "val_f1"])
def test_the_saved_view_opens_its_charts_with_every_metric_in_its_section(objective):
    state = view.view_state(parent_run_id="abc", objective=objective, tags=(OUTCOME_TAG,))
    cards, sections = state["compareRunCharts"], state["compareRunSections"]
    by_name = {s["name"]: s for s in sections}
    compare = [c for c in cards if c["metricSectionId"] == by_name[view.COMPARE_SECTION]["uuid"]]
    best = view.objective_metric(objective)
    assert [c["type"] for c in compare] == ["SCATTER", "PARALLEL", "LINE"]
    scatter, parallel, per_epoch = compare
    assert (scatter["xaxis"]["key"], scatter["yaxis"]["key"]) == ("speed_clips_per_s", best)
    # MLflow colours a parallel chart's lines by its last metric: the objective
    assert parallel["selectedParams"] == ["batch_size", "lr"] and parallel["selectedMetrics"] == [
        "speed_clips_per_s", best]
    assert per_epoch["metricKey"] == objective and per_epoch["xAxisKey"] == "step"
    assert all(c["runsCountToCompare"] >= 100 for c in cards)   # every trial, not the UI's first 10
    # Every metric a run logs has exactly one card, so the UI adds none of its own (alphabetical,
    # cache counters beside accuracy); the interval bounds' cards are deleted (out of sight).
    charted = [c["metricKey"] for c in cards if "metricKey" in c]
    assert sorted(charted) == sorted(set(charted)) and _logged_metric_names() <= set(charted)
    hidden = {c["metricKey"] for c in cards if c["deleted"]}
    assert hidden == {"best_val_acc_low", "best_val_acc_high"}
    # Operational metrics sit folded in a section of their own; the comparison opens first.
    section_of = {c["metricKey"]: c["metricSectionId"] for c in cards if "metricKey" in c}
    ops = next(s for s in sections if s["name"].startswith("Operations"))
    assert not ops["display"] and section_of["cache_hit_frac"] == section_of["torch_threads"] == ops["uuid"]
    assert sections[0]["name"] == view.COMPARE_SECTION and sections[0]["display"]
    assert state["isAccordionReordered"] is True       # else the UI sorts the sections by name
    assert {s["uuid"] for s in sections} >= {c["metricSectionId"] for c in cards}
    # The same ids on every write: rewriting the view keeps what the UI holds of it.
    assert view.view_state(parent_run_id="abc", objective=objective)["compareRunCharts"] == cards


def test_the_links_open_the_charts_in_the_model_training_ui(uri):
    t = _search(uri, "chart-links", [_row("a", 0.5, 10.0), _row("b", 0.6, 12.0)])
    charts = _link_query(t.runs_table_url(charts=True))
    assert charts[view.MODE_PARAM] == ["CHART"] and charts[SHARE_KEY_PARAM] == [t.view_id]
    assert view.MODE_PARAM not in _link_query(t.runs_table_url())
    lines = t.summary_links(None).splitlines()
    assert t.runs_table_url(charts=True) in lines[0] and t.run_url(t.parent_run_id) in lines[1]


def test_every_link_in_the_description_opens_a_page_that_shows_the_objective(uri):
    """The search's view (its charts and table, whose state has the objective's column and
    sort), or a trial's run (its description leads with the objective); never MLflow's Compare
    page, which opened on train_loss."""
    t = _search(uri, "every-link", [_row("a", 0.5, 10.0), _row("b", 0.6, 12.0)])
    t.publish_view(table_markdown="| trial |\n|---|\n| a |", best_trial_id="b", objective="val_acc")
    c = MlflowClient(uri)
    note = c.get_run(t.parent_run_id).data.tags["mlflow.note.content"]
    links = re.findall(r"\]\((#/[^)]+)\)", note)
    assert len(links) == 3 and not any("compare-runs" in link for link in links)
    state = read_view(c.get_experiment(t.experiment_id).tags[VIEW_TAG_PREFIX + t.view_id])
    for link in links:
        path, query = urlparse(link[1:]).path, _link_query("http://x/" + link)
        assert query["workflowType"] == ["machine_learning"]
        if path.endswith("/runs"):      # the saved view: sorted by the objective, its column shown
            assert query[SHARE_KEY_PARAM] == [t.view_id]
            assert state["orderByKey"] == "metrics.`best_val_acc`" in state["selectedColumns"]
        else:                           # the best trial's run
            assert c.get_run(path.rsplit("/", 1)[1]).data.tags["mlflow.note.content"].startswith(
                "best val_acc 0.600 [")


def test_the_trials_table_keeps_a_space_between_its_cells():
    """MLflow's UI renders the description's table as a bare HTML table, its cells' text run
    together ("t04-bs8-lr2.1e-48") unless each keeps a space the markdown converter does not trim
    (checked with showdown and sanitize-html, MLflow's own: "<td> t04-bs8-lr2.1e-4 </td>")."""
    rows = [_row("t04-bs8-lr2.1e-4", 0.781, 45.1)]
    table = format_markdown(rows, val_clips=32)
    spaced = spaced_table(table)

    def text(markdown: str) -> str:   # what a reader sees: each cell trimmed as the converter does
        return "".join(c.strip().replace(CELL_PAD, " ") for line in markdown.splitlines()
                       if not set(line) <= set("|-: ") for c in line.strip().strip("|").split("|"))
    assert "t04-bs8-lr2.1e-44" in text(table)                 # batch size 4 glued to the name
    assert " t04-bs8-lr2.1e-4  4 " in text(spaced) and "0.781 [0.61, 0.89]" in text(spaced)
    assert spaced.splitlines()[1] == table.splitlines()[1]     # the rule row (alignment) as it was
    assert len(spaced.splitlines()[2].split("|")) == len(table.splitlines()[2].split("|"))


def test_the_runs_table_shows_the_interval_as_one_rounded_column(uri):
    t = _search(uri, "interval", [_row("a", 0.75, 10.0)])
    run = MlflowClient(uri).get_run(t.child_runs["a"])
    assert run.data.tags[INTERVAL_TAG] == "[0.58, 0.87]"        # 24 of 32 clips, Wilson
    assert run.data.metrics["best_val_acc_low"] == pytest.approx(0.5789, abs=1e-4)   # kept, not shown
    columns = view.view_state(parent_run_id="p", objective="val_acc")["selectedColumns"]
    assert f"tags.`{INTERVAL_TAG}`" in columns and not any("best_val_acc_low" in c for c in columns)


def test_the_description_shows_narrow_copies_of_the_plots_linked_to_the_full_size(uri, tmp_path):
    from vidtune.tune.outputs.plots import plot_history
    from vidtune.tune.tracking.description import PREVIEW_FOLDER, PREVIEW_WIDTH_PX
    rows = [_row("best", 0.8, 20.0), _row("next", 0.7, 30.0)]
    t = _search(uri, "previews", rows)
    history = plot_history(rows, tmp_path / "objective_history.png", objective="val_acc", val_clips=32)
    broken = tmp_path / "accuracy_vs_speed.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n")                    # no image PIL reads: embedded as it is
    t.log_summary(files=[history, broken])
    t.publish_view(table_markdown="| trial |", best_trial_id="best", objective="val_acc")
    c = MlflowClient(uri)
    (tmp_path / "dl").mkdir()
    copy = c.download_artifacts(t.parent_run_id, f"{PREVIEW_FOLDER}/objective_history.png",
                                str(tmp_path / "dl"))
    with Image.open(copy) as img, Image.open(history) as full:
        assert img.width == PREVIEW_WIDTH_PX < full.width
        assert abs(img.height / img.width - full.height / full.width) < 0.01
    note = c.get_run(t.parent_run_id).data.tags["mlflow.note.content"]
    run = t.parent_run_id
    preview = f"get-artifact?path={PREVIEW_FOLDER}/objective_history.png&run_uuid={run}"
    full = f"get-artifact?path=objective_history.png&run_uuid={run}"
    assert f"[![objective_history.png]({preview})]({full})" in note
    assert f"![accuracy_vs_speed.png](get-artifact?path=accuracy_vs_speed.png&run_uuid={run})" in note


def test_artifact_location_names_where_a_new_experiment_keeps_its_files(uri, tmp_path, capsys):
    from vidtune.tune.tracking.store import check_artifact_location

    folder = check_artifact_location(str(tmp_path / "artifacts"))     # made by MLflow when it writes
    assert folder == (tmp_path / "artifacts").as_uri()
    assert check_artifact_location("s3://bucket/vidtune") == "s3://bucket/vidtune"
    t = MLflowTracker(tracking_uri=uri, experiment="elsewhere", experiment_path="/results/e", epochs=3,
                      parent_params={}, parent_tags={}, child_params={}, artifact_location=folder)
    t.setup()
    t.log_summary(files=[])
    exp = MlflowClient(uri).get_experiment(t.experiment_id)
    assert exp.artifact_location == folder
    assert MlflowClient(uri).get_run(t.parent_run_id).info.artifact_uri.startswith(folder)
    # an experiment that exists keeps its own location, and the search says so once
    other = MLflowTracker(tracking_uri=uri, experiment="elsewhere", experiment_path="/results/f", epochs=3,
                          parent_params={}, parent_tags={}, child_params={},
                          artifact_location=(tmp_path / "other").as_uri())
    other.setup()
    said = [ln for ln in capsys.readouterr().out.splitlines() if "--artifact-location" in ln]
    assert len(said) == 1 and folder in said[0] and "another --experiment" in said[0]
