"""Every key of a trial's reports, declared once with what MLflow makes of it.

Each epoch a Train worker reports one dict (`trainer.cluster.worker`; rank 0's reaches Tune): its keys
are the `EPOCH` members of `Key`, in the order reported (`REPORT_KEYS`). When a trial ends, the
search computes its summary (`tune.outputs.results.summary_metrics`, the child run's metrics and
trials.csv's columns): the `SUMMARY` members. Each key has a role (an MLflow metric, a param, a
tag, the step of every point, or bookkeeping MLflow does not get), the name MLflow shows it
under (`lr` is logged as `lr_current`: the param `lr` is the trial's peak) and one line saying
what it is. `tune.tracking.schema.numeric_metrics` logs the metrics from here; docs/mlflow.md's
table is `markdown_table()`'s (`python -m vidtune.trainer.training.report_keys` rewrites it).

No other library file spells a key: each reads and writes `Key.X` (`Key.X.value` where a plain
string is stored), and takes a report's value as a float through `number` (tests/test_report_keys.py
holds both rules).
"""
from __future__ import annotations

import math
from enum import StrEnum
from pathlib import Path
from typing import Any


class Role(StrEnum):
    METRIC = "metric"              # an MLflow metric: per epoch a point at step = epoch; a summary at step 0
    PARAM = "param"                # an MLflow param, from the trial's config (the report's value equals it)
    TAG = "tag"                    # sets or feeds the MLflow tag named beside it, on the trial's run
    STEP = "step"                  # the step of every per-epoch metric point
    BOOKKEEPING = "bookkeeping"    # in Tune's results and the run's epochs.json only, not in MLflow


class Cadence(StrEnum):
    EPOCH = "per-epoch"            # in every report of a worker
    SUMMARY = "summary"            # once per trial, from its epochs, when it ends


_M, _P, _T, _S, _B = Role.METRIC, Role.PARAM, Role.TAG, Role.STEP, Role.BOOKKEEPING
_E, _SUM = Cadence.EPOCH, Cadence.SUMMARY
_RESUMED, _OUTCOME = "vidtune.resumed", "vidtune.outcome"


class Key(StrEnum):
    """`Key.VAL_ACC == "val_acc"`: a plain string wherever a report is read or written.
    `mlflow`: the metric, param or tag name in MLflow ("" for bookkeeping)."""

    role: Role
    cadence: Cadence
    meaning: str
    mlflow: str

    def __new__(cls, key: str, role: Role, cadence: Cadence, meaning: str, mlflow: str | None = None) -> Key:
        member = str.__new__(cls, key)
        member._value_ = key
        member.role, member.cadence, member.meaning = role, cadence, meaning
        member.mlflow = mlflow if mlflow is not None else "" if role is Role.BOOKKEEPING else key
        return member

    def __repr__(self) -> str:   # the plain string it equals, in a message that shows keys
        return repr(self.value)

    # -- a worker's report, each epoch (`trainer.training.metrics.reduce_epoch`, then
    # `trainer.cluster.worker`)
    EPOCH = "epoch", _S, _E, "the epoch the report ends (from 1): every metric point's step", "step"
    TRAIN_LOSS = "train_loss", _M, _E, "mean training cross-entropy per clip, all workers"
    VAL_LOSS = "val_loss", _M, _E, "mean validation cross-entropy per clip (NaN without a result)"
    VAL_ACC = "val_acc", _M, _E, "share of validation clips classified right (violent when P >= 0.5)"
    VAL_F1 = "val_f1", _M, _E, "F1 of the violent class: 2 TP / (2 TP + FP + FN)"
    VAL_RECALL = "val_recall", _M, _E, "recall of the violent class (1 - recall: the missed-fight rate)"
    VAL_AUC = "val_auc", _M, _E, "ROC AUC of P(violent) (NaN when validation holds one class)"
    CLIPS_PER_S = "clips_per_s", _M, _E, "the epoch's speed: clips / the slowest worker's training time"
    COMPUTE_CLIPS_PER_S = ("compute_clips_per_s", _M, _E,
                           "clips / the slowest worker's time not waiting for data: the model's own speed")
    EPOCH_TIME_S = "epoch_time_s", _M, _E, "wall time of the training epoch, slowest worker (no evaluation)"
    DATA_WAIT_FRAC = "data_wait_frac", _M, _E, "share of the training time spent waiting for clips"
    NONFINITE_STEPS = "nonfinite_steps", _M, _E, "steps whose loss was inf/NaN (fp16: GradScaler skipped)"
    STEADY_CLIPS_PER_S = ("steady_clips_per_s", _B, _E,
                          "median clips_per_s of epochs 2.. so far: pareto's speed in Tune and Optuna")
    PEAK_MEM_MB = ("peak_mem_mb", _M, _E,
                   "GPU: the most memory torch's allocator reserved (MiB); CPU: the process's peak RSS")
    PEAK_ALLOCATED_MB = "peak_allocated_mb", _M, _E, "GPU: the most memory its tensors used (MiB); NaN on CPU"
    LR = "lr", _M, _E, "the schedule's learning rate this epoch (the param lr is its peak)", "lr_current"
    BATCH_SIZE = "batch_size", _P, _E, "the trial's batch size (its param, from the config)"
    OOM = "oom", _T, _E, "1 on the one report of a run out of memory (outcome: out of memory)", _OUTCOME
    DIVERGED = "diverged", _T, _E, "1 on the one report of a run whose loss became inf/NaN", _OUTCOME
    READER_FAILURES = ("reader_failures", _T, _E, "clip reads that failed, each replaced by another clip",
                       "vidtune.reader_failures")
    CACHE_HIT_FRAC = "cache_hit_frac", _M, _E, "clip reads the clip cache served / all clip reads"
    CONCURRENT_TRAININGS = ("concurrent_trainings", _M, _E,
                            "most trainings on the trial's devices at once (1: it had them alone)")
    DEVICE_WAIT_S = "device_wait_s", _M, _E, "time waited for the device before the run's first epoch"
    EPOCH_START_TS = "epoch_start_ts", _B, _E, "unix time the epoch's training started (earliest worker)"
    EPOCH_END_TS = "epoch_end_ts", _B, _E, "unix time the epoch's scoring ended (latest worker)"
    NODE_ID = "node_id", _T, _E, "the Ray node rank 0 trained on", "vidtune.node_id"
    NODE_IP = "node_ip", _T, _E, "the IPs of the nodes its workers trained on", "node"
    GPU_IDS = "gpu_ids", _T, _E, "physical ids of the GPUs it trained on (\"0\", \"2,3\"; \"\" on the CPU)"
    RESUMED_FROM_EPOCH = ("resumed_from_epoch", _T, _E,
                          "after a restart: the epoch of the checkpoint it resumed from; else 0", _RESUMED)
    DEVICE_UTIL_PCT = ("device_util_pct", _M, _E,
                       "device utilisation (NVML; CPU: the process's share of the cores), workers' mean")
    TORCH_THREADS = "torch_threads", _M, _E, "CPU threads torch trained with (on the CPU, clips/s follows it)"
    OTHER_CPU_CORES = ("other_cpu_cores", _M, _E,
                       "cores other processes kept busy on the trial's machine in the epoch (Linux)")
    DAMAGED_CHECKPOINTS = ("damaged_checkpoints", _T, _E,
                           "after a restart: the checkpoints found damaged and skipped; else 0", _RESUMED)
    CACHE_REPAIRS = "cache_repairs", _M, _E, "clip-cache entries found damaged and decoded again, all workers"
    # what the workers trained with (`trainer.training.settings`), read back from torch; "" when unknown
    PRECISION_USED = ("precision_used", _T, _E, "the precision trained in: bf16, fp16+scaler or fp32",
                      "vidtune.precision_used")
    TF32 = "tf32", _T, _E, "float32 precision of CUDA matmuls and convolutions (- on the CPU)", "vidtune.tf32"
    CUDNN_BENCHMARK = ("cudnn_benchmark", _T, _E, "cuDNN autotuning: on or off (- on the CPU)",
                       "vidtune.cudnn_benchmark")
    DEVICE_NAME = "device_name", _T, _E, "the GPU's or the CPU's name", "vidtune.device"
    COMPUTE_CAPABILITY = ("compute_capability", _T, _E, "the GPU's compute capability (\"\" on the CPU)",
                          "vidtune.compute_capability")
    CUDA_VERSION = ("cuda_version", _T, _E, "the CUDA version torch was built for (\"\" on the CPU)",
                    "vidtune.cuda")
    DRIVER_VERSION = "driver_version", _T, _E, "the NVIDIA driver's version", "vidtune.driver"
    TORCH_VERSION = "torch_version", _T, _E, "torch's version", "vidtune.torch"
    ATTN_IMPLEMENTATION = ("attn_implementation", _T, _E,
                           "hf: models: the attention trained with, sdpa or eager (\"\" for other models)",
                           "vidtune.attn_implementation")
    GRADIENT_CHECKPOINTING = ("gradient_checkpointing", _T, _E,
                              "activations recomputed in the backward pass: on or off",
                              "vidtune.gradient_checkpointing")

    # -- a trial's summary (`tune.outputs.results.SUMMARY_KEYS`, and best_val_f1)
    BEST_VAL_ACC = "best_val_acc", _M, _SUM, "val_acc of the best epoch by the objective (ties: the later)"
    BEST_EPOCH = "best_epoch", _M, _SUM, "that best epoch"
    SPEED_CLIPS_PER_S = ("speed_clips_per_s", _M, _SUM,
                         "the trial's speed: median clips_per_s of epochs 2 and later (else epoch 1's)")
    BEST_VAL_ACC_LOW = "best_val_acc_low", _M, _SUM, "best_val_acc's 95% Wilson interval, lower bound"
    BEST_VAL_ACC_HIGH = "best_val_acc_high", _M, _SUM, "best_val_acc's 95% Wilson interval, upper bound"
    BEST_VAL_F1 = "best_val_f1", _M, _SUM, "val_f1 of the best epoch"


REPORT_KEYS = tuple(k for k in Key if k.cadence is Cadence.EPOCH)     # a worker's report, in order
SUMMARY_KEYS = tuple(k for k in Key if k.cadence is Cadence.SUMMARY)
# what the workers trained with (`trainer.training.settings`), in the order the tags show them
SETTING_KEYS = (Key.PRECISION_USED, Key.TF32, Key.CUDNN_BENCHMARK, Key.DEVICE_NAME, Key.COMPUTE_CAPABILITY,
                Key.CUDA_VERSION, Key.DRIVER_VERSION, Key.TORCH_VERSION, Key.ATTN_IMPLEMENTATION,
                Key.GRADIENT_CHECKPOINTING)
# report key -> its MLflow metric name, for the metrics of a report
EPOCH_METRICS = {k: k.mlflow for k in REPORT_KEYS if k.role is Role.METRIC}


def number(value: Any) -> float:
    """A report's value as a float, NaN where it holds none: None, a missing key, a string that
    is no number, anything float() refuses. Numbers stay themselves (NaN and inf too), numpy and
    torch scalars become floats, a bool flag (`oom`, `diverged`) 1.0 or 0.0, and a number written
    as text (a trials.csv cell, "0.75") is read. The one reader of a report's numbers: results,
    console, tracking, the study and the history all take a value through it."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def declared(key: str) -> Key | None:
    """The declaration of report key `key`; None for a key not declared here."""
    try:
        return Key(key)
    except ValueError:
        return None


def in_report_order(report: dict[str, Any]) -> dict[str, Any]:
    """`report` with its keys in REPORT_KEYS order, as plain strings. Raises ValueError when its keys are not
    exactly REPORT_KEYS: a key added to a report without its declaration here (its role in
    MLflow unsaid), or a declared one the report lacks."""
    extra, missing = set(report) - set(REPORT_KEYS), [k for k in REPORT_KEYS if k not in report]
    if extra or missing:
        raise ValueError(f"a worker's report must hold exactly the keys of trainer/training/report_keys.py: "
                         f"undeclared {sorted(extra)}, missing {missing}")
    # plain str keys: a report goes into checkpoints too, which load with weights_only=True
    return {key.value: report[key] for key in REPORT_KEYS}


# docs/mlflow.md holds the table between these lines
TABLE_START = ("<!-- report keys: generated by `python -m vidtune.trainer.training.report_keys`; "
               "do not edit -->")
TABLE_END = "<!-- end of report keys -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "mlflow.md"


def markdown_table() -> str:
    """Every key as a row: the key, its role, cadence, MLflow name and meaning."""
    rows = ["| key | role | cadence | in MLflow | meaning |", "|---|---|---|---|---|"]
    for k in Key:
        shown = f"`{k.mlflow}`" if k.mlflow and k.mlflow != "step" else k.mlflow or "-"
        meaning = k.meaning.replace("|", r"\|")   # a bare "|" would split the cell
        rows.append(f"| `{k.value}` | {k.role.value} | {k.cadence.value} | {shown} | {meaning} |")
    return "\n".join(rows)


def with_table(page: str) -> str:
    """`page` with the text between TABLE_START and TABLE_END replaced by `markdown_table()`."""
    head, found, rest = page.partition(TABLE_START)
    _, ended, tail = rest.partition(TABLE_END)
    if not (found and ended):
        raise ValueError(f"{DOC.name} lacks the lines {TABLE_START!r} and {TABLE_END!r}")
    return f"{head}{TABLE_START}\n{markdown_table()}\n{TABLE_END}{tail}"


if __name__ == "__main__":   # rewrite docs/mlflow.md's table
    DOC.write_text(with_table(DOC.read_text(encoding="utf-8")), encoding="utf-8")
