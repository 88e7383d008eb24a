"""A search against an MLflow tracking server, as on the cluster (`cluster.yaml` starts one on the
head): runs, metrics and artifacts arrive through the server's REST API, and an unreachable
server stops the search before anything starts, naming `--mlflow-uri`.

The server is a real `mlflow server` subprocess on loopback with a SQLite store and a served
artifacts folder in a temporary directory.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVER_START_TIMEOUT_S = 120      # a cold `mlflow server` imports a lot; bounded, not a speed check


def _free_port() -> int:
    """A port nothing listens on (the OS picks an unused one; closed again at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


class MlflowServer:
    """An `mlflow server` subprocess on 127.0.0.1; `url` once `wait_healthy()` has returned."""

    def __init__(self, root: Path):
        self.root = root
        self.artifacts = root / "artifacts"
        self.url = f"http://127.0.0.1:{_free_port()}"
        self._log = open(root / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--artifacts-destination", str(self.artifacts),
             "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], "--workers", "1"],
            cwd=root, stdout=self._log, stderr=subprocess.STDOUT,
            # MLflow 3's server otherwise also starts ~8 job-runner processes (GenAI jobs vidtune
            # never uses), each importing MLflow: about a minute of both cores right after /health.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )

    def wait_healthy(self) -> str:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not _healthy(self.url):
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not healthy after {SERVER_START_TIMEOUT_S} s:\n{self.log_tail()}")
            time.sleep(0.5)
        return self.url

    def log_tail(self) -> str:
        return (self.root / "server.log").read_text()[-3000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
        self._log.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A started server. Not waited for here: it boots while the other fixtures (dataset, Ray)
    are made, and the test waits for /health (bounded) when it needs it."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        server.stop()


def test_unreachable_tracking_server_fails_before_ray_starts(tmp_path, monkeypatch, capsys):
    from vidtune.tune import runner
    from vidtune.tune.search import main

    def no_ray(*args, **kwargs):
        raise AssertionError("the search started Ray although its tracking server is unreachable")

    monkeypatch.setattr(runner, "init_ray", no_ray)
    closed = f"http://127.0.0.1:{_free_port()}"
    code = main(["--data", str(tmp_path), "--mlflow-uri", closed, "--storage", str(tmp_path / "results"),
                 "--num-samples", "1", "--epochs", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--mlflow-uri" in err and closed in err, err
    assert "mlflow server" in err, err      # says what to do
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
def test_search_records_runs_and_artifacts_through_the_server(mlflow_server, ray_session, synthetic_root,
                                                              tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from vidtune.tune.search import main

    url, artifacts_dir = mlflow_server.wait_healthy(), mlflow_server.artifacts
    code = main([
        "--data", str(synthetic_root), "--model", "tiny",
        "--num-samples", "1", "--epochs", "1", "--batch-sizes", "4", "--no-early-stop",
        "--num-frames", "8", "--height", "64", "--width", "64", "--loader-workers", "0",
        "--storage", str(tmp_path / "results"), "--name", "served",
        "--mlflow-uri", url, "--experiment", "served-search",
    ])
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err[-3000:]
    assert url in out.out       # the closing hint points at the server, not at a local file

    client = MlflowClient(tracking_uri=url)
    experiment = client.get_experiment_by_name("served-search")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 1
    parent, child = parents[0], children[0]
    assert parent.info.status == "FINISHED" and child.info.status == "FINISHED"
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert child.data.tags.get("vidtune.trial_id") and child.data.tags.get("vidtune.node_id")
    assert child.data.params["batch_size"] == "4"
    assert float(child.data.params["lr"]) > 0
    history = client.get_metric_history(child.info.run_id, "val_acc")
    assert [m.step for m in history] == [1]
    for key in ("val_f1", "val_recall", "val_auc", "clips_per_s", "epoch_time_s", "peak_mem_mb",
                "data_wait_frac"):
        assert key in child.data.metrics, key

    # The parent's summary artifacts went through the server into its artifact store...
    names = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"trials.csv", "accuracy_vs_speed.png", "best_config.json"} <= names, names
    stored = {p.name for p in artifacts_dir.rglob("*") if p.is_file()}
    assert {"trials.csv", "best_config.json"} <= stored, stored
    # ...and come back from it.
    local = client.download_artifacts(parent.info.run_id, "best_config.json", str(tmp_path))
    best = json.loads(Path(local).read_text())
    assert best["batch_size"] == 4 and best["trial_id"] == child.data.tags["vidtune.trial_id"]
