"""MLflow's UI on a search's store, started from Python (a notebook): `vidtune.ui(result)`.

    handle = vidtune.ui(result)     # a SearchResult, a search's folder, or a tracking URI
    handle                          # in a notebook: a link to the search's view in the UI
    handle.stop()                   # also done when the interpreter (the kernel) exits

The same server `vidtune ui` execs (`vidtune.ui_cli`): `mlflow ui --backend-store-uri STORE` from
vidtune's own environment (`vidtune.servers`), here a background process in a session of its own,
so a kernel interrupt (SIGINT to the kernel's process group) stopping a search leaves the UI up,
and `stop()` ends its whole process tree (MLflow starts uvicorn, which starts its worker).

On Colab (`google.colab` importable) the kernel's 127.0.0.1 is not the browser's: the link is
Colab's own proxy of the port (`google.colab.kernel.proxyPort`), and MLflow's host check (its
DNS-rebinding defence) is told to accept the proxy's host names. A tracking server
(`http(s)://...`) is its own UI: nothing is started and the handle links to it.
"""
from __future__ import annotations

import atexit
import errno
import html
import importlib
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import vidtune
from vidtune import servers
from vidtune.errors import ConfigError

START_TIMEOUT_S = 90.0     # a cold start imports MLflow twice (the CLI, then uvicorn's worker): ~5-15 s
STOP_TIMEOUT_S = 10.0      # SIGTERM, then SIGKILL after this
# MLflow 3's server otherwise also starts job-runner processes (GenAI jobs vidtune never uses),
# each importing MLflow: about a minute of two cores after it answers (tests/test_mlflow_server.py).
QUIET_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
# The host names (fnmatch patterns) a browser reaches a Colab kernel's port through, beside
# MLflow's own defaults for loopback: without them the proxied UI answers "Invalid Host header".
COLAB_HOSTS = ("*.googleusercontent.com", "*.googleusercontent.com:*", "*.colab.dev", "*.colab.dev:*")
LOCAL_HOSTS = ("localhost", "localhost:*", "127.0.0.1", "127.0.0.1:*")
COLAB_ORIGINS = ("https://*.googleusercontent.com", "https://*.colab.dev")

_RUNNING: dict[int, MlflowUI] = {}     # port -> the UI this process started there, while it runs


@dataclass(eq=False)
class MlflowUI:
    """A running MLflow UI. `url`: what to open (the search's view when started from a
    SearchResult; on Colab, Colab's proxy of the port); `local_url`: the server as this machine
    reaches it; `store`: the tracking store it shows; `process`: the `mlflow ui` process (None
    for a tracking server, which is its own UI)."""

    url: str
    local_url: str
    store: str
    port: int
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    _stopped: bool = field(default=False, repr=False)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """End the server and every process it started (idempotent). SIGTERM to its process
        group, SIGKILL after STOP_TIMEOUT_S."""
        if self.process is None or self._stopped:
            return      # once only: at interpreter exit, hours later, its pid may be another's
        self._stopped = True
        _signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self.process.pid, signal.SIGKILL)    # its uvicorn worker, should it linger
        self.process.wait(timeout=STOP_TIMEOUT_S)
        if _RUNNING.get(self.port) is self:
            del _RUNNING[self.port]
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the server's output (its log file, removed by `stop()`)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:] if self.log_path else ""
        except OSError:
            return ""

    def __repr__(self) -> str:
        state = "tracking server" if self.process is None else ("running" if self.running else "stopped")
        return f"MlflowUI({self.url}, store={self.store}, {state})"

    def _repr_html_(self) -> str:
        if self.process is not None and not self.running:
            return f"MLflow UI of <code>{html.escape(self.store)}</code>: stopped"
        link = f'<a href="{html.escape(self.url)}" target="_blank" rel="noopener">{html.escape(self.url)}</a>'
        stop = "" if self.process is None else " (<code>.stop()</code> ends it)"
        return f"MLflow UI of <code>{html.escape(self.store)}</code>: {link}{stop}"


def ui(target: Any, port: int = servers.UI_PORT, host: str = servers.HOST, *,
       timeout_s: float = START_TIMEOUT_S) -> MlflowUI:
    """Start MLflow's UI on a search's store in the background and return its handle once it
    answers (at most `timeout_s` seconds). `target`: a SearchResult (its `mlflow_uri`; the link
    opens its `mlflow_url` view), a search's folder (`vidtune.load` reads its store), or a tracking
    URI (`sqlite:///FILE`, `http(s)://...`). Called again with the same store and port while the
    UI runs, returns that UI.

    Raises ConfigError: a `sqlite:///` store that does not exist, a port outside 1..65535 or one
    already in use (named, with what to do); RuntimeError: the server exited or did not answer
    (with the end of its output)."""
    store, view = _store_and_view(target)
    if bad := servers.checked_port(port):
        raise ConfigError("port", bad.split(": ", 2)[-1])
    if store.startswith(("http://", "https://")):
        return MlflowUI(url=_join(store, view), local_url=store, store=store, port=port)
    if missing := servers.missing_store(store):
        raise ConfigError("target", f"{store}: {missing}; give the search's result or its --mlflow-uri")
    store = servers.absolute_store(store)
    if (mine := _RUNNING.get(port)) is not None and mine.running:
        if mine.store == store:
            return mine
        raise ConfigError("port", f"{port} is in use by the MLflow UI of {mine.store} started here; "
                          "call its .stop() or pass another port=")
    if _in_use(host, port):
        raise ConfigError("port", f"{port} on {host} is in use (another MLflow UI or server?); "
                          f"pass another port=, e.g. port={port + 1}, or stop what listens there")
    local = f"http://{_reachable(host)}:{port}"
    colab = _colab_output()
    base = _colab_url(colab, port) if colab is not None else local
    handle = _start(store, host, port, on_colab=colab is not None)
    handle.url, handle.local_url = _join(base, view), local
    try:
        _wait_until_up(handle, timeout_s)
    except BaseException:
        handle.stop()
        raise
    _RUNNING[port] = handle
    atexit.register(handle.stop)
    return handle


def _store_and_view(target: Any) -> tuple[str, str]:
    """(tracking store, the part of a link after the server: "#/experiments/..." or "")."""
    if hasattr(target, "mlflow_uri"):       # a SearchResult
        if not target.mlflow_uri:
            raise ConfigError("target", f"{target!r} records no MLflow store (a search older than its "
                              "search.json?); pass the search's --mlflow-uri, e.g. 'sqlite:///mlruns.db'")
        url = getattr(target, "mlflow_url", None) or ""
        return str(target.mlflow_uri), url[url.index("#"):] if "#" in url else ""
    text = os.fspath(target) if isinstance(target, (str, os.PathLike)) else None
    if text is None:
        raise ConfigError("target", f"got {type(target).__name__}; pass a SearchResult, a search's folder "
                          "or a tracking URI (sqlite:///FILE, http://HOST:PORT)")
    if "://" in text or text.startswith("sqlite:"):
        return text, ""
    if Path(text).is_dir():
        return _store_and_view(vidtune.load(text))
    raise ConfigError("target", f"{text}: no such search folder; pass a SearchResult, a search's folder "
                      "(<storage>/<name>) or a tracking URI (sqlite:///FILE)")


def _start(store: str, host: str, port: int, *, on_colab: bool) -> MlflowUI:
    args = ["ui", "--backend-store-uri", store, "--host", host, "--port", str(port),
            "--workers", "1"]       # one person's browser: MLflow's default 4 cost a core each to start
    if on_colab:
        args += ["--allowed-hosts", ",".join(LOCAL_HOSTS + COLAB_HOSTS),
                 "--cors-allowed-origins", ",".join(COLAB_ORIGINS)]
    fd, log = tempfile.mkstemp(prefix=f"vidtune-mlflow-ui-{port}-", suffix=".log")
    with os.fdopen(fd, "wb") as out:
        # A session of its own: a kernel interrupt (SIGINT to the kernel's group) leaves it up,
        # and stop() signals its group (uvicorn and its worker) at once.
        proc = subprocess.Popen(servers.mlflow_argv(*args), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=servers.child_env({servers.STORE_ENV: store, **QUIET_SERVER_ENV}))
    return MlflowUI(url="", local_url="", store=store, port=port, process=proc, log_path=Path(log))


def _wait_until_up(handle: MlflowUI, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _answers(f"{handle.local_url}/health"):
        if handle.process is not None and handle.process.poll() is not None:
            tail = handle.log_tail()
            if "address already in use" in tail.lower():
                raise ConfigError("port", f"{handle.port} is in use; pass another port=")
            raise RuntimeError(f"MLflow UI on port {handle.port} exited with {handle.process.returncode} "
                               f"before it answered; its output ends:\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"MLflow UI on port {handle.port} did not answer within {timeout_s:.0f} s "
                               f"(a busy machine? pass timeout_s=); its output ends:\n{handle.log_tail()}")
        time.sleep(0.3)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _in_use(host: str, port: int) -> bool:
    """Whether something listens on (host, port): binding as the server will (uvicorn sets
    SO_REUSEADDR, so a closed connection's TIME_WAIT does not count) fails."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def _reachable(host: str) -> str:
    """The address this machine reaches a server listening on `host` at."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)


def _join(base: str, view: str) -> str:
    return base.rstrip("/") + "/" + view if view else base


def _colab_output() -> Any:
    """`google.colab.output` in a Colab kernel, else None."""
    try:   # Colab's own package, there only: imported by name, not a dependency (tests/test_dependencies.py)
        return importlib.import_module("google.colab.output")
    except ImportError:
        return None


def _colab_url(output: Any, port: int) -> str:
    """Colab's proxy URL of the kernel machine's `port` (https://...-PORT-colab.googleusercontent.com/)."""
    return str(output.eval_js(f"google.colab.kernel.proxyPort({port})"))


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)      # its own session: the group id is its pid
    except (ProcessLookupError, PermissionError):
        pass
