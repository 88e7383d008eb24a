"""After a search, every command its summary prints runs as printed in a shell where the venv is
not activated (`env -i`, PATH without the venv's bin folder), and the served model answers as its
validation did: the session's smoke search (conftest's `smoke_search`) prints the lines; each is
run verbatim (a free --port appended to the servers'); the UI page answers over HTTP with the
search's experiment, the model server answers /ping and scores the validation videos, and its
accuracy on them at P >= 0.5 is the val_acc the search reported for the registered checkpoint,
as is the pyfunc model's loaded in this process (`trainer.serving.scoring_rule`)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
from conftest import SMOKE_MODEL
from test_serving_errors import CLEAN_PATH as CLEAN_PATH_FOR_TESTS
from test_serving_errors import clean_shell, free_port, invoke, served

from vidtune import servers
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index
from vidtune.trainer.serving.scoring_rule import THRESHOLD


@pytest.fixture(scope="module")
def printed(smoke_search, synthetic_root) -> SimpleNamespace:
    """The lines the smoke search's summary printed for a user to paste, its reported val_acc
    for the registered checkpoint, and the validation videos with their labels."""
    out = smoke_search
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    stdout = out.stdout
    ui = re.findall(r"\(after: (\S+ ui --mlflow-uri \S+)\)", stdout)
    serve = re.search(r"^  serve it: (.+?)   \(http://", stdout, flags=re.M)
    score = re.search(r"^  score videos: (.+)$", stdout, flags=re.M)
    train = re.search(r"^train it again: (.+)$", stdout, flags=re.M)
    assert ui and serve and score and train, stdout[-4000:]
    best = json.loads((out.results / "best_config.json").read_text())
    index = build_index(DataConfig(root=str(synthetic_root)))
    return SimpleNamespace(ui=set(ui), serve=serve.group(1), score=score.group(1), train=train.group(1),
                           val_acc=best["checkpoint_val_acc"], folder=out.folder,
                           videos=[str(v.path) for v in index.val], labels=[int(v.label) for v in index.val])


def run_clean(line: str, folder: Path, timeout: int) -> subprocess.CompletedProcess:
    """`line` run verbatim in `clean_shell` from `folder`, its output captured."""
    return subprocess.run(clean_shell(line, folder), capture_output=True, text=True, timeout=timeout,
                          cwd=folder)


def accuracy(probabilities: list[float], labels: list[int]) -> float:
    return sum((p >= THRESHOLD) == bool(y) for p, y in zip(probabilities, labels, strict=True)) / len(labels)


@pytest.mark.slow
def test_printed_commands_name_the_venvs_vidtune(printed):
    for line in (*printed.ui, printed.serve, printed.score, printed.train):
        assert line.startswith(servers.vidtune_command() + " "), line


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_printed_ui_line_opens_the_searchs_experiment(printed, tmp_path):
    (line,) = printed.ui              # the runs-table and compare links' hints: one command
    port = free_port()
    with served(f"{line} --port {port}", port, tmp_path, ready="/") as base:
        with urllib.request.urlopen(base + "/", timeout=30) as page:
            assert page.status == 200 and "<title>MLflow</title>" in page.read().decode()
        search = urllib.request.Request(f"{base}/ajax-api/2.0/mlflow/experiments/search",
                                        data=json.dumps({"max_results": 50}).encode(),
                                        headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(search, timeout=30) as answer:
            names = [e["name"] for e in json.loads(answer.read())["experiments"]]
        assert any(name != "Default" for name in names), names


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_printed_serve_line_answers_with_the_reported_accuracy(printed, tmp_path):
    # the pyfunc model in this process: validation's accuracy on validation's videos
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{printed.folder / 'mlruns.db'}")
    try:
        local = mlflow.pyfunc.load_model(f"models:/{SMOKE_MODEL}/1").predict(printed.videos)
    finally:
        mlflow.set_tracking_uri(before)
    assert accuracy(local, printed.labels) == pytest.approx(printed.val_acc, abs=1e-9)
    port = free_port()
    with served(f"{printed.serve} --port {port}", port, tmp_path) as base:
        status, body = invoke(base, printed.videos)
    assert status == 200, body
    assert body["predictions"] == pytest.approx(local, abs=1e-6)
    assert accuracy(body["predictions"], printed.labels) == pytest.approx(printed.val_acc, abs=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_printed_predict_and_train_lines_run_without_the_venv(printed, tmp_path):
    videos = printed.videos[:2]
    line = printed.score.replace(" VIDEO ...", " " + shlex.join(videos))
    done = run_clean(line, tmp_path, 300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [ln.split(":", 1)[0] for ln in done.stdout.splitlines() if ": P(" in ln] == videos
    # training again takes minutes: the line's command is found and reads its flags
    done = run_clean(f"{printed.train} --help", tmp_path, 120)
    assert done.returncode == 0 and "usage: vidtune train" in done.stdout, done.stderr[-3000:]


# -- what `vidtune ui` / `vidtune serve` refuse, before any server starts ----------------------

def test_the_childs_path_starts_with_the_venvs_bin_folder():
    env = servers.child_env({"X": "1"}, base={"PATH": CLEAN_PATH_FOR_TESTS})
    assert env["PATH"].split(os.pathsep) == [servers.bin_dir(), *CLEAN_PATH_FOR_TESTS.split(os.pathsep)]
    assert env["X"] == "1" and (Path(servers.bin_dir()) / "uvicorn").is_file()


@pytest.mark.parametrize("command", ["ui", "serve models:/vidtune/1"])
def test_a_store_that_is_not_there_is_named_not_created(tmp_path, command):
    db = tmp_path / "mlruns.db"
    line = f"{servers.vidtune_command()} {command} --mlflow-uri sqlite:///{db}"
    done = run_clean(line, tmp_path, 60)
    assert done.returncode == 2 and f"--mlflow-uri: sqlite:///{db}: no such store" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not db.exists()


def test_a_registered_model_that_is_not_there_is_named(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    MlflowClient(uri).create_registered_model("vidtune")
    line = f"{servers.vidtune_command()} serve models:/vidtune/4 --mlflow-uri {uri}"
    done = run_clean(line, tmp_path, 120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"error: MODEL: model 'vidtune' has no version 4 in {uri}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_folder_without_a_model_is_named(tmp_path, capsys):
    from vidtune.trainer.serving import serve_cli

    assert serve_cli.main([str(tmp_path)]) == 2
    assert f"error: MODEL: {tmp_path}: no MLflow model there" in capsys.readouterr().err


# -- a model whose files are gone: one line, exit 2, before any line says it serves --------------

@pytest.fixture(scope="module")
def gone_models(tmp_path_factory) -> SimpleNamespace:
    """A tiny (untrained) model registered as `m` version 1 in a store of its own, and a saved
    model's folder copied from its files; then the files taken away: the registered version's
    artifact folder deleted, the folder's checkpoint removed (`whole` keeps an intact copy)."""
    import shutil

    import torch
    from mlflow.tracking import MlflowClient

    from vidtune.datasets.synthetic import generate
    from vidtune.trainer.models.registry import build_model, get_spec
    from vidtune.trainer.serving import mlflow_model
    from vidtune.trainer.training.checkpointing import save_checkpoint
    from vidtune.trainer.training.config import TrainConfig

    tmp = tmp_path_factory.mktemp("gone-model")
    torch.manual_seed(0)
    network = build_model("tiny")
    optimizer = torch.optim.AdamW(network.parameters())
    save_checkpoint(tmp / "ckpt", model=network, optimizer=optimizer,
                    scaler=torch.amp.GradScaler("cpu", enabled=False),
                    scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), epoch=1,
                    config=TrainConfig().to_dict(), spec=get_spec("tiny"),
                    class_names={1: "Fight", 0: "NonFight"})
    video = next(generate(tmp / "videos", videos=4, workers=1).rglob("*.mp4"))
    uri = f"sqlite:///{tmp / 'mlruns.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("search", artifact_location=(tmp / "artifacts").as_uri())
    run = client.create_run(experiment, run_name="t01-bs4-lr1e-3")
    logged = mlflow_model.log_model(uri, run.info.run_id, tmp / "ckpt", example_video=video,
                                    registered_name="m")
    files = next((tmp / "artifacts").rglob("MLmodel")).parent
    shutil.copytree(files, tmp / "whole")
    shutil.copytree(files, tmp / "folder")
    (tmp / "folder" / "artifacts" / "checkpoint.pt").unlink()
    shutil.rmtree(files)
    return SimpleNamespace(uri=uri, model=logged.uri, files=files, folder=tmp / "folder", whole=tmp / "whole")


def test_a_model_folder_whose_checkpoint_is_gone_is_one_line_before_serving(gone_models, monkeypatch, capsys):
    """`vidtune serve FOLDER`: the model is loaded before the server is started or named; a whole
    folder is then served (the server's start stands in here)."""
    from vidtune.trainer.serving import serve_cli, serve_model

    started = []
    monkeypatch.setattr(servers, "exec_python", lambda module, args: serve_model.main(args))
    monkeypatch.setattr(servers, "exec_mlflow", lambda args, env: started.append(args) or 0)
    assert serve_cli.main([str(gone_models.folder), "--mlflow-uri", gone_models.uri]) == 2
    out, err = capsys.readouterr()
    assert not started and "serving" not in out, out
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: MODEL: {gone_models.folder} cannot be loaded (checkpoint "), err
    assert "copy the whole model folder again" in err
    assert serve_cli.main([str(gone_models.whole), "--mlflow-uri", gone_models.uri]) == 0
    assert started and capsys.readouterr().out.startswith(f"serving {gone_models.whole} at http://")


def test_a_registered_model_whose_files_were_deleted_is_one_line_exit_2(gone_models, tmp_path):
    line = f"{servers.vidtune_command()} serve {gone_models.model} --mlflow-uri {gone_models.uri}"
    done = run_clean(line, tmp_path, 120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr[-3000:]
    assert done.stderr.startswith(f"error: MODEL: {gone_models.model} cannot be loaded ("), done.stderr
    assert f"the files of m version 1 in {gone_models.files} are gone" in done.stderr
