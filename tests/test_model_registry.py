"""The best model in MLflow's Model Registry: a real smoke search (joined to the test session's
Ray) logs its best checkpoint as a two-flavour MLflow model and registers it; the registered model
loads by `models:/` URI and scores two generated videos exactly as `vidtune predict` does on the
best checkpoint; `mlflow models serve` of it answers a scoring request. Then the flags: a name
the registry refuses is refused before the search runs; a model that cannot be logged costs the
search one line, never its results or its exit code."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import mlflow
import mlflow.pytorch
import pytest
import torch
from conftest import SMOKE_MODEL
from mlflow.exceptions import MlflowException
from mlflow.models import Model
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import _validate_model_name

from vidtune import servers
from vidtune.flags import ConfigError
from vidtune.trainer.models.registry import build_model, get_spec
from vidtune.trainer.serving import mlflow_model, predict, scoring
from vidtune.trainer.training.checkpointing import save_checkpoint
from vidtune.trainer.training.config import TrainConfig
from vidtune.tune import best_model
from vidtune.tune.config.options import parse_options
from vidtune.tune.outputs.found import Summary
from vidtune.tune.preflight import Plan
from vidtune.tune.summary import print_summary
from vidtune.tune.tracking.store import check_model_name, model_name_problem

REPO = Path(__file__).resolve().parents[1]
SEARCH = [sys.executable, str(REPO / "tune" / "search.py")]
NAME = SMOKE_MODEL       # the session smoke search registers its best model under it
SERVE_START_S = 180        # `mlflow models serve` answers /ping within this, or the test fails


@pytest.fixture(scope="module")
def searched(smoke_search, synthetic_root) -> SimpleNamespace:
    """The session's `vidtune search --smoke-test` (conftest's `smoke_search`, registering its
    model under NAME): its folder, console, store and best checkpoint, and two of its validation
    videos."""
    out = smoke_search
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return SimpleNamespace(folder=out.folder, stdout=out.stdout, uri=out.uri, checkpoint=out.checkpoint,
                           trial=out.trial,
                           videos=[str(v) for v in sorted((synthetic_root / "val").rglob("*.mp4"))[:2]])


@pytest.fixture
def tracking(searched):
    """MLflow's fluent API (models:/ URIs) on the search's store for the test, then back."""
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(searched.uri)
    yield searched.uri
    mlflow.set_tracking_uri(before)


def _predicted(capsys, argv: list[str]) -> list[str]:
    """The lines `vidtune predict argv` prints for the videos (exit code 0)."""
    assert predict.main(argv) == 0, capsys.readouterr().err
    return [line for line in capsys.readouterr().out.splitlines() if ": P(" in line]


@pytest.mark.slow
def test_the_registered_model_scores_videos_as_predict_does_on_the_best_checkpoint(searched, tracking,
                                                                                   capsys):
    uri = f"models:/{NAME}/1"
    assert f"best model: {uri} (MLflow's registry: {NAME} version 1, {searched.trial}'s epoch 1)" \
        in searched.stdout
    db = searched.folder / "mlruns.db"
    serve = f"  serve it: {servers.vidtune_command()} serve {uri} --mlflow-uri sqlite:///{db}"
    assert serve in searched.stdout     # run as printed: tests/test_serve_commands.py
    # registered from the best trial's own run, which the logged model keeps the params of
    client = MlflowClient(searched.uri)
    version = client.get_model_version(NAME, "1")
    run = client.get_run(version.run_id)
    assert run.info.run_name == searched.trial and run.data.params["batch_size"] == "4"
    model = Model.load(uri)
    assert {"python_function", "pytorch"} <= set(model.flavors)
    assert model.signature.inputs.to_dict() == [{"type": "string", "required": True}]
    assert model.signature.outputs.to_dict() == [{"type": "double", "required": True}]
    assert model.saved_input_example_info is not None

    # the python_function model: the probabilities `vidtune predict` computes on the best checkpoint
    scored = mlflow.pyfunc.load_model(uri).predict(searched.videos)
    predictor = scoring.Predictor.from_checkpoint(searched.checkpoint, torch.device("cpu"))
    expected = [mlflow_model.video_probability(predictor, Path(v), 1.0, 8) for v in searched.videos]
    assert scored == pytest.approx(expected, abs=1e-6)
    printed = _predicted(capsys, ["--checkpoint", searched.checkpoint, *searched.videos])
    shown = [float(re.search(r"(?:max|\)) ([0-9.]+)", line).group(1)) for line in printed]
    assert shown == [round(p, 3) for p in scored]
    # ... and `vidtune predict` reads the registered model itself, to the same lines
    registered = _predicted(capsys, ["--checkpoint", uri, "--mlflow-uri", searched.uri, *searched.videos])
    assert registered == printed

    # the pytorch flavour: the trained network itself
    network = mlflow.pytorch.load_model(uri)
    clips = torch.randn(3, 3, predictor.num_frames, predictor.height, predictor.width)
    with torch.inference_mode():
        torch.testing.assert_close(network(clips), predictor.model(clips), rtol=1e-4, atol=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_mlflow_serves_the_registered_model(searched, tracking, tmp_path):
    port = _free_port()
    bin_dir = str(Path(sys.executable).parent)     # mlflow and the uvicorn it starts
    env = {**os.environ, "MLFLOW_TRACKING_URI": searched.uri,
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    log_file = tmp_path / "serve.log"
    log = open(log_file, "w")
    server = subprocess.Popen([str(Path(bin_dir) / "mlflow"), "models", "serve", "-m", f"models:/{NAME}/1",
                               "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVE_START_S
        while True:
            assert server.poll() is None, log_file.read_text()[-3000:]
            assert time.monotonic() < deadline, f"silent {SERVE_START_S} s: {log_file.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations",
                                         data=json.dumps({"inputs": searched.videos}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            served = json.loads(answer.read())["predictions"]
        assert served == pytest.approx(mlflow.pyfunc.load_model(f"models:/{NAME}/1").predict(searched.videos),
                                       abs=1e-6)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        log.close()


# -- the flags, and a model that cannot be logged (no Ray, no search) --------------------------

@pytest.mark.parametrize("name", ["vidtune", "rwf-mvit_v2", "a..b", "with space", "é", "a/b", "a:b", "",
                                  "  ", ".", "..", "..x", "x.."])
def test_the_name_rule_is_mlflows(name):
    try:
        _validate_model_name(name)
        accepted = True
    except MlflowException:
        accepted = False
    assert (model_name_problem(name) is None) == accepted, name


def test_the_model_is_registered_under_the_experiment_unless_told_otherwise():
    assert parse_options([]).tracking.model_name == "vidtune"
    assert parse_options(["--experiment", "rwf"]).tracking.model_name == "rwf"
    assert parse_options(["--register-model", "best-rwf"]).tracking.model_name == "best-rwf"
    assert parse_options(["--no-register-model"]).tracking.model_name is None
    assert parse_options(["--no-log-model"]).tracking.model_name is None
    assert parse_options(["--no-register-model"]).tracking.log_model


@pytest.mark.parametrize("argv, flag", [(["--register-model", "x", "--no-register-model"],
                                         "--register-model/--no-register-model"),
                                        (["--register-model", "x", "--no-log-model"],
                                         "--register-model/--no-log-model")])
def test_registry_switches_that_disagree_are_refused_with_the_options(argv, flag):
    with pytest.raises(ConfigError) as e:
        parse_options(argv)
    assert e.value.flag == flag
    assert str(e.value).startswith(f"{flag}: ")


@pytest.mark.parametrize("argv, flag", [(["--register-model", "rwf/mvit"], "--register-model"),
                                        (["--experiment", "team:rwf"], "--experiment")])
def test_a_name_the_registry_refuses_is_refused_before_the_search(argv, flag, tmp_path):
    """The name is MLflow's rule (`tune.tracking.store`), checked by the search's preflight: the
    command stops with exit 2 and one line naming the flag, before any data is read."""
    with pytest.raises(ConfigError) as e:
        check_model_name(parse_options(argv).tracking)
    assert e.value.flag == flag and str(e.value).startswith(f"{flag}: ")
    (tmp_path / "no-videos-here").mkdir()       # the folder exists: its videos are read after the check
    out = subprocess.run([sys.executable, "-m", "vidtune.tune.search", *argv, "--dry-run",
                          "--data", str(tmp_path / "no-videos-here"), "--storage", str(tmp_path),
                          "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"vidtune search: error: {flag}: "), out.stderr


def test_a_model_that_cannot_be_logged_costs_one_line_not_the_results(tmp_path, monkeypatch, capsys):
    opts = parse_options(["--smoke-test", "--storage", str(tmp_path), "--name", "s"])
    plan = Plan(opts=opts, base=opts.train, storage=str(tmp_path), name="s", demo=False,
                index=SimpleNamespace(val=[SimpleNamespace(path=tmp_path / "a.mp4")]))
    row = SimpleNamespace(trial_id="t1", name="t01-bs4-lr1e-3", checkpoint=str(tmp_path / "ckpt"),
                          checkpoint_epoch=1)
    summary = Summary(objective="val_acc", rows=[], trials=[], trial_states=[], interrupted=False,
                      val_clips=0, answer=["Best: t01-bs4-lr1e-3"], best=None, checkpoint=row,
                      importance=SimpleNamespace(shares={}, sentence=lambda: ""), files={})
    tracker = SimpleNamespace(child_runs={"t1": "run-1"})
    no_log = parse_options(["--smoke-test", "--storage", str(tmp_path), "--name", "s", "--no-log-model"])
    # nothing tried, nothing said
    assert best_model.log_best_model(plan, no_log, summary, tracker) == best_model.BestModel()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mlflow_model, "log_model", full_disk)
    lines = best_model.log_best_model(plan, opts, summary, tracker).lines
    assert lines == ["best model: not logged in MLflow ([Errno 28] No space left on device); the results and "
                     "the best checkpoint above stand"]
    # a trial without a run (the store lost it): said the same way, nothing tried
    assert "trial t01-bs4-lr1e-3 has no MLflow run" in best_model.log_best_model(
        plan, opts, summary, SimpleNamespace(child_runs={})).lines[0]
    # the summary prints the line and exits as it would have without it
    codes = [print_summary(plan, opts, summary, mlflow_links="", pending=None, model=m) for m in ([], lines)]
    assert codes[0] == codes[1]
    assert capsys.readouterr().out.count(lines[0]) == 1


def test_a_best_checkpoint_on_remote_storage_is_downloaded_and_logged(tmp_path, monkeypatch):
    """--storage s3://... (cluster.yaml's): the checkpoint is fetched to a local folder for the
    block that logs it (a file:// URI stands in for the bucket: the same pyarrow path), and that
    folder is gone afterwards; the model is logged, not skipped."""
    bucket = tmp_path / "bucket" / "epoch_0002"
    bucket.mkdir(parents=True)
    (bucket / "checkpoint.pt").write_bytes(b"weights")
    opts = parse_options(["--smoke-test", "--storage", str(tmp_path), "--name", "s"])
    plan = Plan(opts=opts, base=opts.train, storage=str(tmp_path), name="s", demo=False,
                index=SimpleNamespace(val=[SimpleNamespace(path=tmp_path / "a.mp4")]))
    row = SimpleNamespace(trial_id="t1", name="t01", checkpoint=f"file://{bucket}", checkpoint_epoch=2)
    summary = Summary(objective="val_acc", rows=[], trials=[], trial_states=[], interrupted=False,
                      val_clips=0, answer=[], best=None, checkpoint=row,
                      importance=SimpleNamespace(shares={}, sentence=lambda: ""), files={})
    seen = {}

    def log_model(uri, run_id, folder, **kwargs):
        seen["folder"], seen["files"] = folder, sorted(p.name for p in Path(folder).iterdir())
        return mlflow_model.Logged("models:/m-1", "m-1")    # not registered: no version to describe

    monkeypatch.setattr(mlflow_model, "log_model", log_model)
    monkeypatch.setattr(mlflow_model, "usage_lines", lambda logged, uri, trial: [f"best model: {trial}"])
    logged = best_model.log_best_model(plan, opts, summary, SimpleNamespace(child_runs={"t1": "run-1"}))
    assert logged == best_model.BestModel(["best model: t01's epoch 2"], "models:/m-1")
    lines = logged.lines
    assert lines == ["best model: t01's epoch 2"] and seen["files"] == ["checkpoint.pt"]
    assert "://" not in seen["folder"]


def test_unregistered_and_untraceable_the_video_model_is_whole(synthetic_root, tmp_path, monkeypatch):
    """--no-register-model: logged in the trial's run (its experiment, not the store's Default),
    loadable by its models:/<id> URI; a network torch.export cannot trace leaves the
    python_function flavour whole and says why in the model's metadata."""
    torch.manual_seed(0)
    network = build_model("tiny")
    optimizer = torch.optim.AdamW(network.parameters())
    save_checkpoint(tmp_path / "ckpt", model=network, optimizer=optimizer,
                    scaler=torch.amp.GradScaler("cpu", enabled=False),
                    scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), epoch=1,
                    config=TrainConfig().to_dict(), spec=get_spec("tiny"),
                    class_names={1: "Fight", 0: "NonFight"})
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("search", artifact_location=(tmp_path / "artifacts").as_uri())
    run = client.create_run(experiment, run_name="t01-bs4-lr1e-3")

    def untraceable(*args, **kwargs):
        raise RuntimeError("torch.export: data-dependent control flow")

    monkeypatch.setattr(mlflow_model, "add_torch_flavour", untraceable)
    video = str(next((synthetic_root / "val").rglob("*.mp4")))
    logged = mlflow_model.log_model(uri, run.info.run_id, tmp_path / "ckpt", example_video=video)
    assert logged.name is None and logged.uri == f"models:/{logged.model_id}"
    assert client.get_logged_model(logged.model_id).experiment_id == experiment
    assert not client.search_registered_models()
    first_line = mlflow_model.usage_lines(logged, uri)[0]
    assert first_line.startswith(f"best model: {logged.uri} (logged in MLflow, not registered)")
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        saved = Model.load(logged.uri)
        scored = mlflow.pyfunc.load_model(logged.uri).predict([video])
    finally:
        mlflow.set_tracking_uri(before)
    assert "pytorch" not in saved.flavors
    assert saved.metadata[mlflow_model.NO_TORCH_KEY] == \
        "RuntimeError: torch.export: data-dependent control flow"
    predictor = scoring.Predictor.from_checkpoint(tmp_path / "ckpt", torch.device("cpu"))
    assert scored == pytest.approx([mlflow_model.video_probability(predictor, Path(video), 1.0, 8)], abs=1e-6)
    # only what scoring reads travels with the model: no optimizer state
    kept = torch.load(next((tmp_path / "artifacts").rglob("checkpoint.pt")), weights_only=True)
    assert set(kept) == set(mlflow_model.KEPT)
