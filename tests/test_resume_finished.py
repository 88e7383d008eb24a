"""A finished search resumed changes nothing (issue 58, item 2): `vidtune search --resume` of the
session's finished smoke search (a copy: its folder and MLflow store) prints one line saying it is
finished and where its results are, exits 0, rewrites no file and registers no model version;
`vidtune.search(..., resume=True)` returns its SearchResult without starting Ray. What counts as
finished (`tune.state.finished`: search.json and Tune's saved trials agree), on hand-made states; and the
second guard: the best model is not registered again when that checkpoint already is."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import SMOKE_MODEL
from mlflow.tracking import MlflowClient

import vidtune
from vidtune.trainer.serving import mlflow_model
from vidtune.tune import best_model
from vidtune.tune.config import layout
from vidtune.tune.config.options import parse_options
from vidtune.tune.outputs.found import Summary
from vidtune.tune.preflight import Plan
from vidtune.tune.running.ray_internals import saved_trials
from vidtune.tune.state import finished, search_record

REPO = Path(__file__).resolve().parents[1]


def _files(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `folder`: (mtime in ns, bytes)."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _versions(uri: str) -> list[tuple[str, str, dict]]:
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    found = client.search_model_versions(f"name = '{SMOKE_MODEL}'")
    aliases = client.get_registered_model(SMOKE_MODEL).aliases
    return sorted((v.version, v.run_id, dict(v.tags)) for v in found) + [("aliases", "", dict(aliases))]


@pytest.mark.slow
def test_resuming_the_finished_smoke_search_changes_nothing(smoke_search, shared_ray, tmp_path, no_ray):
    assert smoke_search.returncode == 0, smoke_search.stderr[-3000:]
    copy = tmp_path / "copy"
    shutil.copytree(smoke_search.folder, copy, symlinks=True)
    search = copy / "vidtune-results" / smoke_search.results.name
    uri = f"sqlite:///{copy / 'mlruns.db'}"
    assert [t.status for t in saved_trials(layout.state_path(str(search)))] == ["TERMINATED"] * 2
    before_files, before_versions = _files(copy), _versions(uri)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, str(REPO / "tune" / "search.py"), "--resume", "--name",
                           search.name, "--storage", str(search.parent), "--address", shared_ray,
                           "--mlflow-uri", uri],
                          cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((search / "search.json").read_text())
    assert done.stdout.splitlines() == [
        f"search {search.name} is finished (exit 0): nothing to resume, nothing was changed. Its results: "
        f"{search} (trials.csv, best_config.json, the plots); its best model: {record['model_uri']}"
    ], done.stdout
    assert done.stderr == ""
    assert _files(copy) == before_files     # trials.csv, best_config.json, device_lease.json, Tune's state
    assert _versions(uri) == before_versions    # no version registered, `best` where it was
    assert json.loads((search / "device_lease.json").read_text())     # not emptied
    # the Python API: the finished search's result, Ray never started (no_ray)
    result = vidtune.search(name=search.name, storage=str(search.parent), mlflow_uri=uri, resume=True)
    loaded = vidtune.load(search)
    assert result is not None and repr(result) == repr(loaded) and not result.interrupted
    assert result.model_uri == record["model_uri"] and result.trials.equals(loaded.trials)
    assert _files(copy) == before_files


# -- what counts as finished -------------------------------------------------------------------

def _search(tmp_path: Path, trials: list[tuple[str, str | None]], **record) -> Path:
    """A search folder: search.json (finished, exit 0, unless `record` says otherwise) and Tune's
    newest experiment state with `trials` (status, error text or None), as Ray 2.60 saves them."""
    folder = tmp_path / "s"
    state = Path(layout.state_path(str(folder)))
    state.mkdir(parents=True)
    data = []
    for i, (status, error) in enumerate(trials, 1):
        name = f"t{i:02d}-bs4-lr1e-3"
        if error is not None:
            (state / name).mkdir()
            (state / name / "error.txt").write_text(error)
        data.append([json.dumps({"trial_id": f"id{i}", "status": status, "relative_logdir": name}),
                     json.dumps({"error_filename": "error.txt" if error is not None else None})])
    (state / "experiment_state-2026-12-07_10-00-00.json").write_text(json.dumps({"trial_data": data}))
    search_record.write(folder, search_record.SearchRecord(**{
        "name": "s", "path": str(folder), "objective": "val_acc", "exit_code": 0, "interrupted": False,
        "mlflow_uri": "sqlite:////x/mlruns.db", **record}))
    return folder


OWN_ERROR = "Traceback (most recent call last):\n  ...\nRuntimeError: a broken video\n"
LOST_NODE = ("Traceback (most recent call last):\n  ...\n"
             "ray.exceptions.ActorDiedError: The actor died unexpectedly\n")


@pytest.mark.parametrize("trials, record, is_finished", [
    ([("TERMINATED", None), ("TERMINATED", None)], {}, True),
    # --time-budget ended it with 1 of its --num-samples trials: finished
    ([("TERMINATED", None)], {}, True),
    # a trial that failed by itself fails again the same way: finished
    ([("TERMINATED", None), ("ERROR", OWN_ERROR)], {}, True),
    ([("TERMINATED", None), ("ERROR", LOST_NODE)], {}, False),       # a lost node's: run it again
    ([("TERMINATED", None), ("PENDING", None)], {}, False),          # a driver killed with -9
    ([("TERMINATED", None), ("TERMINATED", None)], {"interrupted": True, "exit_code": 130}, False),
    ([("TERMINATED", None)], {"mlflow_pending": "sqlite:////x/mlruns.db failed (locked)"}, False),
])
def test_finished_means_search_json_and_tunes_saved_trials_agree(tmp_path, trials, record, is_finished):
    folder = _search(tmp_path, trials, **record)
    found = finished.finished_search(str(folder))
    assert (found is not None) == is_finished
    if is_finished:
        assert found == search_record.read(folder)


def test_a_search_without_a_record_or_with_a_damaged_state_is_not_finished(tmp_path):
    folder = _search(tmp_path, [("TERMINATED", None)])
    (folder / search_record.RECORD_FILE).unlink()            # killed before its end, or an older vidtune
    assert finished.finished_search(str(folder)) is None
    folder = _search(tmp_path / "b", [("TERMINATED", None)])
    next(Path(layout.state_path(str(folder))).glob("experiment_state-*.json")).write_text('{"trial_da')
    assert finished.finished_search(str(folder)) is None    # the resume's own checks name the damage
    assert finished.finished_search("s3://bucket/s") is None


# -- the second guard: the same checkpoint is not registered twice -----------------------------

def test_the_best_model_is_not_registered_again_when_its_checkpoint_already_is(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    run = client.create_run(client.create_experiment("search")).info.run_id
    client.create_registered_model("rwf")
    (tmp_path / "model").mkdir()
    client.create_model_version("rwf", source=str(tmp_path / "model"), run_id=run)
    client.set_model_version_tag("rwf", "1", "epoch", "2")      # as tune.tracking.registry tags it
    opts = parse_options(["--smoke-test", "--storage", str(tmp_path), "--name", "s",
                          "--register-model", "rwf", "--mlflow-uri", uri])
    plan = Plan(opts=opts, base=opts.train, storage=str(tmp_path), name="s", demo=False,
                index=SimpleNamespace(val=[SimpleNamespace(path=tmp_path / "a.mp4")]))
    logged = []

    def log_model(*args, **kwargs):
        logged.append(args)
        return mlflow_model.Logged("models:/rwf/2", "m-2", "rwf", 2)

    monkeypatch.setattr(mlflow_model, "log_model", log_model)
    monkeypatch.setattr(best_model, "describe_registered", lambda *a: [])
    tracker = SimpleNamespace(child_runs={"t1": run}, client=client)

    def summary(epoch: int) -> Summary:
        row = SimpleNamespace(trial_id="t1", name="t01-bs4-lr1e-3", checkpoint=str(tmp_path / "ckpt"),
                              checkpoint_epoch=epoch)
        return Summary(objective="val_acc", rows=[], trials=[], trial_states=[], interrupted=False,
                       val_clips=0, answer=[], best=None, checkpoint=row,
                       importance=SimpleNamespace(shares={}, sentence=lambda: ""), files={})

    again = best_model.log_best_model(plan, opts, summary(2), tracker)
    assert not logged and again.uri == "models:/rwf/1"
    assert again.lines[0].startswith("best model: models:/rwf/1 (MLflow's registry: rwf version 1, "
                                     "t01-bs4-lr1e-3's epoch 2)")
    assert again.lines[-1] == "  already registered as version 1 of rwf: not registered again"
    # another epoch of the same trial is another checkpoint: registered
    assert best_model.log_best_model(plan, opts, summary(3), tracker).uri == "models:/rwf/2" and logged
