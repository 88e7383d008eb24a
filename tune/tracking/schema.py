"""What vidtune writes in MLflow, and under which names: the tags of the parent run and of each
trial's child run, the words of a trial's outcome, and which values of a trial's report are
metrics (`numeric_metrics`). The writer is `tune.tracking.tracker`; the parent's description
(`tune.tracking.description`), bench/ and the tests read the same names from here.
"""
from __future__ import annotations

import numbers
from typing import Any

from ray.tune.result import AUTO_RESULT_KEYS

from vidtune.tune.status import Status

EXPERIMENT_PATH_TAG = "vidtune.experiment_path"
TRIAL_ID_TAG = "vidtune.trial_id"
NODE_ID_TAG = "vidtune.node_id"
NODE_TAG = "node"               # the IPs of the nodes the trial trained on (else NODE_ID_TAG's id)
GPU_IDS_TAG = "gpu_ids"         # physical ids of the GPUs it trained on ("0", "2,3"); "" on the CPU
# What the trial's workers trained with, as they reported it (`trainer.settings.worker_settings`):
# report key -> tag on the trial's run.
SETTING_TAGS = {"precision_used": "vidtune.precision_used", "tf32": "vidtune.tf32",
                "cudnn_benchmark": "vidtune.cudnn_benchmark", "device_name": "vidtune.device",
                "compute_capability": "vidtune.compute_capability", "cuda_version": "vidtune.cuda",
                "driver_version": "vidtune.driver", "torch_version": "vidtune.torch"}
NOTE_TAG = "mlflow.note.content"   # a run's description in MLflow's UI (the top of its page)
FAILURE_TAG = "vidtune.failure_reason"
STOP_TAG = "vidtune.stop_reason"
RESUMED_TAG = "vidtune.resumed"              # the run restarted from a checkpoint (worker died, or --resume)
PARENT_TAG = "mlflow.parentRunId"
INTERRUPTED_REASON = "search interrupted; continue it with --resume"
# Tune's bookkeeping keys and the checkpoint path are not training metrics.
# The epoch's start/end are unix times, kept in Tune's results for timelines, not metrics to chart.
# Constants of a run are params or tags, not metrics to chart: the epoch is each point's step,
# batch_size a param, oom, diverged and resumed_from_epoch tags (FAILURE_TAG, RESUMED_TAG), reader
# failures a tag when there are any, where it ran tags (`placement_tags`; a dataframe row may
# hold "0" read back as a number). The schedule's learning rate is logged as `lr_current`
# (`lr` is the param: the peak the trial was given). steady_clips_per_s is the running estimate
# the Pareto objective reads in Tune; its final value is the run's `speed_clips_per_s`, the one
# speed name a person reads (the per-epoch `clips_per_s` and `compute_clips_per_s` are diagnostics).
_NOT_METRICS = set(AUTO_RESULT_KEYS) | {"done", "trial_id", "experiment_tag", "checkpoint_path",
                                        "should_checkpoint", "node_id", "epoch_start_ts", "epoch_end_ts",
                                        "resumed_from_epoch", "epoch", "batch_size", "oom", "diverged",
                                        "steady_clips_per_s", "reader_failures", "node_ip", "gpu_ids",
                                        "damaged_checkpoints",
                                        *SETTING_TAGS}
RENAMED = {"lr": "lr_current"}
STEP_METRIC = "clips_per_s"      # logged for every epoch (0 for out of memory): which steps a run has
OUTCOME_TAG = "vidtune.outcome"  # done | stopped early | out of memory | diverged | failed | interrupted
BEST_TAG = "vidtune.best"
# The best val_acc's 95% interval as one readable runs-table column, "[0.58, 0.87]" (the bounds are
# also metrics, `best_val_acc_low` / `_high`, kept out of the charts)
INTERVAL_TAG = "best_val_acc_95ci"
READER_TAG = "vidtune.reader_failures"
TRACEBACK_ARTIFACT = "failure/traceback.txt"   # a failed trial's whole traceback, on its child run
# OUTCOME_TAG's word for each trial status (`tune.status.Status`)
OUTCOMES = {s.value: s.word for s in Status}


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
