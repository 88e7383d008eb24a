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
under `tune.outputs.results.SUMMARY_KEYS` (best_val_acc, its 95% interval, best_epoch, speed_clips_per_s),
plus best_val_f1, rounded as trials.csv writes them: from the tracker's own epoch records when the
trial ends, then from its final `TrialResult` in `reconcile`, so the numbers equal trials.csv's.
This module decides which runs exist and when to write; what goes into a run is
`tune.tracking.runs`' (the parent's view, links and description: `tune.tracking.description`'s),
the names of the tags and metrics `tune.tracking.schema`'s. At the end, the search's summary is
computed without MLflow (`tune.summary.Summary`) and handed to `record_summary`, which writes it
into the parent run (result files, `best_*` and importance metrics, the description) and ends
every run.

The store may fail mid-search (a tracking server restarted, a full disk under a SQLite file):
tracking never blocks or stops the search. A failed write marks the store down; the Tune hooks
skip it for `RETRY_AFTER_S`, then try again. Nothing is lost meanwhile: Tune keeps every epoch
of every trial in the experiment folder, and `reconcile` (at the end of the search, and of a
`--resume`) writes every epoch MLflow misses, and each run's final status and tags, from there.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from ray.tune import Callback, Result
from ray.tune.experiment import Trial

from vidtune.trainer.training.report_keys import Key
from vidtune.tune.outputs.found import Summary
from vidtune.tune.outputs.results import (
    SUMMARY_INPUTS,
    TrialResult,
    completed_trial_status,
    epoch_records,
    live_row,
    objective_key,
)
from vidtune.tune.outputs.status import Status, word_of
from vidtune.tune.running.disk_full import stopped_by_full_disk
from vidtune.tune.running.faults import error_text, one_line, read_error_file
from vidtune.tune.running.trial import short_name
from vidtune.tune.tracking import store
from vidtune.tune.tracking.runs import RunWriter, from_scratch, placement_tags, setting_tags, shown_config
from vidtune.tune.tracking.schema import (
    EXPERIMENT_PATH_TAG,
    FAILURE_TAG,
    INTERRUPTED_REASON,
    MLFLOW_RUN_KEY,
    OUTCOME_TAG,
    PARENT_TAG,
    STEP_METRIC,
    STOP_TAG,
    TRIAL_ID_TAG,
    numeric_metrics,
)

RETRY_AFTER_S = 30.0         # after a failed write, the Tune hooks leave the store alone this long


# -- the tracker ---------------------------------------------------------------------------------

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


class MLflowTracker(RunWriter, Callback):
    """Tune callback writing the parent and child runs. Holds no MLflow objects until `setup`
    (Tune pickles its callbacks with the experiment so `--resume` gets them back).

    `child_params`: params every child run gets (precision, model, workers, gpus, dataset);
    the sampled values (batch_size, lr, weight_decay) are added per trial. What it writes into a
    run is `tune.tracking.runs.RunWriter`'s.
    """

    def __init__(self, *, tracking_uri: str, experiment: str, experiment_path: str, epochs: int,
                 parent_params: dict[str, Any], parent_tags: dict[str, str], child_params: dict[str, Any],
                 objective: str = Key.VAL_ACC.value, val_clips: int = 0,
                 artifact_location: str | None = None):
        self.tracking_uri = tracking_uri
        self.artifact_location = artifact_location   # --artifact-location (a new experiment's)
        self.objective = objective     # what the saved view sorts by (`tune.tracking.view.objective_metric`)
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
        self._records: dict[str, dict[int, dict[str, Any]]] = {}   # trial id -> epoch -> SUMMARY_INPUTS
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
        self.__dict__.update({"down_reason": None, "_failed_at": 0.0, "objective": Key.VAL_ACC.value,
                              "val_clips": 0, "_records": {}, "view_id": None,
                              "artifact_location": None, **state})

    def _store_failed(self, e: BaseException) -> None:
        reason = one_line(e)
        if self.down_reason is None:
            print(f"MLflow: cannot write to {self.tracking_uri} ({reason}); the search goes on, and what "
                  "it could not record is written when the store answers again (at the end, or with "
                  "--resume)", flush=True)
        self.down_reason = reason
        self._failed_at = time.monotonic()

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
        location = store.artifact_location(self.tracking_uri, self.artifact_location)
        exp_id = exp.experiment_id if exp else c.create_experiment(self.experiment,
                                                                   artifact_location=location)
        if exp and self.artifact_location and exp.artifact_location != self.artifact_location \
                and not getattr(self, "_said_location", False):
            print(f"MLflow: the experiment {self.experiment!r} already keeps its artifacts in "
                  f"{exp.artifact_location}; --artifact-location applies to a new experiment only "
                  "(pass another --experiment to use it)", flush=True)
            self._said_location = True
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
        # into the trial's last result (Tune lets a callback add to it in place): the searcher
        # puts the run id on the trial's Optuna trial when it ends (`tune.study.dashboard`)
        run_id = self.child_runs.get(trial.trial_id)
        if run_id:
            result[MLFLOW_RUN_KEY] = run_id

    @_guarded
    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        status = completed_trial_status(trial, epochs=self.epochs)
        run_status, tags = self.mlflow_status(status, trial.last_result or {})
        tags[OUTCOME_TAG] = word_of(status)
        run_id = self.child_runs.get(trial.trial_id)
        if run_id:   # shown while the search runs; `reconcile` writes the final row's at the end
            row = live_row(trial.trial_id, trial.config, self._records.get(trial.trial_id, {}), status,
                           metric=objective_key(self.objective))
            self.log_trial_summary(run_id, row)
        self.end_child(trial.trial_id, run_status, tags)

    @_guarded
    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        if stopped_by_full_disk(trial.trial_id):   # KILLED at the end, continued by --resume
            return
        path = getattr(trial, "error_file", None)
        text = read_error_file(path) or f"trial errored; see {path or 'the Ray logs'}"
        run_id = self.child_runs.get(trial.trial_id)
        reason = self.record_failure(run_id, short_name(trial), text, fallback=path) if run_id else ""
        self.end_child(trial.trial_id, "FAILED", {FAILURE_TAG: reason, OUTCOME_TAG: Status.ERROR.word})

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
        _log_params(c, run_id, {**self.child_params, **shown_config(config)})
        return run_id

    def log_result(self, trial_id: str, result: dict[str, Any]) -> None:
        run_id = self.child_runs.get(trial_id) or self.start_child(trial_id, result.get("config", {}))
        step = int(result.get(Key.EPOCH) or result.get("training_iteration") or 0)
        # every report, also one MLflow has: a restarted epoch's later report is the one that counts
        self._records.setdefault(trial_id, {})[step] = {k: result[k] for k in SUMMARY_INPUTS if k in result}
        if int(result.get(Key.RESUMED_FROM_EPOCH) or 0) > 0 or from_scratch(result):
            # The first report since the run restarted from a checkpoint (or from scratch, its
            # checkpoints damaged): the epochs after that checkpoint are trained, and logged,
            # again. A later checkpoint than this one was damaged, or the report of the epoch
            # this one ends never reached MLflow: either way this report is the run's from here.
            self._last_step[trial_id] = min(self._last_step.get(trial_id, 0), step - 1)
        if step <= self._last_step.get(trial_id, 0):
            return
        self._last_step[trial_id] = step
        ts = int(float(result.get("timestamp") or time.time()) * 1000)
        metrics = [Metric(k, v, ts, step) for k, v in numeric_metrics(result).items()]
        if metrics:
            self.client.log_batch(run_id, metrics=metrics)
        self._tag_restart(run_id, result)
        where = {**placement_tags(result), **setting_tags(result)}
        if where and trial_id not in self._node_tagged:   # the trial's first epoch (or first since a resume)
            self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in where.items()])
            self._node_tagged.add(trial_id)

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

    def record_summary(self, summary: Summary) -> str | None:
        """Record the end of the search, computed without MLflow (`tune.summary.summarise`): move
        the runs of trials Tune lost to the trash, bring every child run up to date (`reconcile`),
        log the parent's summary (the result files, `best_*` and importance metrics, the best
        checkpoint), publish its description (the answer first, the trials table) and end every
        run (`close`: KILLED when interrupted). Returns None when MLflow is up to date, else why it
        is not (the store failed); never raises."""
        best = summary.best
        try:
            self.open_parent(refresh=True)
            if summary.trial_states:
                lost = self.retire_lost_runs({trial_id for trial_id, _ in summary.trial_states})
                if lost:
                    print(f"MLflow: {len(lost)} run(s) of trials lost when the earlier driver died moved to "
                          f"the trash: {lost}")
            written = self.reconcile(summary.trials)
            if written:
                print(f"MLflow: wrote {written} epoch(s) it had missed (from the search's saved results)")
            self.log_summary(files=list(summary.files.values()), best=best,
                             best_checkpoint=summary.checkpoint.checkpoint if summary.checkpoint else None,
                             metrics=summary.importance.metrics())
            self.publish_view(table_markdown=summary.table_markdown, objective=summary.objective,
                              best_trial_id=best.trial_id if best else None, answer=summary.answer)
            self.close(interrupted=summary.interrupted)
        except Exception as e:   # the store is down or full: the search's own results stand
            return f"{self.tracking_uri} failed ({one_line(e)})"
        return None

    def reconcile(self, trials: list[tuple[TrialResult, Result, str | None]]) -> int:
        """Bring every child run up to date with what its trial did. Each `(row, result,
        train_run)` holds a `tune.outputs.results.TrialResult` (final status), the trial's Tune `Result`
        (every epoch Tune received, `metrics_dataframe`) and its Train run folder, whose latest
        checkpoint keeps every epoch the run reported (`trainer.training.history`, which covers an epoch
        checkpointed just before an interruption, one Tune never received). Logs each epoch
        MLflow does not have yet (one point per epoch) and sets the run's final status and tags.
        Raises when the store fails. Returns the number of epochs written."""
        c = self.client
        self.open_parent()
        written = 0
        for row, result, train_run in trials:
            run_id = self.child_runs.get(row.trial_id) or self.start_child(
                row.trial_id, dict(result.config or {}), name=row.name or None)
            have = {m.step for m in c.get_metric_history(run_id, STEP_METRIC)}
            records = epoch_records(result, train_run)
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
                tags[FAILURE_TAG] = self.record_failure(run_id, row.label, error_text(result.error))
            tags[OUTCOME_TAG] = word_of(row.status)
            tags.update({**placement_tags(last), **setting_tags(last)})
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


def _q(text: str) -> str:
    return text.replace("'", "\\'")


def _log_params(client: MlflowClient, run_id: str, params: dict[str, Any]) -> None:
    items = [Param(k, str(v)[:6000]) for k, v in params.items() if v is not None]
    if items:
        client.log_batch(run_id, params=items)
