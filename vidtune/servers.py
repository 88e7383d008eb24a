"""MLflow's UI and model server started from the environment vidtune is installed in, whatever
the shell's PATH: what `vidtune ui` (`vidtune.ui_cli`) and `vidtune serve`
(`vidtune.trainer.serving.serve_cli`) run, and the lines the search's summary prints to run them.

MLflow's `mlflow ui` and `mlflow models serve` start `uvicorn` (and gunicorn, huey) by name from
PATH; in a shell where the venv is not activated neither `mlflow` nor `uvicorn` is there and the
server ends in "exec: uvicorn: not found". So the child runs this interpreter's `mlflow` by its
absolute path with this interpreter's bin folder first on its PATH, and the printed lines name
the venv's `vidtune` by its absolute path: each runs as printed in any shell.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

HOST = "127.0.0.1"
UI_PORT = 5000        # `mlflow ui`'s own default: the address the search's links point at
SERVE_PORT = 5001     # beside the UI
DEFAULT_STORE = "sqlite:///mlruns.db"   # a search's default --mlflow-uri
STORE_ENV = "MLFLOW_TRACKING_URI"


def add_server_flags(p: argparse.ArgumentParser, *, store: str, port: int, port_help: str) -> None:
    """The flags `vidtune ui` and `vidtune serve` share, in a group "server": --mlflow-uri (what
    the store holds: `store`), --host and --port (default `port`)."""
    g = p.add_argument_group("server")
    g.add_argument("--mlflow-uri", metavar="URI", default=None,
                   help=f"{store} (default ${STORE_ENV}, else {DEFAULT_STORE} "
                   "in this folder, a search's default)")
    g.add_argument("--host", metavar="HOST", default=HOST,
                   help="the interface to listen on (0.0.0.0: every one; the server has no login)")
    g.add_argument("--port", metavar="PORT", type=int, default=port, help=port_help)


def checked_port(port: int) -> str | None:
    """The one-line error for a --port outside 1..65535, or None."""
    return None if 0 < port < 65536 else f"error: --port: got {port}; a port is 1..65535"


def bin_dir() -> str:
    """This interpreter's bin folder (the venv's): where `mlflow`, `uvicorn` and `vidtune` are."""
    return os.path.dirname(sys.executable)


def child_env(extra: Mapping[str, str] | None = None,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (this process's environment) with `bin_dir()` first on PATH, plus `extra`."""
    env = dict(os.environ if base is None else base)
    rest = env.get("PATH", os.defpath)
    env["PATH"] = bin_dir() + (os.pathsep + rest if rest else "")
    return {**env, **(extra or {})}


def mlflow_argv(*args: str) -> list[str]:
    """`mlflow ARGS` by this environment's own `mlflow` (its console script, else `python -m`)."""
    script = Path(bin_dir()) / "mlflow"
    return [str(script), *args] if script.is_file() else [sys.executable, "-m", "mlflow", *args]


def vidtune_command() -> str:
    """How to run this environment's `vidtune` from any shell: its console script's absolute
    path (or this interpreter's `-m vidtune.cli`), shell-quoted."""
    script = Path(bin_dir()) / "vidtune"
    if script.is_file():
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m vidtune.cli"


def sqlite_file(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///FILE` store (relative to the working folder), else None."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(tracking_uri[len("sqlite:///"):]).expanduser().resolve()


def absolute_store(tracking_uri: str) -> str:
    """`tracking_uri` with a SQLite file's path made absolute (a command that works from anywhere)."""
    db = sqlite_file(tracking_uri)
    return f"sqlite:///{db}" if db is not None else tracking_uri


def missing_store(tracking_uri: str) -> str | None:
    """Why a `sqlite:///FILE` store is not there (MLflow would create an empty one), else None."""
    db = sqlite_file(tracking_uri)
    return None if db is None or db.is_file() else f"no such store ({db} does not exist)"


def store_of(flag_value: str | None) -> tuple[str, str]:
    """(store, where it came from) for --mlflow-uri: the flag, else $MLFLOW_TRACKING_URI, else
    the search's default, `sqlite:///mlruns.db` in the working folder."""
    if flag_value:
        return flag_value, "--mlflow-uri"
    if os.environ.get(STORE_ENV):
        return os.environ[STORE_ENV], f"${STORE_ENV}"
    return DEFAULT_STORE, "--mlflow-uri (default)"


def ui_line(tracking_uri: str) -> str:
    """The line that opens MLflow's UI on the store, on http://127.0.0.1:5000."""
    return f"{vidtune_command()} ui --mlflow-uri {shlex.quote(absolute_store(tracking_uri))}"


def serve_line(tracking_uri: str, model_uri: str) -> str:
    """The line that serves `model_uri` of the store on http://127.0.0.1:5001 (`/invocations`)."""
    return (f"{vidtune_command()} serve {shlex.quote(model_uri)} --mlflow-uri "
            f"{shlex.quote(absolute_store(tracking_uri))}")


def vidtune_line(*args: str) -> str:
    """`vidtune ARGS` as a line that runs in any shell."""
    return " ".join([vidtune_command(), *(shlex.quote(a) for a in args)])


def exec_mlflow(args: Sequence[str], extra_env: Mapping[str, str]) -> int:
    """Replace this process by `mlflow ARGS` with `child_env(extra_env)` (signals reach MLflow
    itself, its exit code is the command's). Returns only if the exec fails (127)."""
    argv = mlflow_argv(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(argv[0], argv, child_env(extra_env))
    except OSError as e:
        print(f"error: cannot start {argv[0]}: {e.strerror or e}; reinstall vidtune "
              "(pip install -e .), which installs MLflow", file=sys.stderr)
    return 127


def exec_python(module: str, args: Sequence[str]) -> int:
    """Replace this process by `python -m MODULE ARGS` (this interpreter). Returns only if the
    exec fails (127)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, [sys.executable, "-m", module, *args])
    except OSError as e:
        print(f"error: cannot start {sys.executable}: {e.strerror or e}", file=sys.stderr)
    return 127
