"""`vidtune.ui`: MLflow's UI on a search's store, started from Python (vidtune/mlflow_ui.py).

The slow tests start a real `mlflow ui` on a small SQLite store, read the store's experiment back
over HTTP, and check that stopping it (or the interpreter exiting) leaves none of its processes;
Colab is a fake `google.colab` module in sys.modules.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import types
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from vidtune import mlflow_ui
from vidtune.errors import ConfigError

EXPERIMENT = "ui-test-experiment"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _experiments(base: str, headers: dict[str, str] | None = None) -> tuple[int, list[str]]:
    status, body = _get(f"{base}/ajax-api/2.0/mlflow/experiments/search?max_results=10", headers)
    names = [e["name"] for e in json.loads(body).get("experiments", [])] if status == 200 else []
    return status, names


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """A SQLite store with one experiment, as a search leaves one."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('ui-store') / 'mlruns.db'}"
    MlflowClient(uri).create_experiment(EXPERIMENT)
    return uri


@pytest.fixture
def fake_colab(monkeypatch):
    """`google.colab.output` as Colab has it, answering `proxyPort` with a proxy URL."""
    calls: list[str] = []
    output = types.ModuleType("google.colab.output")

    def eval_js(script: str):
        calls.append(script)
        port = script.split("(")[1].rstrip(")")
        return f"https://abc123-{port}-colab.googleusercontent.com/"

    output.eval_js = eval_js
    colab = types.ModuleType("google.colab")
    colab.output = output
    google = types.ModuleType("google")
    google.colab = colab
    for name, module in (("google", google), ("google.colab", colab), ("google.colab.output", output)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


# -- without a server ---------------------------------------------------------------------------

def test_a_port_in_use_is_refused_naming_it(tmp_path):
    store = tmp_path / "mlruns.db"
    store.touch()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"port: {port} on 127.0.0.1 is in use.*port="):
            mlflow_ui.ui(f"sqlite:///{store}", port=port)


def test_a_missing_store_and_a_bad_port_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"target: .*nothere.db.*no such store"):
        mlflow_ui.ui(f"sqlite:///{tmp_path / 'nothere.db'}", port=_free_port())
    (tmp_path / "mlruns.db").touch()
    with pytest.raises(ConfigError, match=r"port: got 70000"):
        mlflow_ui.ui(f"sqlite:///{tmp_path / 'mlruns.db'}", port=70000)
    with pytest.raises(ConfigError, match=r"no such search folder"):
        mlflow_ui.ui(str(tmp_path / "no-search"))
    with pytest.raises(ConfigError, match=r"got int"):
        mlflow_ui.ui(5)
    with pytest.raises(ConfigError, match=r"records no MLflow store"):
        mlflow_ui.ui(types.SimpleNamespace(mlflow_uri=None, mlflow_url=None))


def test_a_tracking_server_is_its_own_ui():
    """Nothing is started: the handle links to the server, at the search's view."""
    result = types.SimpleNamespace(mlflow_uri="http://mlflow.internal:5000",
                                   mlflow_url="http://mlflow.internal:5000/#/experiments/3/runs?x=1")
    handle = mlflow_ui.ui(result)
    assert handle.process is None and handle.url == "http://mlflow.internal:5000/#/experiments/3/runs?x=1"
    assert 'href="http://mlflow.internal:5000/#/experiments/3/runs?x=1"' in handle._repr_html_()
    handle.stop()


def test_a_search_folder_is_read_with_vidtune_load(tmp_path, monkeypatch):
    import vidtune

    read = []

    def load(path):
        read.append(path)
        return types.SimpleNamespace(mlflow_uri="http://mlflow.internal:5000",
                                     mlflow_url="http://mlflow.internal:5000/#/experiments/2/runs")

    monkeypatch.setitem(vars(vidtune), "load", load)     # not imported: vidtune imports its API lazily
    handle = mlflow_ui.ui(tmp_path)
    assert read == [str(tmp_path)] and handle.url == "http://mlflow.internal:5000/#/experiments/2/runs"


def test_the_colab_url_is_colabs_proxy_of_the_port(fake_colab):
    output = mlflow_ui._colab_output()
    assert output is sys.modules["google.colab.output"]
    assert mlflow_ui._colab_url(output, 5123) == "https://abc123-5123-colab.googleusercontent.com/"
    assert fake_colab == ["google.colab.kernel.proxyPort(5123)"]


def test_outside_colab_there_is_no_proxy(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.colab", None)     # an import of it raises ImportError
    assert mlflow_ui._colab_output() is None


# -- a real server ------------------------------------------------------------------------------

CHILD = """
import sys, psutil
from vidtune.mlflow_ui import ui
handle = ui(sys.argv[1], port=int(sys.argv[2]))
tree = [handle.process.pid] + [c.pid for c in psutil.Process(handle.process.pid).children(recursive=True)]
print(handle.url, *tree, flush=True)
sys.stdin.read()          # until the test closes it; then this interpreter exits without stop()
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_ui_serves_the_store_and_ends_with_the_interpreter(store):
    """Started in another interpreter: the UI answers with the store's experiment; when that
    interpreter exits (as a notebook kernel shuts down), every process of the UI ends with it."""
    port = _free_port()
    child = subprocess.Popen([sys.executable, "-c", CHILD, store, str(port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        assert line, f"vidtune.ui did not start: {child.stderr.read() if child.poll() is not None else ''}"
        url, tree = line[0], [int(pid) for pid in line[1:]]
        assert url == f"http://127.0.0.1:{port}" and len(tree) >= 2     # mlflow, uvicorn (and its worker)
        status, page = _get(url)
        assert status == 200 and b"<html" in page.lower()
        assert _experiments(url) == (200, ["ui-test-experiment", "Default"])
        with pytest.raises(ConfigError, match=rf"port: {port} on 127.0.0.1 is in use"):
            mlflow_ui.ui(store, port=port)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    gone, alive = psutil.wait_procs([p for p in map(_process, tree) if p], timeout=20)
    assert not alive, f"still running after the interpreter exited: {alive}"
    assert not mlflow_ui._in_use("127.0.0.1", port)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_on_colab_the_link_is_the_proxy_and_its_host_is_accepted(store, fake_colab):
    result = types.SimpleNamespace(mlflow_uri=store, mlflow_url="http://127.0.0.1:5000/#/experiments/1/runs")
    port = _free_port()
    handle = mlflow_ui.ui(result, port=port)
    try:
        proxy = f"https://abc123-{port}-colab.googleusercontent.com"
        assert handle.url == f"{proxy}/#/experiments/1/runs"
        assert f'href="{proxy}/#/experiments/1/runs"' in handle._repr_html_()
        assert mlflow_ui.ui(store, port=port) is handle        # a cell run again: the same UI
        # The browser's request arrives through Colab's proxy, under the proxy's host name
        host = {"Host": f"abc123-{port}-colab.googleusercontent.com"}
        assert _experiments(handle.local_url, host)[0] == 200
        assert _experiments(handle.local_url, {"Host": "evil.example.com"})[0] == 403   # still checked
        tree = [handle.process] + psutil.Process(handle.process.pid).children(recursive=True)
    finally:
        handle.stop()
    assert not handle.running and "stopped" in repr(handle)
    gone, alive = psutil.wait_procs(tree, timeout=20)
    assert not alive, f"still running after stop(): {alive}"
    assert not Path(str(handle.log_path)).exists()


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
