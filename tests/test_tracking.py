"""The MLflow writer with fake Tune trials: statuses, params, per-epoch metrics, resume without
duplicates, summary artifacts; and the store checks that run before Ray starts."""
from __future__ import annotations

import http.server
import math
import threading
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from vidtune.flags import ConfigError
from vidtune.tune.tracking import schema, store
from vidtune.tune.tracking.schema import (
    FAILURE_TAG,
    NODE_ID_TAG,
    PARENT_TAG,
    RESUMED_TAG,
    STOP_TAG,
    TRIAL_ID_TAG,
)
from vidtune.tune.tracking.tracker import MLflowTracker


def _tracker(uri: str, experiment: str, path: str = "/results/search-1", epochs: int = 2) -> MLflowTracker:
    return MLflowTracker(
        tracking_uri=uri, experiment=experiment, experiment_path=path, epochs=epochs,
        parent_params={"batch_sizes": "4,8", "lr_min": 1e-4, "lr_max": 1e-2, "dataset": "/data",
                       "model": "tiny"},
        parent_tags={"vidtune.objective": "val_acc"},
        child_params={"precision": "fp32", "model": "tiny", "workers": 1, "gpus": 0.0, "dataset": "/data"},
    )


def _trial(trial_id: str, batch_size: int = 4, lr: float = 1e-3, last: dict | None = None, error_file=None):
    return SimpleNamespace(trial_id=trial_id, config={"batch_size": batch_size, "lr": lr},
                           last_result=last or {}, error_file=error_file)


def _result(epoch: int, **kw) -> dict:
    base = dict(epoch=epoch, train_loss=0.7, val_loss=0.6, val_acc=0.5 + 0.1 * epoch, val_f1=0.5,
                val_recall=0.5, val_auc=0.6, clips_per_s=12.5, epoch_time_s=2.0, data_wait_frac=0.1,
                peak_mem_mb=900.0, lr=1e-3, batch_size=4, oom=0, reader_failures=0, node_id="node-abc",
                # Tune's own keys: not training metrics
                training_iteration=epoch, time_this_iter_s=2.1, timestamp=1_700_000_000 + epoch,
                trial_id="x", done=False, checkpoint_path="/ckpt", config={"lr": 1e-3})
    base.update(kw)
    return base


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    """One store for the module (creating an MLflow SQLite schema costs seconds); each test
    writes to its own experiment."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlruns.db'}"


def _runs(uri: str, experiment: str) -> dict[str, object]:
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name(experiment)
    return {r.data.tags.get(TRIAL_ID_TAG, "parent"): r for r in c.search_runs([exp.experiment_id])}


def test_statuses_params_and_per_epoch_metrics(uri, tmp_path):
    t = _tracker(uri, "statuses", path=str(tmp_path / "search-1"))
    t.setup()
    # the searcher's lr as drawn; MLflow shows it to 3 significant digits, as trials.csv does
    done, stopped, oom = _trial("done", lr=0.0010004321), _trial("stopped"), _trial("oom", batch_size=64)
    err = _trial("err")
    for tr in (done, stopped, oom, err):
        t.on_trial_start(0, [], tr)
    for epoch in (1, 2):
        t.on_trial_result(0, [], done, _result(epoch))
    t.on_trial_result(0, [], stopped, _result(1))
    oom_last = _result(1, oom=1, val_acc=0.0, clips_per_s=0.0, train_loss=math.nan, batch_size=64,
                       peak_mem_mb=79000.0)
    t.on_trial_result(0, [], oom, oom_last)
    error_file = tmp_path / "error.txt"
    error_file.write_text("Traceback (most recent call last):\n  ...\nRuntimeError: decoder exploded\n")

    done.last_result, stopped.last_result, oom.last_result = _result(2), _result(1), oom_last
    err.error_file = str(error_file)
    t.on_trial_complete(0, [], done)
    t.on_trial_complete(0, [], stopped)
    t.on_trial_complete(0, [], oom)
    t.on_trial_error(0, [], err)
    t.close(interrupted=False)

    runs = _runs(uri, "statuses")
    parent = runs["parent"]
    assert parent.info.status == "FINISHED"
    assert parent.data.params["batch_sizes"] == "4,8" and \
        parent.data.tags[schema.EXPERIMENT_PATH_TAG] == str(tmp_path / "search-1")
    statuses = {k: r.info.status for k, r in runs.items() if k != "parent"}
    assert statuses == {"done": "FINISHED", "stopped": "FINISHED", "oom": "FAILED", "err": "FAILED"}
    for name in statuses:
        assert runs[name].data.tags[PARENT_TAG] == parent.info.run_id
    d = runs["done"].data
    assert {k: d.params[k] for k in ("batch_size", "lr", "precision", "model", "workers", "gpus",
                                     "dataset")} == \
        {"batch_size": "4", "lr": "0.001", "precision": "fp32", "model": "tiny", "workers": "1",
         "gpus": "0.0", "dataset": "/data"}
    assert d.tags[NODE_ID_TAG] == "node-abc"
    assert {"val_acc", "val_f1", "clips_per_s", "epoch_time_s", "data_wait_frac", "peak_mem_mb", "val_auc",
            "val_recall", "train_loss", "val_loss", "lr_current"} <= set(d.metrics)
    assert not {"training_iteration", "time_this_iter_s", "timestamp", "done", "checkpoint_path",
                "epoch", "batch_size", "oom", "reader_failures", "lr"} & set(d.metrics)
    history = MlflowClient(uri).get_metric_history(runs["done"].info.run_id, "val_acc")
    assert [(m.step, round(m.value, 3)) for m in history] == [(1, 0.6), (2, 0.7)]
    assert "stopped early by ASHA after epoch 1 of 2" in runs["stopped"].data.tags[STOP_TAG]
    assert "out of memory at batch size 64" in runs["oom"].data.tags[FAILURE_TAG]
    assert "RuntimeError: decoder exploded" in runs["err"].data.tags[FAILURE_TAG]


def test_interrupted_search_leaves_no_running_run_and_resume_reuses_runs(uri):
    t = _tracker(uri, "resume")
    t.setup()
    a, b = _trial("a"), _trial("b")
    t.on_trial_start(0, [], a)
    t.on_trial_result(0, [], a, _result(1))
    a.last_result = _result(2)
    t.on_trial_complete(0, [], a)
    t.on_trial_start(0, [], b)
    t.on_trial_result(0, [], b, _result(1))
    t.close(interrupted=True)                          # Ctrl-C
    runs = _runs(uri, "resume")
    assert {k: r.info.status for k, r in runs.items()} == {"parent": "KILLED", "a": "FINISHED", "b": "KILLED"}

    # --resume: a new writer (unpickled by Tune) finds the parent by experiment path, and b's run by trial id
    import pickle

    t2 = pickle.loads(pickle.dumps(_tracker(uri, "resume")))
    t2.setup()
    assert t2.parent_run_id == runs["parent"].info.run_id
    t2.on_trial_start(0, [], b)
    assert _runs(uri, "resume")["b"].info.status == "RUNNING"
    t2.on_trial_result(0, [], b, _result(1))            # re-reported epoch: not logged twice
    t2.on_trial_result(0, [], b, _result(2))
    b.last_result = _result(2)
    t2.on_trial_complete(0, [], b)
    t2.on_trial_start(0, [], _trial("c"))
    t2.on_trial_complete(0, [], _trial("c", last=_result(2)))
    t2.close(interrupted=False)
    runs = _runs(uri, "resume")
    assert sorted(runs) == ["a", "b", "c", "parent"]     # no duplicate child or parent
    assert {k: r.info.status for k, r in runs.items()} == \
        {"parent": "FINISHED", "a": "FINISHED", "b": "FINISHED", "c": "FINISHED"}
    steps = [m.step for m in MlflowClient(uri).get_metric_history(runs["b"].info.run_id, "val_acc")]
    assert steps == [1, 2]

    # A trial started just before the driver died but never saved by Tune: its slot was re-run as
    # "c", so its run goes to the trash (KILLED, with the reason), leaving one run per trial.
    t3 = _tracker(uri, "resume")
    t3.setup()
    t3.on_trial_start(0, [], _trial("lost"))
    assert t3.retire_lost_runs({"a", "b", "c"}) == ["lost"]
    assert sorted(_runs(uri, "resume")) == ["a", "b", "c", "parent"]
    from mlflow.entities import ViewType

    c = MlflowClient(uri)
    trashed = c.search_runs([c.get_experiment_by_name("resume").experiment_id],
                            run_view_type=ViewType.DELETED_ONLY)
    assert [(r.data.tags[TRIAL_ID_TAG], r.info.status) for r in trashed] == [("lost", "KILLED")]
    assert "lost when the search driver died" in trashed[0].data.tags[STOP_TAG]


def test_a_trial_resumed_from_an_older_checkpoint_logs_its_epochs_again_and_says_so(uri):
    """--resume after epoch_0003's checkpoint was damaged: the trial restarts from epoch 2, its
    first report (epoch 3) carries resumed_from_epoch 2 and damaged_checkpoints 1. MLflow had
    epoch 3 from before the interruption; the retrained epoch 3 is logged too (the later point of
    the step is the run's) and the run's vidtune.resumed tag says what happened."""
    t = _tracker(uri, "older")
    t.setup()
    a = _trial("a")
    t.on_trial_start(0, [], a)
    for epoch in (1, 2, 3):
        t.on_trial_result(0, [], a, _result(epoch))
    t.close(interrupted=True)
    t2 = _tracker(uri, "older")
    t2.setup()
    t2.on_trial_start(0, [], a)
    t2.on_trial_result(0, [], a, _result(3, val_acc=0.42, resumed_from_epoch=2, damaged_checkpoints=1,
                                         timestamp=1_800_000_000))
    t2.on_trial_result(0, [], a, _result(4))
    a.last_result = _result(4)
    t2.on_trial_complete(0, [], a)
    t2.close(interrupted=False)
    run = _runs(uri, "older")["a"]
    history = sorted((m.step, m.timestamp, m.value)
                     for m in MlflowClient(uri).get_metric_history(run.info.run_id, "val_acc"))
    assert [s for s, _, _ in history] == [1, 2, 3, 3, 4] and history[3][2] == 0.42   # step 3's later point
    assert "restarted from its epoch-2 checkpoint" in run.data.tags[RESUMED_TAG]
    assert "1 damaged checkpoint(s) skipped" in run.data.tags[RESUMED_TAG]


def _best(val_acc: float):
    """A best trial with an accuracy only: its F1 and speed are unknown (NaN, not logged)."""
    from vidtune.tune.outputs.results import TrialResult

    return TrialResult(trial_id="a", batch_size=8, lr=1e-3, val_acc=val_acc, val_f1=math.nan,
                       clips_per_s=math.nan, epoch_time_s=math.nan, epochs=1, status="DONE", checkpoint=None)


def test_summary_artifacts_on_the_parent(uri, tmp_path):
    t = _tracker(uri, "summary")
    t.setup()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.pt").write_bytes(b"weights")
    (tmp_path / "trials.csv").write_text("trial_id,val_acc\na,0.7\n")
    (tmp_path / "best_config.json").write_text('{"trial_id": "a"}')
    t.log_summary(files=[tmp_path / "trials.csv", tmp_path / "best_config.json"],
                  best=_best(0.7), best_checkpoint=str(tmp_path / "ckpt"))
    t.close(interrupted=False)
    c = MlflowClient(uri)
    run_id = t.parent_run_id
    names = {a.path for a in c.list_artifacts(run_id)}
    assert {"trials.csv", "best_config.json", "best_checkpoint"} <= names
    assert [a.path for a in c.list_artifacts(run_id, "best_checkpoint")] == ["best_checkpoint/model.pt"]
    metrics = c.get_run(run_id).data.metrics
    assert metrics["best_val_acc"] == 0.7
    assert "best_val_f1" not in metrics and "speed_clips_per_s" not in metrics   # unknown: not logged


def test_a_sqlite_stores_artifacts_go_beside_its_file_not_where_the_search_started(tmp_path, monkeypatch):
    store_dir, elsewhere = tmp_path / "store", tmp_path / "started-here"
    store_dir.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    uri = f"sqlite:///{store_dir / 'm.db'}"
    t = _tracker(uri, "beside")
    t.setup()
    (tmp_path / "trials.csv").write_text("trial_id,val_acc\na,0.7\n")
    t.log_summary(files=[tmp_path / "trials.csv"], best=_best(0.7),
                  best_checkpoint=None)
    t.close(interrupted=False)
    experiment = MlflowClient(uri).get_experiment_by_name("beside")
    assert experiment.artifact_location == (store_dir / "mlartifacts").as_uri()
    assert list((store_dir / "mlartifacts").rglob("trials.csv")) and not (elsewhere / "mlruns").exists()
    assert store.artifact_location("http://127.0.0.1:5000") is None           # a server decides


def test_diverged_trial_fails_with_its_reason_and_every_trial_says_where_it_ran(uri):
    """A diverged trial's run is FAILED, its reason and outcome say diverged; each run is tagged
    with its GPU ids ("" on the CPU) and node (IP) from its first epoch, and reconcile writes
    the same tags for a run whose live epochs MLflow missed."""
    import pandas as pd

    from vidtune.tune.outputs.results import row_from_result

    t = _tracker(uri, "diverged", epochs=3)
    t.setup()
    gpu, cpu = _trial("gpu", lr=1e6), _trial("cpu")
    for tr in (gpu, cpu):
        t.on_trial_start(0, [], tr)
    first = _result(1, gpu_ids="2,3", node_ip="10.0.0.7")
    last = _result(2, diverged=1, val_acc=0.0, clips_per_s=0.0, train_loss=math.nan, gpu_ids="2,3",
                   node_ip="10.0.0.7")
    t.on_trial_result(0, [], gpu, first)
    t.on_trial_result(0, [], gpu, last)
    gpu.last_result = last
    t.on_trial_complete(0, [], gpu)
    tags = _runs(uri, "diverged")["gpu"].data.tags
    assert _runs(uri, "diverged")["gpu"].info.status == "FAILED"
    assert tags[FAILURE_TAG].startswith("diverged: the training loss became nan in epoch 2")
    assert (tags[schema.GPU_IDS_TAG], tags[schema.NODE_TAG], tags[NODE_ID_TAG]) == \
        ("2,3", "10.0.0.7", "node-abc")
    assert "diverged" not in _runs(uri, "diverged")["gpu"].data.metrics

    # reconcile (end of the search): outcome tags, and where the CPU trial ran though no live epoch was logged
    cpu_epochs = [_result(e, gpu_ids="", node_ip="10.0.0.8") for e in (1, 2, 3)]
    rows = []
    for trial_id, epochs in (("gpu", [first, last]), ("cpu", cpu_epochs)):
        result = SimpleNamespace(metrics=epochs[-1], config={"batch_size": 4, "lr": 1e-3}, error=None,
                                 metrics_dataframe=pd.DataFrame(epochs))
        rows.append((row_from_result(result, trial_id=trial_id, epochs=3, finished=True), result, None))
    assert [row.status for row, _, _ in rows] == ["DIVERGED", "DONE"]
    t.reconcile(rows)
    runs = _runs(uri, "diverged")
    assert runs["gpu"].data.tags[schema.OUTCOME_TAG] == "diverged" and \
        runs["gpu"].info.status == "FAILED"
    cpu_tags = runs["cpu"].data.tags
    assert (cpu_tags[schema.GPU_IDS_TAG], cpu_tags[schema.NODE_TAG]) == ("", "10.0.0.8")
    assert cpu_tags[schema.OUTCOME_TAG] == "done" and runs["cpu"].info.status == "FINISHED"
    assert not {"gpu_ids", "node_ip", "diverged"} & set(runs["cpu"].data.metrics)


def test_numeric_metrics_keep_trainer_values_only():
    m = schema.numeric_metrics(_result(3, oom=1, val_loss=math.nan))
    assert math.isnan(m["val_loss"]) and m["lr_current"] == 1e-3 and "lr" not in m
    # constants are params or tags, not metrics: the epoch is the step, batch size a param
    assert not {"epoch", "oom", "batch_size", "reader_failures"} & set(m)
    # where it ran is a tag, even when a dataframe reads the GPU id "0" back as the number 0
    assert not {"diverged", "gpu_ids", "node_ip"} & set(
        schema.numeric_metrics(_result(1, diverged=0, gpu_ids=0, node_ip="10.0.0.1")))
    # a row of Tune's per-epoch dataframe (what reconcile backfills from) flattens the config
    row = schema.numeric_metrics({**_result(2), "config/batch_size": 4, "config/lr": 1e-3})
    assert not any(k.startswith("config") for k in row) and row["val_acc"] == 0.7
    assert "node_id" not in m and "training_iteration" not in m and "config" not in m


# -- store checks (before Ray) ----------------------------------------------------------------

def test_sqlite_store_folder_must_exist(tmp_path):
    store.check_store_uri(f"sqlite:///{tmp_path / 'ok.db'}", "--mlflow-uri")
    with pytest.raises(ConfigError, match=r"--mlflow-uri: the folder .*missing.* does not exist"):
        store.check_store_uri(f"sqlite:///{tmp_path / 'missing' / 'x.db'}", "--mlflow-uri")
    with pytest.raises(ConfigError, match="--mlflow-uri: .*refuses plain file stores"):
        store.check_store_uri(str(tmp_path / "mlruns"), "--mlflow-uri")


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, ok", [(200, True), (503, False)])
def test_tracking_server_health_is_checked(status, ok):
    handler = type("H", (_Health,), {"status": status})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_port}"
        if ok:
            store.check_store_uri(uri, "--mlflow-uri")
        else:
            with pytest.raises(ConfigError, match="--mlflow-uri: .* answered 503 at /health"):
                store.check_store_uri(uri, "--mlflow-uri")
    finally:
        server.shutdown()


def test_each_trial_run_opens_with_one_line_saying_how_it_did():
    from vidtune.tune.outputs.results import TrialResult
    from vidtune.tune.outputs.uncertainty import accuracy_interval
    from vidtune.tune.tracking.runs import trial_description

    row = TrialResult(trial_id="a", batch_size=4, lr=1e-3, val_acc=0.5625, val_f1=0.6,
                   clips_per_s=45.12, epoch_time_s=2.0, epochs=4, status="DONE", checkpoint=None,
                   best_epoch=3)
    low, high = accuracy_interval(0.5625, 32)
    assert trial_description(row, 32, 4) == \
        f"best val_acc 0.562 [{low:.2f}, {high:.2f}] at epoch 3 of 4; done; 45.1 clips/s"
    assert low < 0.5625 - 0.1 and high > 0.5625 + 0.1                 # the interval, not a point
    oom = TrialResult(trial_id="b", batch_size=64, lr=1e-3, val_acc=0.0, val_f1=0.0,
                   clips_per_s=0.0, epoch_time_s=0.0, epochs=1, status="OOM", checkpoint=None)
    assert trial_description(oom, 32, 4) == "no accuracy (out of memory) after 1 of 4 epochs"
