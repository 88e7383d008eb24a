"""Checks of the MLflow and Optuna stores before anything starts (`tune.preflight`): a tracking
server answers, a SQLite file's folder exists and is writable; a plain file store is refused; the
registered model's name is one MLflow's registry takes.
"""
from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from vidtune.flags import ConfigError
from vidtune.tune.config.option_groups import Tracking

HEALTH_TIMEOUT_S = 3.0


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///...` URI (relative to the working folder), else None."""
    if not uri.startswith("sqlite:"):
        return None
    path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
    return Path(path).expanduser().resolve() if path else None


ARTIFACTS_FOLDER = "mlartifacts"


def artifact_location(tracking_uri: str, given: str | None = None) -> str | None:
    """Where a new experiment keeps its artifacts: `given` (--artifact-location, as
    `check_artifact_location` resolved it), else for a SQLite store the folder `mlartifacts`
    beside its database file, so the store and its files stay together (MLflow's own default is
    ./mlruns under whatever folder the search was started from); for a tracking server, the
    server's own (None)."""
    if given:
        return given
    db = sqlite_path(tracking_uri)
    return (db.parent / ARTIFACTS_FOLDER).as_uri() if db is not None else None


def check_artifact_location(location: str, flag: str = "--artifact-location") -> str:
    """`location` as MLflow takes it: a URI with a scheme (s3://, gs://, file://...) as given; a
    local folder as an absolute file:// URI, once its parent exists and is writable (MLflow
    creates the folder itself). ConfigError naming `flag` otherwise."""
    if "://" in location:
        return location
    path = Path(location).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise ConfigError(flag, f"{path} is a file; give a folder (MLflow writes the artifacts inside it)")
    parent = path if path.is_dir() else path.parent
    if not parent.is_dir():
        raise ConfigError(flag, f"the folder {parent} does not exist; create it or pass another folder")
    if not os.access(parent, os.W_OK):
        raise ConfigError(flag, f"{parent} is not writable; pass a folder you can write to")
    return path.as_uri()


def check_store_uri(uri: str, flag: str) -> None:
    """Fail fast (ConfigError naming `flag`) when a tracking / study store cannot be used:
    http(s): GET /health answers within HEALTH_TIMEOUT_S; sqlite: the folder exists and is writable."""
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as resp:
                if resp.status >= 400:
                    raise ConfigError(flag, f"{uri} answered {resp.status} at /health; "
                                      "check the server and its address")
        except urllib.error.HTTPError as e:
            raise ConfigError(flag, f"{uri} answered {e.code} at /health; "
                              "check the server and its address") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ConfigError(flag, f"cannot reach {uri} ({reason}); start the tracking server "
                             "(mlflow server --host 127.0.0.1 --port 5000; on a cluster, reach it through "
                             "`ray attach cluster.yaml -p 5000`) or pass another URI") from None
        return
    if scheme == "sqlite":
        path = sqlite_path(uri)
        if path is None:
            raise ConfigError(flag, f"{uri} names no database file; write it as sqlite:///FILE (relative) "
                              "or sqlite:////abs/FILE")
        folder = path.parent
        if not folder.is_dir():
            raise ConfigError(flag, f"the folder {folder} of {uri} does not exist; "
                              "create it or pass another URI")
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise ConfigError(flag, f"{path if path.exists() else folder} is not writable; "
                              "pass a URI in a writable folder")
        return
    if scheme in ("", "file"):
        raise ConfigError(flag, f"{uri}: MLflow 3 refuses plain file stores without an opt-in; "
                          "use sqlite:///mlruns.db or a server URI")
    # databricks, postgresql, mysql, ...: MLflow checks these itself when it connects.


def model_name_problem(name: str) -> str | None:
    """Why MLflow's Model Registry refuses `name`, or None: what `mlflow.utils.validation.
    _validate_model_name` checks (tests/test_model_registry.py holds the two together), here so
    that the search refuses it before it runs, without importing MLflow."""
    if not name.strip():
        return "it is empty"
    refused = [c for c in "/:" if c in name]
    if refused:
        return f"it holds {' and '.join(map(repr, refused))}"
    if name == "." or name.startswith(".."):
        return "it reads as a relative folder"
    return None


def check_model_name(t: Tracking) -> None:
    """--register-model (or --experiment, its default) is a name MLflow's registry takes:
    ConfigError naming the flag otherwise, before anything starts (`tune.preflight`)."""
    problem = model_name_problem(t.model_name) if t.model_name is not None else None
    if problem:
        flag = "--register-model" if t.register_model is not None else "--experiment"
        also = "" if t.register_model is not None else " (or --no-register-model)"
        raise ConfigError(flag, f"{t.model_name!r} cannot name a registered MLflow model ({problem}); pass "
                          f"--register-model with another name, such as rwf-mvit{also}")
