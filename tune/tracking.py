"""MLflow: one parent run per search, one nested child run per trial, all written from the search
(driver) process: one writer (safe for SQLite), and it works on a cluster whose workers cannot
reach the store.

A run never stays RUNNING: FINISHED (all epochs, or stopped early by ASHA: a decision of the
search, not a crash; the tag `vidtune.outcome` says which), FAILED (error, out of memory,
diverged; reason in the tag `vidtune.failure_reason`: for an error, the exception's `Type:
message`, its whole traceback kept as the run's artifact `failure/traceback.txt` and in
`<experiment>/failures/<trial name>.txt`) or KILLED (interrupted: continue with --resume). A
resumed search finds its parent run by the tag `vidtune.experiment_path` and its child runs by
`vidtune.trial_id` under that parent, so nothing is logged twice as a new run.

Each child run holds its per-epoch history (step = epoch) and the summary the trials table shows,
under `tune.results.SUMMARY_KEYS` (best_val_acc, its 95% interval, best_epoch, speed_clips_per_s),
plus best_val_f1, rounded as trials.csv writes them: from the tracker's own epoch records when the
trial ends, then from its final `TrialRow` in `reconcile`, so the numbers equal trials.csv's. The
saved runs-table view and every link are `tune.mlflow_view`'s.

The store may fail mid-search (a tracking server restarted, a full disk under a SQLite file):
tracking never blocks or stops the search. A failed write marks the store down; the Tune hooks
skip it for `RETRY_AFTER_S`, then try again. Nothing is lost meanwhile: Tune keeps every epoch
of every trial in the experiment folder, and `reconcile` (at the end of the search, and of a
`--resume`) writes every epoch MLflow misses, and each run's final status and tags, from there.
"""
from __future__ import annotations

import functools
import math
import numbers
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from ray.tune import Callback, Result
from ray.tune.experiment import Trial
from ray.tune.result import AUTO_RESULT_KEYS

from datasets.flags import ConfigError
from trainer.history import latest_history
from trainer.metrics import steady_state
from tune import mlflow_view
from tune.faults import error_text, exception_line, keep_traceback, one_line, read_error_file
from tune.results import NO_RESULT, SUMMARY_KEYS, TrialRow, completed_trial_status, epoch_records
from tune.tables import csv_record
from tune.trial import short_name

EXPERIMENT_PATH_TAG = "vidtune.experiment_path"
TRIAL_ID_TAG = "vidtune.trial_id"
NODE_ID_TAG = "vidtune.node_id"
NODE_TAG = "node"               # the IPs of the nodes the trial trained on (else NODE_ID_TAG's id)
GPU_IDS_TAG = "gpu_ids"         # physical ids of the GPUs it trained on ("0", "2,3"); "" on the CPU
FAILURE_TAG = "vidtune.failure_reason"
STOP_TAG = "vidtune.stop_reason"
RESUMED_TAG = "vidtune.resumed"              # the run restarted from a checkpoint (worker died, or --resume)
PARENT_TAG = "mlflow.parentRunId"
HEALTH_TIMEOUT_S = 3.0
RETRY_AFTER_S = 30.0         # after a failed write, the Tune hooks leave the store alone this long
INTERRUPTED_REASON = "search interrupted; continue it with --resume"
# Tune's bookkeeping keys and the checkpoint path are not training metrics.
# The epoch's start/end are unix times, kept in Tune's results for timelines, not metrics to chart.
# Constants of a run are params or tags, not metrics to chart: the epoch is each point's step,
# batch_size a param, oom, diverged and resumed_from_epoch tags (FAILURE_TAG, RESUMED_TAG), reader
# failures a tag when there are any, where it ran tags (`placement_tags`; a dataframe row may
# hold "0" read back as a number). The schedule's learning rate is logged as `lr_current`
# (`lr` is the param: the peak the trial was given).
_NOT_METRICS = set(AUTO_RESULT_KEYS) | {"done", "trial_id", "experiment_tag", "checkpoint_path",
                                        "should_checkpoint", "node_id", "epoch_start_ts", "epoch_end_ts",
                                        "resumed_from_epoch", "epoch", "batch_size", "oom", "diverged",
                                        "reader_failures", "node_ip", "gpu_ids", "damaged_checkpoints"}
RENAMED = {"lr": "lr_current"}
STEP_METRIC = "clips_per_s"      # logged for every epoch (0 for out of memory): which steps a run has
OUTCOME_TAG = "vidtune.outcome"  # done | stopped early | out of memory | diverged | failed | interrupted
BEST_TAG = "vidtune.best"
READER_TAG = "vidtune.reader_failures"
TRACEBACK_ARTIFACT = "failure/traceback.txt"   # a failed trial's whole traceback, on its child run
# What a trial's summary is computed from, kept per epoch while it runs (`live_row`)
_SUMMARY_INPUTS = ("val_acc", "val_f1", "clips_per_s", "epoch_time_s", "oom", "diverged")
# The plots the parent run may hold (`tune.summary` logs them at its root), in the description's
# order, each with the sentence under it; {objective} is the search's.
PLOT_SENTENCES = (
    ("objective_history.png", "Each trial's {objective} in the order the trials started, and the best so far "
                              "as a line: a line still rising at the end says more trials may find better."),
    ("objective_vs_params.png", "Each trial's {objective} against its lr (log scale) and batch size (trials "
                                "of one size spread a little apart), the best marked: a best value at the "
                                "edge of an axis says to widen that range."),
    ("accuracy_vs_speed.png", "Validation accuracy against steady-state speed (clips/s): the trials on the "
                              "front (up and to the right) are the ones worth choosing between."),
)


# -- checks before anything starts ---------------------------------------------------------------

def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///...` URI (relative to the working folder), else None."""
    if not uri.startswith("sqlite:"):
        return None
    path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
    return Path(path).expanduser().resolve() if path else None


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


def git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=5)
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# -- the writer ----------------------------------------------------------------------------------

def numeric_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The training metrics of one Tune result (a live result, or a row of Tune's per-epoch
    dataframe): every int/float the trainer reported."""
    out = {}
    for key, value in result.items():
        # numbers.Real: Tune's dataframes hold numpy scalars; bool (and numpy's bool_) are not metrics.
        # A dataframe row also flattens the trial's config into `config/<name>` columns: params.
        if key in _NOT_METRICS or key.startswith("config/") or isinstance(value, bool) \
                or type(value).__name__ == "bool_" or not isinstance(value, numbers.Real):
            continue
        out[RENAMED.get(key, key)] = float(value)
    return out


def _guarded(hook):
    """A Tune hook that never raises and never waits on a store known to be down (see the
    module docstring): a failure is reported once per outage and the search goes on."""
    @functools.wraps(hook)
    def run(self, *args: Any, **kwargs: Any) -> Any:
        if self.down_reason is not None and time.monotonic() - self._failed_at < RETRY_AFTER_S:
            return None
        try:
            out = hook(self, *args, **kwargs)
        except Exception as e:   # MLflow, HTTP, SQLite (disk full, locked): never the search's end
            self._store_failed(e)
            return None
        if self.down_reason is not None:
            print(f"MLflow: {self.tracking_uri} answers again; the runs are being brought up to date",
                  flush=True)
            self.down_reason = None
        return out
    return run


class MLflowTracker(Callback):
    """Tune callback writing the parent and child runs. Holds no MLflow objects until `setup`
    (Tune pickles its callbacks with the experiment so `--resume` gets them back).

    `child_params`: params every child run gets (precision, model, workers, gpus, dataset);
    the sampled values (batch_size, lr, weight_decay) are added per trial.
    """

    def __init__(self, *, tracking_uri: str, experiment: str, experiment_path: str, epochs: int,
                 parent_params: dict[str, Any], parent_tags: dict[str, str], child_params: dict[str, Any],
                 objective: str = "val_acc", val_clips: int = 0):
        self.tracking_uri = tracking_uri
        self.objective = objective     # what the saved view sorts by (`tune.mlflow_view.objective_metric`)
        self.val_clips = val_clips     # validation clips: the accuracies' 95% intervals (0: none)
        self.experiment = experiment
        self.experiment_path = experiment_path
        self.epochs = epochs
        self.parent_params = parent_params
        self.parent_tags = parent_tags
        self.child_params = child_params
        self._client = None
        self.parent_run_id: str | None = None
        self.child_runs: dict[str, str] = {}     # trial id -> run id
        self._node_tagged: set[str] = set()
        self._last_step: dict[str, int] = {}     # trial id -> last epoch logged
        self._records: dict[str, dict[int, dict[str, Any]]] = {}   # trial id -> epoch -> _SUMMARY_INPUTS
        self.view_id: str | None = None          # the saved runs-table view; "": plain links; None: not yet
        self.down_reason: str | None = None      # why the last write failed; None while the store works
        self._failed_at = 0.0

    # state ---------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        state["down_reason"], state["_failed_at"] = None, 0.0
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a tracker pickled by an older vidtune lacks the later attributes
        self.__dict__.update({"down_reason": None, "_failed_at": 0.0, "objective": "val_acc", "val_clips": 0,
                              "_records": {}, "view_id": None, **state})

    def _store_failed(self, e: BaseException) -> None:
        reason = one_line(e)
        if self.down_reason is None:
            print(f"MLflow: cannot write to {self.tracking_uri} ({reason}); the search goes on, and what "
                  "it could not record is written when the store answers again (at the end, or with "
                  "--resume)", flush=True)
        self.down_reason = reason
        self._failed_at = time.monotonic()

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    @_guarded
    def setup(self, **info: Any) -> None:
        self.open_parent()

    def open_parent(self, *, refresh: bool = False) -> str:
        """Find (resume) or create the search's parent run; load its existing child runs.
        `refresh`: reload the child runs (another copy of this callback may have written them)."""
        if self.parent_run_id and not refresh:
            return self.parent_run_id
        c = self.client
        exp = c.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else c.create_experiment(self.experiment)
        self.experiment_id = exp_id
        found = c.search_runs([exp_id], max_results=1,
                              filter_string=f"tags.`{EXPERIMENT_PATH_TAG}` = '{_q(self.experiment_path)}'")
        if found and self.parent_run_id:
            pass
        elif found:
            self.parent_run_id = found[0].info.run_id
            c.update_run(self.parent_run_id, status="RUNNING")
        else:
            tags = {**self.parent_tags, EXPERIMENT_PATH_TAG: self.experiment_path,
                    "mlflow.runName": Path(self.experiment_path).name}
            run = c.create_run(exp_id, tags=tags, run_name=Path(self.experiment_path).name)
            self.parent_run_id = run.info.run_id
            _log_params(c, self.parent_run_id, self.parent_params)
        if self.view_id is None:
            self.save_view()
        for run in c.search_runs([exp_id], filter_string=f"tags.`{PARENT_TAG}` = '{self.parent_run_id}'",
                                 max_results=10000):
            trial_id = run.data.tags.get(TRIAL_ID_TAG)
            if trial_id:
                self.child_runs[trial_id] = run.info.run_id
        return self.parent_run_id

    # Tune hooks ----------------------------------------------------------------------------
    @_guarded
    def on_trial_start(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self.start_child(trial.trial_id, trial.config, name=short_name(trial))

    @_guarded
    def on_trial_result(self, iteration: int, trials: list[Trial], trial: Trial, result: dict,
                        **info: Any) -> None:
        self.log_result(trial.trial_id, result)

    @_guarded
    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        status = completed_trial_status(trial, epochs=self.epochs)
        run_status, tags = self.mlflow_status(status, trial.last_result or {})
        tags[OUTCOME_TAG] = OUTCOMES.get(status, status.lower())
        run_id = self.child_runs.get(trial.trial_id)
        if run_id:   # shown while the search runs; `reconcile` writes the final row's at the end
            row = live_row(trial.trial_id, trial.config, self._records.get(trial.trial_id, {}), status)
            self.log_trial_summary(run_id, row)
        self.end_child(trial.trial_id, run_status, tags)

    @_guarded
    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        path = getattr(trial, "error_file", None)
        text = read_error_file(path) or f"trial errored; see {path or 'the Ray logs'}"
        run_id = self.child_runs.get(trial.trial_id)
        reason = self.record_failure(run_id, short_name(trial), text, fallback=path) if run_id else ""
        self.end_child(trial.trial_id, "FAILED", {FAILURE_TAG: reason, OUTCOME_TAG: OUTCOMES["ERROR"]})

    # the work ------------------------------------------------------------------------------
    def start_child(self, trial_id: str, config: dict[str, Any], *, name: str | None = None) -> str:
        """The trial's child run (created, or found again on resume), named `name` (the trial's
        short name; its Tune id is the `vidtune.trial_id` tag)."""
        c = self.client
        parent = self.open_parent()
        run_id = self.child_runs.get(trial_id)
        if run_id:                          # resumed trial: same run, running again
            c.update_run(run_id, status="RUNNING")
            # Epochs already logged are not logged twice (a resumed trial re-reports its last one).
            steps = [m.step for m in c.get_metric_history(run_id, STEP_METRIC)]
            self._last_step[trial_id] = max(steps, default=0)
            return run_id
        tags = {PARENT_TAG: parent, TRIAL_ID_TAG: trial_id, "mlflow.runName": name or trial_id}
        run = c.create_run(self.experiment_id, tags=tags, run_name=name or trial_id)
        run_id = run.info.run_id
        self.child_runs[trial_id] = run_id
        _log_params(c, run_id, {**self.child_params, **config})
        return run_id

    def log_result(self, trial_id: str, result: dict[str, Any]) -> None:
        run_id = self.child_runs.get(trial_id) or self.start_child(trial_id, result.get("config", {}))
        step = int(result.get("epoch") or result.get("training_iteration") or 0)
        # every report, also one MLflow has: a restarted epoch's later report is the one that counts
        self._records.setdefault(trial_id, {})[step] = {k: result[k] for k in _SUMMARY_INPUTS if k in result}
        if _from_scratch(result):   # its checkpoints were damaged: epochs 1.. are trained (and logged) again
            self._last_step[trial_id] = step - 1
        if step <= self._last_step.get(trial_id, 0):
            return
        self._last_step[trial_id] = step
        ts = int(float(result.get("timestamp") or time.time()) * 1000)
        metrics = [Metric(k, v, ts, step) for k, v in numeric_metrics(result).items()]
        if metrics:
            self.client.log_batch(run_id, metrics=metrics)
        self._tag_restart(run_id, result)
        where = placement_tags(result)
        if where and trial_id not in self._node_tagged:   # the trial's first epoch (or first since a resume)
            self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in where.items()])
            self._node_tagged.add(trial_id)

    def _tag_restart(self, run_id: str, result: dict[str, Any]) -> None:
        """Per-epoch facts kept as tags: a restart from a checkpoint, unreadable videos."""
        failures = int(result.get("reader_failures") or 0)
        if failures > 0:
            self.client.set_tag(run_id, READER_TAG, f"{failures} clip read(s) failed in epoch "
                                f"{result.get('epoch')}; each was replaced by another clip of the same class")
        resumed = int(result.get("resumed_from_epoch") or 0)
        damaged = int(result.get("damaged_checkpoints") or 0)
        skipped = f"; {damaged} damaged checkpoint(s) skipped" if damaged else ""
        if resumed > 0:
            self.client.set_tag(run_id, RESUMED_TAG, f"restarted from its epoch-{resumed} checkpoint (a "
                                "worker died and Ray Train restarted the group, or the search was resumed)"
                                f"{skipped}")
        elif _from_scratch(result):
            self.client.set_tag(run_id, RESUMED_TAG, f"restarted from epoch 1: its {damaged} checkpoint(s) "
                                "were damaged; epochs from 1 on are logged again (the later point of a step "
                                "is this run's)")

    def mlflow_status(self, status: str, last: dict[str, Any],
                      error: BaseException | str | None = None) -> tuple[str, dict[str, str]]:
        """The MLflow status and reason tag of a trial's `tune.results.trial_status`: FAILED for
        out of memory, divergence or an error, KILLED when interrupted, else FINISHED (stopped
        early by ASHA too, with the reason in STOP_TAG)."""
        if status == "OOM":
            peak = last.get("peak_mem_mb", float("nan"))
            return "FAILED", {FAILURE_TAG: f"out of memory at batch size {last.get('batch_size')} "
                                           f"(epoch {last.get('epoch')}, peak {peak:.0f} MB); "
                                           "recorded as infeasible, not retried"}
        if status == "DIVERGED":
            return "FAILED", {FAILURE_TAG: f"diverged: the training loss became {last.get('train_loss')} in "
                                           f"epoch {last.get('epoch')} (batch size "
                                           f"{last.get('batch_size')}); the lr is too high for it; recorded "
                                           "as infeasible, not retried"}
        if status == "ERROR":
            return "FAILED", {FAILURE_TAG: exception_line(error_text(error)) if error else "trial errored"}
        if status == "UNFINISHED":
            return "KILLED", {STOP_TAG: INTERRUPTED_REASON}
        if status == "STOPPED":
            epoch = int(last.get("epoch") or 0)
            return "FINISHED", {STOP_TAG: f"stopped early by ASHA after epoch {epoch} of {self.epochs}"}
        return "FINISHED", {}

    def record_failure(self, run_id: str, name: str, text: str, *, fallback: str | None = None) -> str:
        """Keep a failed trial's whole traceback `text` (`tune.faults.keep_traceback`: the first
        one kept wins) and upload it as the run's TRACEBACK_ARTIFACT (once); returns its reason
        tag: the exception's `Type: message` and where the traceback is (`fallback`, Tune's error
        file, when it could not be kept)."""
        kept = keep_traceback(self.experiment_path, name, text)
        if kept is not None:
            text = kept.read_text(errors="replace")
        folder, file_name = TRACEBACK_ARTIFACT.rsplit("/", 1)
        if not self.client.list_artifacts(run_id, folder):
            with tempfile.TemporaryDirectory(prefix="vidtune-failure-") as tmp:
                (Path(tmp) / file_name).write_text(text, encoding="utf-8")
                self.client.log_artifacts(run_id, tmp, artifact_path=folder)
        where = kept or fallback
        return exception_line(text) + (f" (full traceback: {where})" if where else "")

    def end_child(self, trial_id: str, status: str, tags: dict[str, str] | None = None) -> None:
        run_id = self.child_runs.get(trial_id)
        if not run_id:
            return
        for k, v in (tags or {}).items():
            self.client.set_tag(run_id, k, v[:5000])
        self.client.set_terminated(run_id, status=status)

    def close(self, *, interrupted: bool) -> None:
        """End every run still RUNNING (KILLED, reason 'interrupted'); then the parent."""
        if not self.parent_run_id:
            return
        c = self.client
        for run_id in self.child_runs.values():
            if c.get_run(run_id).info.status == "RUNNING":
                c.set_tag(run_id, STOP_TAG, INTERRUPTED_REASON)
                c.set_terminated(run_id, status="KILLED")
        c.set_terminated(self.parent_run_id, status="KILLED" if interrupted else "FINISHED")

    def reconcile(self, trials: list[tuple[TrialRow, Result, str | None]]) -> int:
        """Bring every child run up to date with what its trial did. Each `(row, result,
        train_run)` holds a `tune.results.TrialRow` (final status), the trial's Tune `Result`
        (every epoch Tune received, `metrics_dataframe`) and its Train run folder, whose latest
        checkpoint keeps every epoch the run reported (`trainer.history`, which covers an epoch
        checkpointed just before an interruption, one Tune never received). Logs each epoch
        MLflow does not have yet (one point per epoch) and sets the run's final status and tags.
        Raises when the store fails. Returns the number of epochs written."""
        c = self.client
        self.open_parent()
        written = 0
        for row, result, train_run in trials:
            run_id = self.child_runs.get(row.trial_id) or self.start_child(
                row.trial_id, dict(result.config or {}), name=getattr(row, "name", "") or None)
            have = {m.step for m in c.get_metric_history(run_id, STEP_METRIC)}
            records = {**(latest_history(train_run) if train_run else {}), **epoch_records(result)}
            for epoch, record in sorted(records.items()):
                if epoch in have:
                    continue
                ts = int(float(record.get("timestamp") or time.time()) * 1000)
                metrics = [Metric(k, v, ts, epoch) for k, v in numeric_metrics(record).items()]
                if metrics:
                    c.log_batch(run_id, metrics=metrics)
                    written += 1
                self._tag_restart(run_id, record)
            self._last_step[row.trial_id] = max([self._last_step.get(row.trial_id, 0), *records])
            last = dict(result.metrics or {})
            status, tags = self.mlflow_status(row.status, last, getattr(result, "error", None))
            if row.status == "ERROR" and getattr(result, "error", None) is not None:
                tags[FAILURE_TAG] = self.record_failure(run_id, getattr(row, "name", "") or row.trial_id,
                                                        error_text(result.error))
            tags[OUTCOME_TAG] = OUTCOMES.get(row.status, row.status.lower())
            tags.update(placement_tags(last))
            self.log_trial_summary(run_id, row)
            run = c.get_run(run_id)
            for key in (STOP_TAG, FAILURE_TAG):
                if key in run.data.tags and key not in tags:
                    c.delete_tag(run_id, key)    # e.g. stopped before an interruption, finished on resume
            for key, value in tags.items():
                if run.data.tags.get(key) != value:
                    c.set_tag(run_id, key, value[:5000])
            if run.info.status != status:
                c.set_terminated(run_id, status=status)
        return written

    def retire_lost_runs(self, trial_ids: set[str]) -> list[str]:
        """Child runs of trials the Tune experiment does not know: started just before the driver
        died, after Tune last saved its state, so `--resume` ran their slot again as new trials.
        They end KILLED with the reason and are moved to MLflow's trash (restorable), so the
        experiment shows one run per trial. A run that ended (FINISHED or FAILED) did run and is
        never trashed, whatever the experiment's state says (it may be damaged). Returns the
        trial ids of the runs trashed."""
        lost = []
        for trial_id in [t for t in self.child_runs if t not in trial_ids]:
            run_id = self.child_runs[trial_id]
            status = self.client.get_run(run_id).info.status
            if status in ("FINISHED", "FAILED"):
                continue
            self.child_runs.pop(trial_id)
            self.client.set_tag(run_id, STOP_TAG, "lost when the search driver died before Tune saved it; "
                                "--resume ran this slot again as another trial")
            if status == "RUNNING":
                self.client.set_terminated(run_id, status="KILLED")
            self.client.delete_run(run_id)
            lost.append(trial_id)
        return lost

    def log_summary(self, *, files: list[Path] = (), best: dict[str, Any] | None = None,
                    best_checkpoint: str | None = None, metrics: dict[str, float] | None = None) -> None:
        """Summary on the parent run: the result files as artifacts (trials.csv, best_config.json,
        the plots), the best trial's metrics as `best_*`, `metrics` (the parameter importances,
        `importance_lr`, ...), and its checkpoint."""
        c, run_id = self.client, self.open_parent()
        for path in files:
            if path and Path(path).exists():
                c.log_artifact(run_id, str(path))
        if best is not None:
            for key in ("val_acc", "val_f1", "clips_per_s", "compute_clips_per_s"):
                value = best.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    c.log_metric(run_id, f"best_{key}", float(value))
        for key, value in (metrics or {}).items():
            c.log_metric(run_id, key, float(value))
        local = best_checkpoint and not best_checkpoint.startswith(("s3://", "gs://"))
        if local and Path(best_checkpoint).is_dir():
            c.log_artifacts(run_id, best_checkpoint, artifact_path="best_checkpoint")

    def log_trial_summary(self, run_id: str, row: TrialRow) -> None:
        """A child run's summary, the values its row in trials.csv has (`csv_record`, rounded as
        there): SUMMARY_KEYS and best_val_f1 (the same epoch's F1), at step 0. A key without a
        value (no accuracy, no speed) is left out, one MLflow already has is not written again."""
        record = csv_record(row, self.val_clips)
        values = {k: _number(record[k] or "nan") for k in SUMMARY_KEYS}
        values["best_val_f1"] = math.nan if row.status in NO_RESULT else _number(record["val_f1"] or "nan")
        have = self.client.get_run(run_id).data.metrics
        ts = int(time.time() * 1000)
        metrics = [Metric(k, float(v), ts, 0) for k, v in values.items()
                   if math.isfinite(v) and have.get(k) != v]
        if metrics:
            self.client.log_batch(run_id, metrics=metrics)

    # the view ----------------------------------------------------------------------------------
    def save_view(self) -> None:
        """Write the search's saved runs-table view (`tune.mlflow_view`: this search's trials,
        batch size, lr, the objective, speed and outcome, best first) as an experiment tag, and
        mark the experiment a model-training one (unless someone chose its kind), when the UI
        showing the store reads that format; else say once that the links open the plain table."""
        version = mlflow_view.ui_version(self.tracking_uri)
        if not mlflow_view.view_verified(version):
            checked = ", ".join(mlflow_view.VERIFIED_UI)
            print(f"MLflow: the UI of MLflow {version or '(unknown version)'} was not checked to read "
                  f"vidtune's saved runs-table view (checked: {checked}); the links open the plain runs "
                  "table", flush=True)
            self.view_id = ""
            return
        c, view = self.client, mlflow_view.view_id(self.parent_run_id)
        state = mlflow_view.view_state(parent_run_id=self.parent_run_id, objective=self.objective,
                                       tags=(OUTCOME_TAG,))
        ranked_by = mlflow_view.objective_metric(self.objective)
        name = f"vidtune {Path(self.experiment_path).name}: trials by {ranked_by}"
        c.set_experiment_tag(self.experiment_id, *mlflow_view.view_tag(view, name=name, state=state))
        if mlflow_view.EXPERIMENT_KIND_TAG not in c.get_experiment(self.experiment_id).tags:
            c.set_experiment_tag(self.experiment_id, mlflow_view.EXPERIMENT_KIND_TAG,
                                 mlflow_view.EXPERIMENT_KIND)
        self.view_id = view

    def ui_base(self) -> str:
        """Where the MLflow UI of this store answers: the tracking server itself, or the address
        `mlflow ui --backend-store-uri ...` serves a SQLite store on by default."""
        if urlparse(self.tracking_uri).scheme in ("http", "https"):
            return self.tracking_uri.rstrip("/")
        return "http://127.0.0.1:5000"

    def runs_table_url(self) -> str:
        """The experiment's runs table in the model-training UI, on the search's saved view when
        there is one (MLflow 3 opens an experiment on its GenAI overview)."""
        return f"{self.ui_base()}/{mlflow_view.runs_link(self.experiment_id, self.view_id)}"

    def run_url(self, run_id: str) -> str:
        return f"{self.ui_base()}/{mlflow_view.run_link(self.experiment_id, run_id)}"

    def publish_view(self, *, table_markdown: str, best_trial_id: str | None, objective: str,
                     answer: Sequence[str] = ()) -> None:
        """The parent run's description (MLflow's note, markdown): the `answer` sentences first,
        the best child run and the saved runs-table view (links relative to the UI, so they work
        on any address, port or tunnel), the trials table, each plot the parent holds with one
        sentence under it, and what the columns mean. The best child run gets `vidtune.best`."""
        c, parent = self.client, self.open_parent()
        best_run = self.child_runs.get(best_trial_id) if best_trial_id else None
        for run_id in self.child_runs.values():
            if run_id == best_run:
                c.set_tag(run_id, BEST_TAG, "true")
            elif BEST_TAG in c.get_run(run_id).data.tags:
                c.delete_tag(run_id, BEST_TAG)
        best_line = (f"Best trial by {objective}: [{c.get_run(best_run).info.run_name}]"
                     f"({mlflow_view.run_link(self.experiment_id, best_run)}) (tag `{BEST_TAG}`)." if best_run
                     else "No trial produced a usable result.")
        table_line = (f"[Compare the trials]({mlflow_view.runs_link(self.experiment_id, self.view_id)}): "
                      "this search's runs table, best first.")
        held = {a.path for a in c.list_artifacts(parent)}
        plots = [f"![{name}](get-artifact?path={name}&run_uuid={parent})\n\n"
                 f"{sentence.format(objective=objective)}\n"
                 for name, sentence in PLOT_SENTENCES if name in held]
        note = "\n".join([
            *[f"{line}\n" for line in answer],
            f"**vidtune search** `{Path(self.experiment_path).name}` ({self.experiment_path})", "",
            best_line + " " + table_line, "", table_markdown, "",
            *plots,
            "Each trial's run holds its summary (`best_val_acc`, `best_val_acc_low` / `_high`: its 95% "
            "interval, `best_epoch`, `best_val_f1`, `speed_clips_per_s`: the steady-state clips/s) and its "
            "history per epoch (step = epoch; `lr_current` is the schedule's learning rate, the param `lr` "
            f"its peak). `{OUTCOME_TAG}` says how it ended: done, stopped early (by ASHA; FINISHED), out of "
            "memory, diverged (its loss became inf or NaN), failed (FAILED; see `vidtune.failure_reason`), "
            f"interrupted (KILLED; see `vidtune.stop_reason`). Also there: `{BEST_TAG}`, `{GPU_IDS_TAG}`, "
            f"`{NODE_TAG}`.",
        ])
        c.set_tag(parent, "mlflow.note.content", note[:60000])


OUTCOMES = {"DONE": "done", "STOPPED": "stopped early", "OOM": "out of memory", "DIVERGED": "diverged",
            "ERROR": "failed", "UNFINISHED": "interrupted"}


def placement_tags(result: dict[str, Any]) -> dict[str, str]:
    """The tags saying where a trial trained, from one of its reports (`trainer.worker`):
    NODE_TAG (the nodes' IPs, else the Ray node id), GPU_IDS_TAG ("" on the CPU) and
    NODE_ID_TAG; only those the report holds as strings."""
    text = {k: result.get(k) for k in ("node_id", "node_ip", "gpu_ids")}
    text = {k: v for k, v in text.items() if isinstance(v, str)}
    tags = {}
    if text.get("node_id"):
        tags[NODE_ID_TAG] = text["node_id"]
    if text.get("node_ip") or text.get("node_id"):
        tags[NODE_TAG] = text.get("node_ip") or text["node_id"]
    if "gpu_ids" in text:
        tags[GPU_IDS_TAG] = text["gpu_ids"]
    return tags


def _q(text: str) -> str:
    return text.replace("'", "\\'")


def _log_params(client: MlflowClient, run_id: str, params: dict[str, Any]) -> None:
    items = [Param(k, str(v)[:6000]) for k, v in params.items() if v is not None]
    if items:
        client.log_batch(run_id, params=items)


def _from_scratch(result: dict[str, Any]) -> bool:
    """The report is the first epoch of a run that found every checkpoint damaged and started
    again from epoch 1 (`trainer.worker._read_checkpoint`)."""
    return int(result.get("damaged_checkpoints") or 0) > 0 and int(result.get("resumed_from_epoch") or 0) == 0


def live_row(trial_id: str, config: dict[str, Any], records: dict[int, dict[str, Any]],
             status: str) -> TrialRow:
    """A trial's row from the epochs the tracker saw (epoch -> its report's _SUMMARY_INPUTS), by
    `tune.results`' rules: the best epoch by val_acc (ties: the later) among those that trained,
    the steady-state speeds (`trainer.metrics.steady_state`), none of either for out of memory or
    diverged (`status` in NO_RESULT). No checkpoint: the final row (`reconcile`) has it."""
    trained = {e: r for e, r in records.items()
               if status not in NO_RESULT and not (_flag(r, "oom") or _flag(r, "diverged"))}
    best_epoch, best = 0, {}
    for epoch, record in sorted(trained.items()):
        acc = _number(record.get("val_acc"))
        if math.isfinite(acc) and (not best or acc >= _number(best["val_acc"])):
            best_epoch, best = epoch, record

    def steady(key: str) -> float:
        return steady_state({e: _number(r.get(key)) for e, r in trained.items()})

    return TrialRow(trial_id=trial_id, batch_size=int(config.get("batch_size") or 0),
                    lr=_number(config.get("lr")), weight_decay=config.get("weight_decay"),
                    val_acc=_number(best.get("val_acc")), val_f1=_number(best.get("val_f1")),
                    clips_per_s=steady("clips_per_s"), epoch_time_s=steady("epoch_time_s"),
                    epochs=max(records, default=0), status=status, checkpoint=None, best_epoch=best_epoch)


def _number(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _flag(record: dict[str, Any], key: str) -> bool:
    return _number(record.get(key)) == 1
