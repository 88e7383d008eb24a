"""A full disk under `--storage` stops the search at once, as Ctrl-C does, and says so in one line.

A trial whose checkpoint (or Tune's copy of its files) fails with errno 28 (ENOSPC) is not
retried, and no other trial starts: the retry, and every trial after it, would fail on the same
disk. `DiskFullStop`, a Tune callback, sees the failed trial (`on_trial_recover`, where Tune has
just queued its retry; `on_trial_error` with `--max-failures 0`) and asks Tune for its graceful
stop (SIGUSR1, as `tune.running.faults` does for Ctrl-C): the loop ends before the retry or any other
trial starts. The trials live then are recorded as unfinished (`tune.running.faults.STATE`), so the
summary counts the trials that ran, shows them UNFINISHED, MLflow ends their runs KILLED, and
Optuna is not told they failed (with `--max-failures 0` Tune tells the searcher FAIL before any
callback runs, and that stays: docs/troubleshooting.md): `--resume`, once space is freed,
continues them under the same trial ids, from their last whole checkpoint (`vidtune.atomic_fs`
keeps every file whole or absent). The console and the MLflow tracker, called after
`DiskFullStop`, say nothing of such a trial's error (`stopped_by_full_disk`).

`message` is the line the search ends with: where, how much space to free, what was kept, how to
continue.
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from ray.tune import Callback
from ray.tune.experiment import Trial

from vidtune.errors import no_space_left
from vidtune.tune.running import faults
from vidtune.tune.running.ray_internals import check_experiment_state

# Train keeps a run's best 2 checkpoints by the score and always its latest
# (trainer.cluster.build_trainer's CheckpointConfig): what a trial holds on the disk at most.
CHECKPOINTS_PER_TRIAL = 3


def disk_full_text(trial: Trial) -> str | None:
    """Why `trial` failed on a full disk (errno 28 in its error file's text), or None."""
    text = faults.read_error_file(getattr(trial, "error_file", None))
    return no_space_left(OSError(text)) if text else None


def stop_on_disk_full(trials: list[Trial], trial: Trial, why: str) -> None:
    """Record the full disk and the trials live now as unfinished (`trial` among them, which the
    disk stopped, not its own code), and ask Tune to stop after this step."""
    state = faults.STATE
    if state.interrupted:
        return
    state.disk_full = why
    state.signal_name = "disk full"
    state.unfinished = {t.trial_id for t in trials if t.status in faults.LIVE_STATES} | {trial.trial_id}
    state.known = {t.trial_id for t in trials}
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is not None and signal.getsignal(usr1) not in (signal.SIG_IGN, signal.SIG_DFL):
        os.kill(os.getpid(), usr1)   # Tune's graceful stop: no further trial starts


def stopped_by_full_disk(trial_id: str) -> bool:
    """Whether the full disk stopped trial `trial_id` (an unfinished trial, not a failed one):
    the console and the MLflow tracker, called after `DiskFullStop`, say nothing of its error."""
    return faults.STATE.disk_full is not None and trial_id in faults.STATE.unfinished


class DiskFullStop(Callback):
    """Stops the search at the first trial that failed on a full disk (module docstring). First
    among the search's callbacks, so the others see the trial as unfinished, not failed."""

    def on_trial_recover(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        why = disk_full_text(trial)
        if why:
            stop_on_disk_full(trials, trial, why)

    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self.on_trial_recover(iteration, trials, trial)


def checkpoint_bytes(experiment_path: str) -> int:
    """The size of the largest whole checkpoint folder of the search's Train runs (0: none)."""
    sizes = [sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
             for folder in Path(experiment_path).glob("train_runs/*/epoch_[0-9]*") if folder.is_dir()]
    return max(sizes, default=0)


def space_needed(experiment_path: str, storage: str, trials_left: int) -> str:
    """How much to free under `storage` for `trials_left` trials to keep their checkpoints: ""
    on remote storage or before any checkpoint."""
    if "://" in storage:
        return ""
    size = checkpoint_bytes(experiment_path)
    if not size:
        return ""
    try:
        free = shutil.disk_usage(storage).free
    except OSError:
        free = 0
    need = max(size * CHECKPOINTS_PER_TRIAL * max(trials_left, 1) - free, size)
    return (f"free at least {_mb(need)} there (a checkpoint is {_mb(size)}; each of the {trials_left} "
            f"trial{'s' if trials_left != 1 else ''} left keeps up to {CHECKPOINTS_PER_TRIAL})")


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n < 2**30 else f"{n / 2**30:.1f} GB"


def stopped_error() -> OSError | None:
    """The full disk that stopped the search (`DiskFullStop`), as an OSError, or None."""
    why = faults.STATE.disk_full
    return OSError(errno.ENOSPC, why) if why else None


def state_readable(experiment_path: str) -> bool:
    """Whether Tune's saved state under `experiment_path` is whole (a --resume can read it)."""
    try:
        check_experiment_state(experiment_path)
    except ValueError:
        return False
    return True


def message(storage: str, experiment_path: str, search_path: str, why: str, *, trials_left: int,
            resumable: bool, last_good: bool, resume: str) -> str:
    """The one line a search that stopped on a full disk ends with (`DiskFullError`); `resume`:
    the command that continues the search."""
    kept = faults.kept_checkpoints(experiment_path)
    kept = f"; {kept}" if kept else ""
    free = space_needed(experiment_path, storage, trials_left) or "free space there"
    if resumable:
        then = (f"{free} (or pass another --storage and copy {search_path} to it), then continue the "
                f"search, from the epochs already checkpointed, with: {resume}")
    elif last_good:
        then = (f"Tune's saved state was cut short; {free}, then this continues from its last whole copy: "
                f"{resume}")
    else:
        then = (f"the search's saved state was cut short, so it cannot be resumed: {free} and start a new "
                "search under another --name; the runs recorded so far stay in MLflow")
    return f"disk full at {storage} ({why}){kept}: {then}"
