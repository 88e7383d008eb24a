"""MLflow: one parent run per search, one nested child run per trial, all written from the search
(driver) process: one writer (safe for SQLite), and it works on a cluster whose workers cannot
reach the store.

A run never stays RUNNING: FINISHED, FAILED (error, out of memory; reason in the tag
`vidtune.failure_reason`) or KILLED (stopped early by ASHA, or interrupted). A resumed search
finds its parent run by the tag `vidtune.experiment_path` and its child runs by `vidtune.trial_id`
under that parent, so nothing is logged twice as a new run.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ray.tune import Callback
from ray.tune.result import AUTO_RESULT_KEYS

from datasets.flags import ConfigError

EXPERIMENT_PATH_TAG = "vidtune.experiment_path"
TRIAL_ID_TAG = "vidtune.trial_id"
NODE_ID_TAG = "vidtune.node_id"
FAILURE_TAG = "vidtune.failure_reason"
STOP_TAG = "vidtune.stop_reason"
PARENT_TAG = "mlflow.parentRunId"
HEALTH_TIMEOUT_S = 3.0
# Tune's bookkeeping keys and the checkpoint path are not training metrics.
# The epoch's start/end are unix times, kept in Tune's results for timelines, not metrics to chart.
_NOT_METRICS = set(AUTO_RESULT_KEYS) | {"done", "trial_id", "experiment_tag", "checkpoint_path",
                                        "should_checkpoint", "node_id", "epoch_start_ts", "epoch_end_ts"}


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
                    raise ConfigError(flag, f"{uri} answered {resp.status} at /health; check the server and its address")
        except urllib.error.HTTPError as e:
            raise ConfigError(flag, f"{uri} answered {e.code} at /health; check the server and its address") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ConfigError(flag, f"cannot reach {uri} ({reason}); start the tracking server "
                             "(mlflow server --host 0.0.0.0 --port 5000) or pass another URI") from None
        return
    if scheme == "sqlite":
        path = sqlite_path(uri)
        if path is None:
            raise ConfigError(flag, f"{uri} names no database file; write it as sqlite:///FILE (relative) or sqlite:////abs/FILE")
        folder = path.parent
        if not folder.is_dir():
            raise ConfigError(flag, f"the folder {folder} of {uri} does not exist; create it or pass another URI")
        if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise ConfigError(flag, f"{path if path.exists() else folder} is not writable; pass a URI in a writable folder")
        return
    if scheme in ("", "file"):
        raise ConfigError(flag, f"{uri}: MLflow 3 refuses plain file stores without an opt-in; use sqlite:///mlruns.db or a server URI")
    # databricks, postgresql, mysql, ...: MLflow checks these itself when it connects.


def git_commit(repo: Path) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=5)
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


# -- the writer ----------------------------------------------------------------------------------

def numeric_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The training metrics of one Tune result: every int/float the trainer reported."""
    out = {}
    for key, value in result.items():
        if key in _NOT_METRICS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[key] = float(value)
    return out


class MLflowTracker(Callback):
    """Tune callback writing the parent and child runs. Holds no MLflow objects until `setup`
    (Tune pickles its callbacks with the experiment so `--resume` gets them back).

    `child_params`: params every child run gets (precision, model, workers, gpus, dataset);
    the sampled values (batch_size, lr, weight_decay) are added per trial.
    """

    def __init__(self, *, tracking_uri: str, experiment: str, experiment_path: str, epochs: int,
                 parent_params: dict[str, Any], parent_tags: dict[str, str], child_params: dict[str, Any]):
        self.tracking_uri = tracking_uri
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

    # state ---------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        return state

    @property
    def client(self):
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

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
        found = c.search_runs([exp_id], filter_string=f"tags.`{EXPERIMENT_PATH_TAG}` = '{_q(self.experiment_path)}'",
                              max_results=1)
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
        for run in c.search_runs([exp_id], filter_string=f"tags.`{PARENT_TAG}` = '{self.parent_run_id}'",
                                 max_results=10000):
            trial_id = run.data.tags.get(TRIAL_ID_TAG)
            if trial_id:
                self.child_runs[trial_id] = run.info.run_id
        return self.parent_run_id

    # Tune hooks ----------------------------------------------------------------------------
    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.start_child(trial.trial_id, trial.config)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        self.log_result(trial.trial_id, result)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        status, tags = self.completion_status(trial.last_result or {})
        self.end_child(trial.trial_id, status, tags)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.end_child(trial.trial_id, "FAILED", {FAILURE_TAG: _error_reason(trial)})

    # the work ------------------------------------------------------------------------------
    def start_child(self, trial_id: str, config: dict[str, Any]) -> str:
        c = self.client
        parent = self.open_parent()
        run_id = self.child_runs.get(trial_id)
        if run_id:                          # resumed trial: same run, running again
            c.update_run(run_id, status="RUNNING")
            # Epochs already logged are not logged twice (a resumed trial re-reports its last one).
            steps = [m.step for m in c.get_metric_history(run_id, "epoch")]
            self._last_step[trial_id] = max(steps, default=0)
            return run_id
        tags = {PARENT_TAG: parent, TRIAL_ID_TAG: trial_id, "mlflow.runName": trial_id}
        run = c.create_run(self.experiment_id, tags=tags, run_name=trial_id)
        run_id = run.info.run_id
        self.child_runs[trial_id] = run_id
        _log_params(c, run_id, {**self.child_params, **config})
        return run_id

    def log_result(self, trial_id: str, result: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        run_id = self.child_runs.get(trial_id) or self.start_child(trial_id, result.get("config", {}))
        step = int(result.get("epoch") or result.get("training_iteration") or 0)
        if step <= self._last_step.get(trial_id, 0):
            return
        self._last_step[trial_id] = step
        ts = int(float(result.get("timestamp") or time.time()) * 1000)
        metrics = [Metric(k, v, ts, step) for k, v in numeric_metrics(result).items()]
        if metrics:
            self.client.log_batch(run_id, metrics=metrics)
        node = result.get("node_id")
        if node and trial_id not in self._node_tagged:
            self.client.set_tag(run_id, NODE_ID_TAG, str(node))
            self._node_tagged.add(trial_id)

    def completion_status(self, last: dict[str, Any]) -> tuple[str, dict[str, str]]:
        """The MLflow status of a trial Tune completed (`tune.report.trial_status`): FAILED for
        out of memory, KILLED when stopped before the last epoch, else FINISHED."""
        from tune.report import trial_status

        status = trial_status(last, epochs=self.epochs)
        if status == "OOM":
            return "FAILED", {FAILURE_TAG: f"out of memory at batch size {last.get('batch_size')} "
                                           f"(epoch {last.get('epoch')}, peak {last.get('peak_mem_mb', float('nan')):.0f} MB); "
                                           "recorded as infeasible, not retried"}
        if status == "STOPPED":
            epoch = int(last.get("epoch") or 0)
            return "KILLED", {STOP_TAG: f"stopped early by ASHA after epoch {epoch} of {self.epochs}"}
        return "FINISHED", {}

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
        for trial_id, run_id in self.child_runs.items():
            if c.get_run(run_id).info.status == "RUNNING":
                c.set_tag(run_id, STOP_TAG, "search interrupted; continue it with --resume")
                c.set_terminated(run_id, status="KILLED")
        c.set_terminated(self.parent_run_id, status="KILLED" if interrupted else "FINISHED")

    def retire_lost_runs(self, trial_ids: set[str]) -> list[str]:
        """Child runs of trials the Tune experiment does not know: started just before the driver
        died, after Tune last saved its state, so `--resume` ran their slot again as new trials.
        They end KILLED with the reason and are moved to MLflow's trash (restorable), so the
        experiment shows one run per trial. Returns their trial ids."""
        lost = [t for t in self.child_runs if t not in trial_ids]
        for trial_id in lost:
            run_id = self.child_runs.pop(trial_id)
            self.client.set_tag(run_id, STOP_TAG, "lost when the search driver died before Tune saved it; "
                                "--resume ran this slot again as another trial")
            if self.client.get_run(run_id).info.status == "RUNNING":
                self.client.set_terminated(run_id, status="KILLED")
            self.client.delete_run(run_id)
        return lost

    def log_summary(self, *, table_csv: Path | None = None, plot_png: Path | None = None,
                    best: dict[str, Any] | None = None, best_checkpoint: str | None = None) -> None:
        """Summary artifacts on the parent run: trials table, scatter plot, best config, best checkpoint."""
        c, run_id = self.client, self.open_parent()
        for path in (table_csv, plot_png):
            if path and Path(path).exists():
                c.log_artifact(run_id, str(path))
        if best is not None:
            with tempfile.TemporaryDirectory() as tmp:
                f = Path(tmp) / "best_config.json"
                f.write_text(json.dumps(best, indent=2, sort_keys=True, default=str))
                c.log_artifact(run_id, str(f))
            for key in ("val_acc", "val_f1", "clips_per_s", "compute_clips_per_s"):
                value = best.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    c.log_metric(run_id, f"best_{key}", float(value))
        if best_checkpoint and not best_checkpoint.startswith(("s3://", "gs://")) and Path(best_checkpoint).is_dir():
            c.log_artifacts(run_id, best_checkpoint, artifact_path="best_checkpoint")


def _q(text: str) -> str:
    return text.replace("'", "\\'")


def _log_params(client: Any, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(k, str(v)[:6000]) for k, v in params.items() if v is not None]
    if items:
        client.log_batch(run_id, params=items)


def _error_reason(trial: Any) -> str:
    """The last line of the trial's error file (the exception), or a pointer to it."""
    path = getattr(trial, "error_file", None)
    try:
        if path and Path(path).exists():
            lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
            if lines:
                return f"{lines[-1].strip()[:1000]} (full traceback: {path})"
    except OSError:
        pass
    return f"trial errored; see {path or 'the Ray logs'}"
