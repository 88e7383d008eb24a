"""Every epoch a run has reported, kept beside each checkpoint as `epochs.json`.

Written by rank 0 into the checkpoint folder at the end of every epoch ({epoch: that epoch's
report}), carried over when a run resumes from a checkpoint. It is the run's own record of its
metrics, independent of Tune and MLflow: when an epoch was checkpointed but never reached Tune
(the search was interrupted right after it), or never reached MLflow (the store was down),
`tune.tracking.tracker.MLflowTracker.reconcile` writes it from here.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from vidtune.trainer.training.report_keys import Key, number

FILE_NAME = "epochs.json"


def write_history(directory: str | Path, history: dict[int, dict[str, Any]]) -> Path:
    """Write {epoch: metrics} (JSON; NaN as NaN) into `directory`; returns the file."""
    path = Path(directory) / FILE_NAME
    path.write_text(json.dumps({str(e): m for e, m in sorted(history.items())}, default=_plain))
    return path


def read_history(directory: str | Path) -> dict[int, dict[str, Any]]:
    """{epoch: metrics} of the checkpoint folder `directory`; {} when it has none or it is damaged."""
    try:
        raw = json.loads((Path(directory) / FILE_NAME).read_text())
        return {int(e): dict(m) for e, m in raw.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def latest_history(run_folder: str | Path) -> dict[int, dict[str, Any]]:
    """The history in the latest checkpoint (`epoch_NNNN` folder) of a Train run folder that has
    one; {} for a remote or missing folder."""
    if "://" in str(run_folder):
        return {}
    folders = sorted(Path(run_folder).glob("epoch_*"), reverse=True)
    for folder in folders:
        history = read_history(folder)
        if history:
            return history
    return {}


# What a run's best epoch can be chosen by: the search's objective (pareto: val_acc, the front's
# accuracy axis), and for a run without a search, val_acc.
BEST_EPOCH_METRICS = (Key.VAL_ACC, Key.VAL_F1)


def best_epoch(history: dict[int, dict[str, Any]],
               metric: str = Key.VAL_ACC) -> tuple[int, dict[str, Any]] | None:
    """(epoch, report) of the best epoch of `history` by `metric` (one of BEST_EPOCH_METRICS;
    ties: the later epoch), among the epochs that trained (not an out-of-memory or diverged
    report); None when no epoch has a finite value. One rule for the results table, `trials.csv`,
    MLflow's summary metrics, the checkpoints kept and what the searcher is told
    (`tune.study.space.VidtuneOptunaSearch`)."""
    if metric not in BEST_EPOCH_METRICS:
        raise ValueError(f"a best epoch is chosen by one of {BEST_EPOCH_METRICS}, not {metric!r}")
    best = None
    for epoch, record in sorted(history.items()):
        value = number(record.get(metric))
        trained = number(record.get(Key.OOM)) != 1 and number(record.get(Key.DIVERGED)) != 1
        if not (trained and math.isfinite(value)):
            continue
        if best is None or value >= number(best[1][metric]):
            best = (epoch, record)
    return best


def _plain(value: Any) -> Any:
    """numpy / torch scalars as Python numbers."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)
