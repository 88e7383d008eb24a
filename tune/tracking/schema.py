"""What vidtune writes in MLflow, and under which names: the tags of the parent run and of each
trial's child run, the words of a trial's outcome, and which values of a trial's report are
metrics (`numeric_metrics`: those `trainer.training.report_keys` declares). The writer is
`tune.tracking.tracker`; the parent's description (`tune.tracking.description`), bench/ and the
tests read the same names from here.
"""
from __future__ import annotations

import numbers
from typing import Any

from ray.tune.result import AUTO_RESULT_KEYS

from vidtune.trainer.training.report_keys import EPOCH_METRICS, SETTING_KEYS, Key, declared
from vidtune.tune.outputs.results import rounded_speed
from vidtune.tune.outputs.status import Status

EXPERIMENT_PATH_TAG = "vidtune.experiment_path"
TRIAL_ID_TAG = "vidtune.trial_id"
# The tags a report's keys set (`trainer.training.report_keys` names each key's tag)
NODE_ID_TAG = Key.NODE_ID.mlflow
NODE_TAG = Key.NODE_IP.mlflow          # the IPs of the nodes the trial trained on (else NODE_ID_TAG's id)
GPU_IDS_TAG = Key.GPU_IDS.mlflow       # physical ids of the GPUs it trained on ("0", "2,3"); "" on the CPU
# What the trial's workers trained with, as they reported it (`trainer.training.settings.worker_settings`):
# report key -> tag on the trial's run.
SETTING_TAGS = {key: key.mlflow for key in SETTING_KEYS}
NOTE_TAG = "mlflow.note.content"   # a run's description in MLflow's UI (the top of its page)
FAILURE_TAG = "vidtune.failure_reason"
STOP_TAG = "vidtune.stop_reason"
RESUMED_TAG = Key.RESUMED_FROM_EPOCH.mlflow   # the run restarted from a checkpoint (worker died, or --resume)
PARENT_TAG = "mlflow.parentRunId"
INTERRUPTED_REASON = "search interrupted; continue it with --resume"
MLFLOW_RUN_KEY = "mlflow_run_id"  # the result key the tracker adds; the Optuna trial's attribute
# What Tune and the tracker add to a trial's results (its dataframe also flattens the config into
# `config/<name>` columns): not the trainer's, never metrics (a missing run id reads back as NaN).
TUNE_KEYS = frozenset(AUTO_RESULT_KEYS) | {"done", "trial_id", "experiment_tag", "checkpoint_path",
                                           "should_checkpoint", MLFLOW_RUN_KEY}
STEP_METRIC = Key.CLIPS_PER_S    # logged for every epoch (0 for out of memory): which steps a run has
OUTCOME_TAG = "vidtune.outcome"  # done | stopped early | out of memory | diverged | failed | interrupted
BEST_TAG = "vidtune.best"
# The best val_acc's 95% interval as one readable runs-table column, "[0.58, 0.87]" (the bounds are
# also metrics, `best_val_acc_low` / `_high`, kept out of the charts)
INTERVAL_TAG = "best_val_acc_95ci"
READER_TAG = Key.READER_FAILURES.mlflow
TRACEBACK_ARTIFACT = "failure/traceback.txt"   # a failed trial's whole traceback, on its child run
# OUTCOME_TAG's word for each trial status (`tune.outputs.status.Status`)
OUTCOMES = {s.value: s.word for s in Status}
# An epoch's speeds, logged to `tune.outputs.results.SPEED_DECIMALS` as the trial's speed is
SPEED_KEYS = frozenset({Key.CLIPS_PER_S.value, Key.COMPUTE_CLIPS_PER_S.value})


_UNDECLARED: set[str] = set()   # the undeclared keys `numeric_metrics` has warned of


def numeric_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The training metrics of one Tune result (a live result, or a row of Tune's per-epoch
    dataframe): the numbers of the keys `trainer.training.report_keys` declares metrics, under their MLflow
    names (`lr` as `lr_current`); the speeds (SPEED_KEYS) rounded as trials.csv rounds them."""
    out = {}
    for key, value in result.items():
        # numbers.Real: Tune's dataframes hold numpy scalars; bool (and numpy's bool_) are not metrics.
        if key in TUNE_KEYS or key.startswith("config/") or isinstance(value, bool) \
                or type(value).__name__ == "bool_" or not isinstance(value, numbers.Real):
            continue
        if key in EPOCH_METRICS:
            out[EPOCH_METRICS[key]] = rounded_speed(float(value)) if key in SPEED_KEYS else float(value)
        elif declared(key) is None:
            # A number nobody declared (a key added to a report, or an older vidtune's): logged, so
            # no chart loses it, and said once, so it is declared (tests/test_report_keys.py fails).
            if key not in _UNDECLARED:
                _UNDECLARED.add(key)
                print(f"MLflow: the report key {key!r} is not declared in "
                      f"trainer/training/report_keys.py; logged "
                      "as a metric", flush=True)
            out[key] = float(value)
    return out
