"""The search's uses of Ray's private APIs; each with why no public API does it.

Everything else in the project must use Ray's public API (`tests/test_ray_internals.py` scans
for private Ray attributes outside this module and trainer/cluster/torch_trainer.py, the trainer layer's
one use, which cannot import from here). Private APIs change without notice between Ray
minor versions, so this module checks on import that the installed Ray is the minor version
these uses were written and tested against (`vidtune.ray_version.SUPPORTED_RAY`; pyproject.toml
pins the same range, constraints.txt the exact release). Moving to a new Ray minor: check each use below
against the new sources, run the tests (the slow ones too), then bump `SUPPORTED_RAY`, the
pin in pyproject.toml and constraints.txt together.

The uses (checked against Ray 2.60.0):

1. `ResultGrid._experiment_analysis.trials` (`trial_states`): the Tune status of each trial
   (TERMINATED / ERROR / PENDING / RUNNING / PAUSED) and its id, in the ResultGrid's order.
   The public `Result` does not carry either reliably: `Result.metrics["trial_id"]` is missing
   for a trial that never reported, and `metrics["done"]` is False for a trial Tune terminated
   through an experiment-wide stop (so a finished trial and one cut off by Ctrl-C look the
   same); `ResultGrid.num_terminated` / `num_errors` are counts only. Reloading the experiment
   with the public `tune.ExperimentAnalysis(result_grid.experiment_path)` gives the trials in a
   different order than the ResultGrid (measured: errored trials first), re-reads every trial's
   results from storage, and sees only the last snapshot on disk.
2. `ray.train.v2._internal.execution.callback.WorkerGroupCallback` and the worker group's
   `get_worker_group_state().placement_group_handle.placement_group` (`WorkerGroupCallback`,
   `worker_group_placement_group`): `tune.running.cleanup.PlacementGroupRecorder` must learn, in the
   Train controller right after the worker group starts, which placement group it got, so the
   search can remove it when Tune stops the trial (see tune/running/cleanup.py for why Ray does not).
   The public Train callback (`ray.train.UserCallback`) has only `after_report` and
   `after_exception` hooks and sees no worker group.
3. Ray's `OptunaSearch._ot_trials` / `_completed_trials` (`optuna_pending_trial`,
   `optuna_study`): `tune.study.space.VidtuneOptunaSearch` sets an Optuna constraint (out of memory)
   on the live Optuna trial before Ray's `on_trial_complete` tells the study; OptunaSearch keeps
   the Tune-trial -> Optuna-trial map and its study private and has no hook for it.

4. The names of the files Tune's restore unpickles (`TUNE_STATE_FILES`, `TUNE_TRIAL_STATE_FILES`):
   tune/state/trust.py signs and checks them before a `--resume` loads any (tune/impl/tuner_internal.py
   `_TUNER_PKL`, execution/tune_controller.py, search/searcher.py, search/search_generator.py,
   search/basic_variant.py, callback.py `CKPT_FILE_TMPL`, experiment/trial.py `error.pkl`). Tune
   has no public list of them; a new kind of state file on another Ray would go unchecked.
5. `experiment_staging_path`: a trial's `storage.experiment_driver_staging_path`, the local
   folder Tune saves its state in before copying it to the experiment folder in the background;
   tune/state/trust.py signs the files there, so a driver killed before the copy lands leaves nothing
   unsigned.
6. `Tuner._local_tuner._tune_config.search_alg` (`restored_searcher`): the searcher a
   `Tuner.restore` unpickled from tuner.pkl; Tune restores its saved state into this object when
   the search continues. A resumed search's summary reads its `--time-budget` state from it.
   The public Tuner has no accessor for its TuneConfig.

7. The trials of Tune's saved experiment state, read as JSON (`saved_trials`): each trial's id,
   status, folder and error file, from the newest `experiment_state-*.json` (tune_controller.py
   `save_to_dir`: `trial_data`, each a pair of the trial's JSON state and its run metadata's).
   `--resume` reads them to tell a finished search from one to continue before Ray starts
   (`tune.state.finished`). The public reader, `tune.ExperimentAnalysis`, unpickles each trial's
   fields (code would run before the state's signature is checked) and needs Ray imported.

`ray.PlacementGroupID` is public, so it is not here.
"""
from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import ray
from ray.tune import ResultGrid
from ray.tune.experiment import Trial
from ray.tune.search.optuna import OptunaSearch
from ray.util.placement_group import PlacementGroup

# The version check is on the floor (vidtune.ray_version), shared with trainer/cluster/torch_trainer.py,
# the trainer layer's one use of a Ray Train internal; re-exported here for this module's users.
from vidtune.ray_version import (
    ALLOW_UNTESTED_ENV,
    SUPPORTED_RAY,
    UnsupportedRayError,
    check_ray_version,
)
from vidtune.ray_version import moved_internal as _moved
from vidtune.ray_version import supported as _supported

check_ray_version()

# --- 2. Train V2's worker-group callback (no public equivalent) ------------------------------
try:
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback
except ImportError as e:  # only reachable on another Ray with VIDTUNE_ALLOW_UNTESTED_RAY=1
    raise _moved("ray.train.v2._internal.execution.callback.WorkerGroupCallback", e) from e


def worker_group_placement_group(worker_group: Any) -> PlacementGroup:
    """The `ray.util.placement_group.PlacementGroup` of a started Train V2 worker group (the
    argument of `WorkerGroupCallback.after_worker_group_start`)."""
    try:
        return worker_group.get_worker_group_state().placement_group_handle.placement_group
    except AttributeError as e:
        raise _moved("the placement group of a Train worker group", e) from e


# --- 1. Tune trial statuses (no public equivalent) --------------------------------------------
TERMINATED, ERROR = "TERMINATED", "ERROR"
FINISHED_STATES = (TERMINATED, ERROR)
"""Tune statuses of a trial that ended (others: PENDING, RUNNING, PAUSED: cut off)."""


def trial_states(result_grid: ResultGrid) -> list[tuple[str, str]]:
    """(trial id, Tune status) of each trial of a `tune.ResultGrid`, in the order of its Results
    (`zip(trial_states(grid), grid)` pairs each Result with its trial)."""
    try:
        trials = result_grid._experiment_analysis.trials
        states = [(str(t.trial_id), str(t.status)) for t in trials]
    except AttributeError as e:
        raise _moved("ResultGrid._experiment_analysis.trials", e) from e
    if len(states) != len(result_grid):
        raise UnsupportedRayError(f"Ray {ray.__version__}: the ResultGrid has {len(result_grid)} results but "
                                  f"{len(states)} trials; vidtune is tested with Ray {_supported()}.x")
    return states


def drop_unreadable_error_pickles(experiment_path: str) -> list[str]:
    """Remove the trials' `error.pkl` files that cannot be unpickled (left empty or cut short
    when the disk filled up) from a local experiment folder; returns their paths.

    Tune builds every Result of a ResultGrid by unpickling its trial's `error.pkl`; one truncated
    file makes `Tuner.fit()` (and so every `--resume`) end in EOFError. Tune falls back to the
    trial's `error.txt` when the pickle is absent. The file name is Tune's, not a public API."""
    if "://" in experiment_path:
        return []
    dropped = []
    for path in Path(experiment_path).glob("*/error.pkl"):
        try:
            with open(path, "rb") as f:
                pickle.load(f)
        except (EOFError, pickle.UnpicklingError, ValueError):
            path.unlink(missing_ok=True)
            dropped.append(str(path))
        except Exception:   # readable, but its exception class cannot be imported here: keep it
            pass
    return dropped


def check_experiment_state(experiment_path: str) -> None:
    """Raise ValueError when the newest saved state of a local Tune experiment (its
    `experiment_state-*.json`) cannot be parsed, e.g. cut short by a full disk: Tune would then
    start the experiment over without a word. The file name and format are Tune's."""
    if "://" in experiment_path:
        return
    states = sorted(Path(experiment_path).glob("experiment_state-*.json"))
    if not states:
        raise ValueError(f"no experiment_state-*.json in {experiment_path}")
    try:
        json.loads(states[-1].read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{states[-1].name} is damaged ({e})") from None


# --- 7. The trials of Tune's saved state, as JSON (no public reader that does not unpickle) ------
@dataclass(frozen=True)
class SavedTrial:
    """One trial as Tune's newest saved experiment state has it."""

    trial_id: str
    status: str                  # TERMINATED, ERROR, PENDING (a RUNNING trial is saved PENDING), PAUSED
    folder: str | None           # its folder's name in the experiment folder (the trial's short name)
    error_file: str | None       # Tune's text of its error, in that folder; None without an error


def saved_trials(experiment_path: str) -> list[SavedTrial]:
    """The trials in the newest `experiment_state-*.json` of a local Tune experiment, read as
    JSON only (nothing unpickled). ValueError naming the file when there is none or it is not
    the format this Ray writes. Use 7 above."""
    states = sorted(Path(experiment_path).glob("experiment_state-*.json"))
    if not states:
        raise ValueError(f"no experiment_state-*.json in {experiment_path}")
    try:
        trial_data = json.loads(states[-1].read_text())["trial_data"]
        trials = []
        for trial_json, metadata_json in trial_data:
            state, metadata = json.loads(trial_json), json.loads(metadata_json)
            trials.append(SavedTrial(trial_id=str(state["trial_id"]), status=str(state["status"]),
                                     folder=state.get("relative_logdir"),
                                     error_file=metadata.get("error_filename")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{states[-1]} is not an experiment state this Ray ({ray.__version__}) reads: "
                         f"{type(e).__name__}: {e}") from None
    return trials


# --- 3. Ray's OptunaSearch (no public equivalent) ---------------------------------------------
def optuna_pending_trial(searcher: OptunaSearch, trial_id: str) -> optuna.Trial | None:
    """The live `optuna.Trial` that Ray's `OptunaSearch` asked for Tune trial `trial_id`, or None
    when it has none or has already told the study its result (call before
    `OptunaSearch.on_trial_complete`)."""
    try:
        ot_trials, completed = searcher._ot_trials, searcher._completed_trials
    except AttributeError as e:
        raise _moved("OptunaSearch._ot_trials / _completed_trials", e) from e
    return None if trial_id in completed else ot_trials.get(trial_id)


def optuna_study(searcher: OptunaSearch) -> optuna.Study | None:
    """The `optuna.Study` of Ray's `OptunaSearch` (None until its search space is set)."""
    try:
        return searcher._ot_study
    except AttributeError as e:
        raise _moved("OptunaSearch._ot_study", e) from e


# --- 4. The files Tune's restore unpickles (no public list) -------------------------------------
TUNE_STATE_FILES = ("tuner.pkl", "experiment_state-*.json", "searcher-state-*.pkl", "search_gen_state-*.json",
                    "basic-variant-state-*.json", "callback-states-*.pkl")
"""In the experiment folder (fnmatch patterns)."""
TUNE_TRIAL_STATE_FILES = ("error.pkl",)
"""In each trial's folder: the ResultGrid unpickles it."""


def experiment_staging_path(trials: list[Trial]) -> str | None:
    """The local folder where Tune saves the experiment's state before its background copy to
    the experiment folder (`StorageContext.experiment_driver_staging_path`, which Tune's
    searchers are told to write to); None without trials. Use 5 above."""
    storage = getattr(trials[0], "storage", None) if trials else None
    return getattr(storage, "experiment_driver_staging_path", None) if storage is not None else None


def restored_searcher(tuner: Any) -> Any:
    """The searcher a restored `tune.Tuner` carries (use 6), or None where this Ray keeps it
    elsewhere (the summary then just does not say that the budget ended the search)."""
    tune_config = getattr(getattr(tuner, "_local_tuner", None), "_tune_config", None)
    return getattr(tune_config, "search_alg", None)


__all__ = [
    "ALLOW_UNTESTED_ENV", "ERROR", "FINISHED_STATES", "SUPPORTED_RAY", "TERMINATED", "TUNE_STATE_FILES",
    "TUNE_TRIAL_STATE_FILES", "SavedTrial", "UnsupportedRayError",
    "WorkerGroupCallback", "check_ray_version", "experiment_staging_path", "optuna_pending_trial",
    "optuna_study", "restored_searcher", "saved_trials", "trial_states",
    "worker_group_placement_group",
]
