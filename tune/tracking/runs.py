"""What goes into one search's MLflow runs, given their ids: a trial's searched values as params
(`shown_config`), the tags an epoch's report sets (a restart, unreadable clips, where the trial
trained: `placement_tags`), a trial's final status with its reason tags (`mlflow_status`), a
failed trial's traceback, a child run's summary metrics (the values of its trials.csv row), the
parent's summary (result files, `best_*` metrics, the best checkpoint), the parent's page in the
UI (`tune.tracking.description`) and the console's links to it (`summary_links`).

`RunWriter` is mixed into `tune.tracking.tracker.MLflowTracker`, which owns the state it reads
(`tracking_uri`, `_client`, `experiment_id`, `experiment_path`, `parent_run_id`, `child_runs`,
`view_id`, `epochs`, `objective`, `val_clips`) and decides which runs exist and when to write.
"""
from __future__ import annotations

import math
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from vidtune import __version__
from vidtune.numbers import significant
from vidtune.trainer.training.report_keys import Key, number
from vidtune.tune.outputs.results import (
    NO_RESULT,
    RECORD_NAMES,
    SPEED_METRIC,
    TrialResult,
    rounded_speed,
    summary_metrics,
)
from vidtune.tune.outputs.status import word_of
from vidtune.tune.outputs.uncertainty import format_interval
from vidtune.tune.running.faults import error_text, exception_line, keep_traceback
from vidtune.tune.tracking import description
from vidtune.tune.tracking.schema import (
    FAILURE_TAG,
    GPU_IDS_TAG,
    INTERRUPTED_REASON,
    INTERVAL_TAG,
    NODE_ID_TAG,
    NODE_TAG,
    NOTE_TAG,
    READER_TAG,
    RESUMED_TAG,
    SETTING_TAGS,
    STOP_TAG,
    TRACEBACK_ARTIFACT,
)


class RunWriter:
    """The writes into one run (see the module docstring); `open_parent` is the tracker's."""

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _tag_restart(self, run_id: str, result: dict[str, Any]) -> None:
        """Per-epoch facts kept as tags: a restart from a checkpoint, unreadable videos."""
        failures = int(result.get(Key.READER_FAILURES) or 0)
        if failures > 0:
            self.client.set_tag(run_id, READER_TAG, f"{failures} clip read(s) failed in epoch "
                                f"{result.get(Key.EPOCH)}; each was replaced by another clip of the same "
                                "class")
        resumed = int(result.get(Key.RESUMED_FROM_EPOCH) or 0)
        damaged = int(result.get(Key.DAMAGED_CHECKPOINTS) or 0)
        skipped = f"; {damaged} damaged checkpoint(s) skipped" if damaged else ""
        if resumed > 0:
            self.client.set_tag(run_id, RESUMED_TAG, f"restarted from its epoch-{resumed} checkpoint (a "
                                "worker died and Ray Train restarted the group, or the search was resumed)"
                                f"{skipped}")
        elif from_scratch(result):
            self.client.set_tag(run_id, RESUMED_TAG, f"restarted from epoch 1: its {damaged} checkpoint(s) "
                                "were damaged; epochs from 1 on are logged again (the later point of a step "
                                "is this run's)")

    def mlflow_status(self, status: str, last: dict[str, Any],
                      error: BaseException | str | None = None) -> tuple[str, dict[str, str]]:
        """The MLflow status and reason tag of a trial's `tune.outputs.results.trial_status`: FAILED for
        out of memory, divergence or an error, KILLED when interrupted, else FINISHED (stopped
        early by ASHA too, with the reason in STOP_TAG)."""
        if status == "OOM":
            peak = last.get(Key.PEAK_MEM_MB, float("nan"))
            return "FAILED", {FAILURE_TAG: f"out of memory at batch size {last.get(Key.BATCH_SIZE)} "
                                           f"(epoch {last.get(Key.EPOCH)}, peak {peak:.0f} MB); "
                                           "recorded as infeasible, not retried"}
        if status == "DIVERGED":
            return "FAILED", {FAILURE_TAG: f"diverged: the training loss became {last.get(Key.TRAIN_LOSS)} "
                                           f"in epoch {last.get(Key.EPOCH)} (batch size "
                                           f"{last.get(Key.BATCH_SIZE)}); the lr is too high for it; "
                                           "recorded as infeasible, not retried"}
        if status == "ERROR":
            return "FAILED", {FAILURE_TAG: exception_line(error_text(error)) if error else "trial errored"}
        if status == "UNFINISHED":
            return "KILLED", {STOP_TAG: INTERRUPTED_REASON}
        if status == "STOPPED":
            epoch = int(last.get(Key.EPOCH) or 0)
            return "FINISHED", {STOP_TAG: f"stopped early by ASHA after epoch {epoch} of {self.epochs}"}
        return "FINISHED", {}

    def record_failure(self, run_id: str, name: str, text: str, *, fallback: str | None = None) -> str:
        """Keep a failed trial's whole traceback `text` (`tune.running.faults.keep_traceback`: the first
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

    def log_summary(self, *, files: list[Path] = (), best: TrialResult | None = None,
                    best_checkpoint: str | None = None, metrics: dict[str, float] | None = None) -> None:
        """Summary on the parent run: the result files as artifacts (trials.csv, best_config.json,
        the plots, and the plots' narrow copies the description shows), the best trial's metrics
        as `best_*`, `metrics` (the parameter importances,
        `importance_lr`, ...), and its checkpoint."""
        c, run_id = self.client, self.open_parent()
        for path in files:
            if path and Path(path).exists():
                c.log_artifact(run_id, str(path))
        with tempfile.TemporaryDirectory(prefix="vidtune-previews-") as tmp:
            if description.write_previews([Path(p) for p in files if p], Path(tmp)):
                c.log_artifacts(run_id, tmp, artifact_path=description.PREVIEW_FOLDER)
        if best is not None:
            # the best trial's accuracy, F1 and speed under their summary names (RECORD_NAMES:
            # best_val_acc, best_val_f1, speed_clips_per_s), as on its own run and in trials.csv
            for field_name, key in RECORD_NAMES.items():
                value = number(getattr(best, field_name))
                value = rounded_speed(value) if key == SPEED_METRIC else value
                if math.isfinite(value):
                    c.log_metric(run_id, key, value)
        for key, value in (metrics or {}).items():
            c.log_metric(run_id, key, float(value))
        local = best_checkpoint and not best_checkpoint.startswith(("s3://", "gs://"))
        if local and Path(best_checkpoint).is_dir():
            c.log_artifacts(run_id, best_checkpoint, artifact_path="best_checkpoint")

    def log_trial_summary(self, run_id: str, row: TrialResult) -> None:
        """A child run's summary, the values of its row in trials.csv (`summary_metrics`; trials.csv
        rounds the accuracy it shows, MLflow keeps it as measured, 21/32 as 0.65625; the speed is
        to SPEED_DECIMALS in both): SUMMARY_KEYS and
        best_val_f1 (the same epoch's F1), at step 0. A key without a value (no accuracy, no speed)
        is left out, one MLflow already has is not written again."""
        values = summary_metrics(row, self.val_clips)
        values[Key.BEST_VAL_F1.value] = math.nan if row.status in NO_RESULT else number(row.val_f1)
        have = self.client.get_run(run_id).data.metrics
        ts = int(time.time() * 1000)
        metrics = [Metric(k, float(v), ts, 0) for k, v in values.items()
                   if math.isfinite(v) and have.get(k) != v]
        if metrics:
            self.client.log_batch(run_id, metrics=metrics)
        self.client.set_tag(run_id, NOTE_TAG, trial_description(row, self.val_clips, self.epochs))
        interval = format_interval(values[Key.BEST_VAL_ACC_LOW], values[Key.BEST_VAL_ACC_HIGH])
        if interval:   # the runs table's one readable interval column
            self.client.set_tag(run_id, INTERVAL_TAG, interval)

    # the parent's page in the UI (`tune.tracking.description`) ------------------------------------
    def save_view(self) -> None:
        self.view_id = description.save_view(
            self.client, tracking_uri=self.tracking_uri, experiment_id=self.experiment_id,
            parent_run_id=self.parent_run_id, experiment_path=self.experiment_path, objective=self.objective)

    def runs_table_url(self, *, charts: bool = False) -> str:
        return description.runs_table_url(self.tracking_uri, self.experiment_id, self.view_id, charts=charts)

    def run_url(self, run_id: str) -> str:
        return description.run_url(self.tracking_uri, self.experiment_id, run_id)

    def summary_links(self, pending: str | None) -> str:
        """The console lines that follow the summary's answer: the saved view's charts, ready to
        compare, and the parent run (the store's URI only, when MLflow is not
        up to date, `pending` saying why, or its experiment is unknown)."""
        hint = description.ui_hint(self.tracking_uri)
        if not pending and getattr(self, "experiment_id", None):
            parent = self.run_url(self.parent_run_id)
            if not self.view_id:    # an MLflow UI not checked: the plain table
                return (f"compare the trials in MLflow: {self.runs_table_url()}{hint}\n"
                        f"  the search's run (answer, trials table, plots): {parent}")
            # the charts first; the search's run links the same view as a table and side by side
            return (f"compare the trials in MLflow: {self.runs_table_url(charts=True)}{hint}\n"
                    f"  the search's run (answer, trials table, plots): {parent}")
        return f"compare the trials in MLflow: {self.tracking_uri}{hint}"

    def publish_view(self, *, table_markdown: str, best_trial_id: str | None, objective: str,
                     answer: Sequence[str] = ()) -> None:
        description.publish_view(
            self.client, parent_run_id=self.open_parent(), child_runs=self.child_runs,
            experiment_id=self.experiment_id, experiment_path=self.experiment_path, view_id=self.view_id,
            table_markdown=table_markdown, best_trial_id=best_trial_id, objective=objective, answer=answer)


def placement_tags(result: dict[str, Any]) -> dict[str, str]:
    """The tags saying where a trial trained, from one of its reports (`trainer.cluster.worker`):
    NODE_TAG (the nodes' IPs, else the Ray node id), GPU_IDS_TAG ("" on the CPU) and
    NODE_ID_TAG; only those the report holds as strings."""
    text = {k: result.get(k) for k in (Key.NODE_ID, Key.NODE_IP, Key.GPU_IDS)}
    text = {k: v for k, v in text.items() if isinstance(v, str)}
    tags = {}
    if text.get(Key.NODE_ID):
        tags[NODE_ID_TAG] = text[Key.NODE_ID]
    if text.get(Key.NODE_IP) or text.get(Key.NODE_ID):
        tags[NODE_TAG] = text.get(Key.NODE_IP) or text[Key.NODE_ID]
    if Key.GPU_IDS in text:
        tags[GPU_IDS_TAG] = text[Key.GPU_IDS]
    return tags


def trial_description(row: TrialResult, val_clips: int, epochs: int) -> str:
    """The one line at the top of a trial's run page (its MLflow description): the best epoch's
    accuracy with its 95% interval, which epoch of how many, the outcome and the speed, e.g.
    `best val_acc 0.562 [0.39, 0.72] at epoch 3 of 4; done; 45.1 clips/s`."""
    outcome = word_of(row.status)
    summary = summary_metrics(row, val_clips)
    acc, low, high = (summary[k] for k in (Key.BEST_VAL_ACC, Key.BEST_VAL_ACC_LOW, Key.BEST_VAL_ACC_HIGH))
    if not math.isfinite(acc):
        return f"no accuracy ({outcome}) after {row.epochs} of {epochs} epochs"
    interval = f" {format_interval(low, high)}" if format_interval(low, high) else ""
    fast = math.isfinite(row.clips_per_s) and row.clips_per_s > 0
    speed = f"; {row.clips_per_s:.1f} clips/s" if fast else ""
    return f"best val_acc {acc:.3f}{interval} at epoch {row.best_epoch} of {epochs}; {outcome}{speed}"


def setting_tags(result: dict[str, Any]) -> dict[str, str]:
    """The tags saying what the trial's workers trained with (`SETTING_TAGS`: precision used,
    TF32, cudnn.benchmark, device, compute capability, CUDA, driver, torch), from one of its
    reports; only those the report holds as non-empty strings (a run that ran out of memory
    before it held its device reports none)."""
    return {tag: result[key] for key, tag in SETTING_TAGS.items()
            if isinstance(result.get(key), str) and result[key]}


def shown_config(config: dict[str, Any]) -> dict[str, Any]:
    """A trial's searched values as its MLflow params show them: floats (lr, weight decay) to 3
    significant digits, as trials.csv and the console show them (0.000213, not 0.00021345678);
    the exact values stay in the trial folder's params.json."""
    return {k: significant(v) if isinstance(v, float) else v for k, v in config.items()}


def from_scratch(result: dict[str, Any]) -> bool:
    """The report is the first epoch of a run that found every checkpoint damaged and started
    again from epoch 1 (`trainer.cluster.worker._read_checkpoint`)."""
    damaged, resumed = (int(result.get(k) or 0) for k in (Key.DAMAGED_CHECKPOINTS, Key.RESUMED_FROM_EPOCH))
    return damaged > 0 and resumed == 0


# The clone this code runs from (editable install); an installed wheel has only its version.
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def git_commit(repo: Path) -> str | None:
    """The commit checked out in `repo` (a tag of the parent run), or None outside a vidtune clone."""
    if not (repo / "pyproject.toml").is_file():   # site-packages, perhaps inside someone else's repository
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=5)
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def parent_tags(objective: str) -> dict[str, str]:
    """The search's parent run's own tags: its objective and kind, vidtune's version, and the
    clone's commit where there is one (also as MLflow's `mlflow.source.git.commit`)."""
    tags = {"vidtune.objective": objective, "vidtune.kind": "search", "vidtune.version": __version__}
    commit = git_commit(SOURCE_ROOT)
    if commit:
        tags.update({"mlflow.source.git.commit": commit, "vidtune.git_commit": commit})
    return tags
