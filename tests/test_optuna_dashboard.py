"""The search's Optuna study as optuna-dashboard shows it: each trial carries its vidtune name,
outcome, accuracy with its 95% interval, speed and MLflow run id as user attributes; the
objective is named; the intermediate values are the epochs' own, every one of them; a trial
ASHA stopped is PRUNED; the study is kept beside the MLflow store by default and the summary
prints the command that opens it. The slow test opens the study a real smoke search stored through
optuna-dashboard's own server on 127.0.0.1 and reads its trials over its HTTP API."""
from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna_dashboard import get_note

from vidtune.flags import build
from vidtune.tune.config.options import SPECS, SearchOptions
from vidtune.tune.running.ray_internals import optuna_study
from vidtune.tune.study import dashboard as study
from vidtune.tune.study import space

PATHS = {s.path.rsplit(".", 1)[-1]: s.path for s in SPECS}
DASHBOARD_START_S = 60      # optuna-dashboard answers /api/studies within this, or the test fails


def _opts(**kw) -> SearchOptions:
    return build(SearchOptions, {PATHS[k]: v for k, v in {"batch_sizes": (4, 8), **kw}.items()})


def _result(trial_no: int, cfg: dict, epoch: int, val_acc: float, **kw) -> dict:
    """A flattened Tune result as the searcher gets it: Tune's experiment tag, the config as
    config/<key>, the trainer's report."""
    return {"experiment_tag": f"{trial_no}_batch_size={cfg['batch_size']},lr={cfg['lr']}",
            **{f"config/{k}": v for k, v in cfg.items()}, "epoch": epoch, "training_iteration": epoch,
            "val_acc": val_acc, "steady_clips_per_s": 41.27, "oom": 0, "diverged": 0, **kw}


def test_a_trial_asha_stopped_is_pruned_and_every_trial_is_labelled(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    opts = _opts(optuna_storage=url, epochs=4)
    searcher = space.build_searcher(opts, space.objective_for("val_acc"), study_name="s", val_clips=32)
    searcher.set_search_properties("val_acc", "max", space.param_space(opts))
    done, stopped = searcher.suggest("aaa_00000"), searcher.suggest("aaa_00001")
    for epoch, acc in enumerate((0.5, 0.625, 0.75, 0.71875), start=1):
        searcher.on_trial_result("aaa_00000", _result(1, done, epoch, acc))
    searcher.on_trial_complete("aaa_00000", _result(1, done, 4, 0.71875, mlflow_run_id="run-a"))
    # ASHA's stop: Tune does not hand the searcher the epoch it stopped the trial at
    searcher.on_trial_result("aaa_00001", _result(2, stopped, 1, 0.59375))
    searcher.on_trial_complete("aaa_00001", _result(2, stopped, 2, 0.5625, mlflow_run_id="run-b"))

    loaded = optuna.load_study(study_name="s", storage=url)
    assert loaded.metric_names == ["val_acc"]
    first, second = loaded.trials
    assert first.state == optuna.trial.TrialState.COMPLETE and first.value == 0.71875
    # valued by the epoch ASHA stopped it at, which the searcher reported itself
    assert second.state == optuna.trial.TrialState.PRUNED
    assert second.value == 0.5625 and second.intermediate_values == {1: 0.59375, 2: 0.5625}
    assert first.user_attrs == {"vidtune_trial": study.trial_name("aaa_00000", _result(1, done, 4, 0.7)),
                                "status": "done", "val_acc": 0.7188, "val_acc_95ci": "[0.55, 0.84]",
                                "speed_clips_per_s": 41.27, "mlflow_run_id": "run-a"}
    assert first.user_attrs["vidtune_trial"].startswith(f"t01-bs{done['batch_size']}-lr")
    assert second.user_attrs["status"] == "stopped early" and second.user_attrs["mlflow_run_id"] == "run-b"


def test_intermediate_values_are_each_epochs_own_as_mlflow_logs_them(tmp_path):
    """Tune hands the searcher no `on_trial_result` for the report it stops a trial on (ASHA's
    stop, and ASHA's max_t at a trial's last epoch): the searcher reports that epoch itself, with
    its own value, so the dashboard's curve has every epoch MLflow has, each the same number. A
    completed trial's value is its best epoch's (the table's); a pruned one's is Optuna's, its
    last intermediate value, with the best epoch's in its val_acc attribute."""
    from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY

    from vidtune.trainer.training.history import write_history

    def checkpoint(name: str, accs: tuple[float, ...]) -> str:
        folder = tmp_path / name
        folder.mkdir()
        write_history(folder, {e: {"epoch": e, "val_acc": a} for e, a in enumerate(accs, start=1)})
        return str(folder)

    opts = _opts(epochs=3)
    searcher = space.build_searcher(opts, space.objective_for("val_acc"), study_name="s", val_clips=32)
    searcher.set_search_properties("val_acc", "max", space.param_space(opts))
    done, stopped = searcher.suggest("ccc_00000"), searcher.suggest("ccc_00001")
    for epoch, acc in ((1, 0.5), (2, 0.75)):
        searcher.on_trial_result("ccc_00000", _result(1, done, epoch, acc))
    searcher.on_trial_complete("ccc_00000", _result(1, done, 3, 0.625, **{
        CHECKPOINT_PATH_KEY: checkpoint("a", (0.5, 0.75, 0.625))}))
    searcher.on_trial_result("ccc_00001", _result(2, stopped, 1, 0.59375))
    searcher.on_trial_complete("ccc_00001", _result(2, stopped, 2, 0.5625, **{
        CHECKPOINT_PATH_KEY: checkpoint("b", (0.59375, 0.5625))}))

    first, second = optuna_study(searcher).trials
    assert first.state == optuna.trial.TrialState.COMPLETE and first.value == 0.75
    assert first.intermediate_values == {1: 0.5, 2: 0.75, 3: 0.625}
    assert second.state == optuna.trial.TrialState.PRUNED
    assert second.intermediate_values == {1: 0.59375, 2: 0.5625} and second.value == 0.5625
    assert second.user_attrs["val_acc"] == 0.5938 and second.user_attrs["status"] == "stopped early"


def test_a_running_trial_is_named_in_the_study_from_its_first_epoch():
    opts = _opts(epochs=4)
    searcher = space.build_searcher(opts, space.objective_for("val_acc"), study_name="s")
    searcher.set_search_properties("val_acc", "max", space.param_space(opts))
    cfg = searcher.suggest("bbb_00000")
    searcher.on_trial_result("bbb_00000", _result(3, cfg, 1, 0.5))
    (trial,) = optuna_study(searcher).trials
    assert trial.state == optuna.trial.TrialState.RUNNING
    assert trial.user_attrs["status"] == "running" and trial.user_attrs["vidtune_trial"].startswith("t03-bs")


def test_the_dashboards_notes_name_each_trial_and_carry_the_answer_and_mlflow(tmp_path):
    """optuna-dashboard numbers trials 0, 1, ...: each trial's note opens with its vidtune name
    (from its first epoch), and the study's note, written when the search ends, maps Optuna's
    numbers to the names and MLflow runs, with the answer and the MLflow links."""
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    opts = _opts(optuna_storage=url, epochs=2)
    searcher = space.build_searcher(opts, space.objective_for("val_acc"), study_name="s", val_clips=32)
    searcher.set_search_properties("val_acc", "max", space.param_space(opts))
    first, second = searcher.suggest("ddd_00000"), searcher.suggest("ddd_00001")
    searcher.on_trial_result("ddd_00000", _result(1, first, 1, 0.5))
    searcher.on_trial_complete("ddd_00000", _result(1, first, 2, 0.75, mlflow_run_id="run-a"))
    searcher.on_trial_result("ddd_00001", _result(2, second, 1, 0.5))

    loaded = optuna.load_study(study_name="s", storage=url)
    notes = [get_note(optuna.Trial(loaded, t._trial_id)) for t in loaded.trials]
    names = [t.user_attrs["vidtune_trial"] for t in loaded.trials]
    assert names[0].startswith("t01-bs") and names[1].startswith("t02-bs")
    assert notes[0] == (f"## {names[0]}\n\n"
                        "done; best val_acc 0.750 [0.58, 0.87]; 41.27 clips/s; MLflow run `run-a`\n")
    assert notes[1] == f"## {names[1]}\n\nrunning\n"

    links = ("compare the trials in MLflow: http://127.0.0.1:5000/#/experiments/1/runs?viewId=v\n"
             "  the search's run (answer, trials table, plots): http://127.0.0.1:5000/#/experiments/1/runs/p")
    answer = [f"Best: {names[0]} (batch 4, lr 1.00e-03), val_acc 0.750 [0.58, 0.87] at epoch 2."]
    assert study.save_study_note(url, "s", answer=answer, links=links)
    note = get_note(optuna.load_study(study_name="s", storage=url))
    assert note.startswith("## vidtune search s\n\n" + answer[0] + "\n")
    assert ("- the search's run (answer, trials table, plots): "
            "<http://127.0.0.1:5000/#/experiments/1/runs/p>") in note
    assert f"| 0 | {names[0]} | done | 0.750 | 41.27 | `run-a` |" in note
    assert f"| 1 | {names[1]} | running |  |  |  |" in note
    assert not study.save_study_note(url, "elsewhere", answer=answer, links=links)   # no such study


def test_pareto_objectives_are_named():
    opts = _opts(objective="pareto")
    searcher = space.build_searcher(opts, space.objective_for("pareto"), study_name="p")
    searcher.set_search_properties(None, None, space.param_space(opts))
    assert optuna_study(searcher).metric_names == ["val_acc", "steady_clips_per_s"]


def test_the_study_is_kept_beside_the_mlflow_store_by_default(tmp_path):
    assert study.default_storage(f"sqlite:///{tmp_path}/m/mlruns.db", "/x") == f"sqlite:///{tmp_path}/m/optuna.db"
    assert study.default_storage("http://127.0.0.1:5000", str(tmp_path)) == f"sqlite:///{tmp_path}/optuna.db"
    assert study.default_storage("http://127.0.0.1:5000", "s3://bucket/results") is None


def test_the_dashboard_line_names_a_stored_study_only(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    assert study.dashboard_line(None, "s") == ""
    optuna.create_study(study_name="there", storage=url)
    assert study.dashboard_line(url, "elsewhere") == ""
    line = study.dashboard_line(url, "there")
    command = line.split(": ", 1)[1].split()[0]
    assert command == str(Path(sys.executable).parent / "optuna-dashboard") and Path(command).is_file()
    assert f"{command} {url} --host 127.0.0.1" in line


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_optuna_dashboard_serves_the_smoke_searchs_study_with_its_trials_names(smoke_search):
    """The session's smoke search kept its study beside mlruns.db; the summary printed the
    command; optuna-dashboard's own server, started as printed, lists the study and its trials
    with their vidtune names and MLflow run ids, which are the runs of those names."""
    out = smoke_search
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    storage = f"sqlite:///{out.folder / 'optuna.db'}"
    (line,) = [x for x in out.stdout.splitlines() if "optuna-dashboard" in x]
    command = line.split(": ", 1)[1].split()
    assert command[:2] == [str(Path(sys.executable).parent / "optuna-dashboard"), storage]
    port = _free_port()
    command[command.index("--port") + 1] = str(port)
    server = subprocess.Popen(command, cwd=out.folder, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True, env={k: v for k, v in os.environ.items()
                                                           if k != "VIRTUAL_ENV"})
    try:
        base, deadline, studies = f"http://127.0.0.1:{port}", time.monotonic() + DASHBOARD_START_S, None
        while studies is None:
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, f"optuna-dashboard did not answer in {DASHBOARD_START_S} s"
            try:
                studies = _get(f"{base}/api/studies")["study_summaries"]
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        (summary,) = studies
        detail = _get(f"{base}/api/studies/{summary['study_id']}")
        trials = detail["trials"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    assert summary["study_name"] == out.results.name and detail["objective_names"] == ["val_acc"]
    with open(out.results / "trials.csv", newline="") as f:
        table = {row["name"]: row for row in csv.DictReader(f)}
    attrs = [{a["key"]: a["value"] for a in t["user_attrs"]} for t in trials]
    assert sorted(a["vidtune_trial"] for a in attrs) == sorted(table)
    client = MlflowClient(out.uri)
    # optuna-dashboard's notes name its numbered trials: each trial's page, and the study's table
    assert detail["note"]["body"].startswith(f"## vidtune search {out.results.name}\n")
    for trial, a in zip(trials, attrs, strict=True):
        assert trial["note"]["body"].startswith(f"## {a['vidtune_trial']}\n\ndone; best val_acc ")
        assert f"| {trial['number']} | {a['vidtune_trial']} | done |" in detail["note"]["body"]
        assert trial["state"] == "Complete" and a["status"] == "done"    # 1 epoch of 1: nothing to stop
        assert client.get_run(a["mlflow_run_id"]).info.run_name == a["vidtune_trial"]
        row = table[a["vidtune_trial"]]
        assert float(a["val_acc"]) == pytest.approx(float(row["best_val_acc"]), abs=1e-4)
        low, high = float(row["best_val_acc_low"]), float(row["best_val_acc_high"])
        assert a["val_acc_95ci"] == f"[{low:.2f}, {high:.2f}]"
