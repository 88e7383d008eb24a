"""Where a search's files go. The search's folder, `<storage>/<name>`, holds at its top what a
person opens: trials.csv, best_config.json, the plots, search.log, device_lease.json and the
failed trials' tracebacks (failures/). Ray Tune's state (its experiment: tuner.pkl, the
experiment and searcher state, one folder per trial) and the trials' Train runs (train_runs/,
their checkpoints) go in its subfolder STATE_FOLDER, the path `Tuner.restore` takes.

A search written before this layout keeps Tune's state at the top of its folder: `state_path`
finds it there, so such a search still resumes.
"""
from __future__ import annotations

from pathlib import Path, PurePosixPath

STATE_FOLDER = "ray"
# what Tune writes at the top of an experiment folder: a folder holding it is an old layout's
_TUNE_STATE_FILE = "tuner.pkl"


def search_path(storage: str, name: str) -> str:
    """The search's folder (a URI on remote storage)."""
    return f"{storage.rstrip('/')}/{name}"


def state_path(search: str) -> str:
    """Ray Tune's experiment folder of the search at `search`: its STATE_FOLDER, or the search's
    folder itself when a search of the old layout keeps Tune's state there (local storage)."""
    if "://" not in search and (Path(search) / _TUNE_STATE_FILE).is_file() \
            and not (Path(search) / STATE_FOLDER).is_dir():
        return search
    return f"{search.rstrip('/')}/{STATE_FOLDER}"


def search_of(experiment_path: str) -> str:
    """The search's folder of a Tune experiment folder (`state_path`'s inverse): the parent of a
    STATE_FOLDER, else the folder itself (the old layout)."""
    path = experiment_path.rstrip("/")
    if PurePosixPath(path).name == STATE_FOLDER:
        return path[: -len(STATE_FOLDER) - 1]
    return path
