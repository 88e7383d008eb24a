"""Interruption: Ctrl-C and SIGTERM stop a search the way Tune stops on Ctrl-C (it saves its
state one last time, so `--resume` continues), and the search remembers that it was stopped and
which trials were still unfinished then.

Tune marks the trials it stops at the end TERMINATED, the same status as a trial that ran to its
end, so without this record an interrupted search would report its unfinished trials as done or
stopped early. Tune's own SIGINT handler is turned off (`TUNE_DISABLE_SIGINT_HANDLER`): ours
records the interruption and then asks Tune for its graceful stop through SIGUSR1, the signal
Tune always listens to. A second Ctrl-C (or SIGTERM) raises KeyboardInterrupt: the search stops
at once, closes its MLflow runs and exits 130 all the same.

The record is module state (one search per process): Tune restores its callbacks from the
experiment on `--resume`, so the copy of `InterruptWatch` that Tune calls may not be the one the
search made, and both must see the same record.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import threading
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import FrameType
from typing import Any

from ray.tune import Callback
from ray.tune.experiment import Trial

from vidtune.atomic import write_atomically
from vidtune.errors import SearchInterrupted, VidtuneError, no_space_left
from vidtune.trainer.training.checkpointing import checkpoint_problem
from vidtune.tune.config import layout

DISABLE_TUNE_SIGINT = "TUNE_DISABLE_SIGINT_HANDLER"
LIVE_STATES = ("PENDING", "RUNNING", "PAUSED")


@dataclass
class Interruption:
    """What the search knows about a stop signal. `unfinished`: trials live when it came."""

    signal_name: str | None = None
    unfinished: set[str] = field(default_factory=set)
    known: set[str] = field(default_factory=set)        # every trial Tune had when the signal came
    trials: list = field(default_factory=list)      # Tune's live trial list, refreshed every step
    tuner_started: bool = False      # `install` ran: Tune's state is saved from here on (resumable)
    stepped: bool = False            # Tune's loop has begun a step (`InterruptWatch`): trials to name
    tuner_ended: bool = False        # `Tuner.fit()` returned: no graceful stop to ask Tune for
    late_signal: str | None = None   # a signal while the summary was written, after the Tuner
    # why a trial failed on a full disk (tune/running/disk_full.py), which stopped it
    disk_full: str | None = None

    @property
    def interrupted(self) -> bool:
        return self.signal_name is not None


STATE = Interruption()


# The handlers `install` replaced, put back by `uninstall`: a notebook kernel's own SIGINT
# handling (its interrupt button) must work again after a search run from Python.
_PREVIOUS: dict[int, Any] = {}


def reset() -> None:
    """When a search starts (`tune.runner.execute`): nothing known yet, no Tuner started."""
    global STATE
    STATE = Interruption()


def install() -> None:
    """Before `Tuner.fit()`: route SIGINT and SIGTERM through `_on_signal` (main thread only).
    Until then Python's own KeyboardInterrupt stops the search (`before_trials` says how)."""
    global STATE
    STATE = Interruption(tuner_started=True)
    os.environ[DISABLE_TUNE_SIGINT] = "1"
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            _PREVIOUS[signum] = signal.signal(signum, _on_signal)
        if hasattr(signal, "SIGUSR1"):   # ignored until Tune listens (a former Tuner's handler stays)
            _PREVIOUS[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def uninstall() -> None:
    """Put back the handlers `install` replaced (Python's own when it installed none)."""
    if threading.current_thread() is threading.main_thread():
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        if hasattr(signal, "SIGUSR1"):
            defaults[signal.SIGUSR1] = signal.SIG_DFL
        for signum, default in defaults.items():
            previous = _PREVIOUS.pop(signum, None)
            signal.signal(signum, previous if previous is not None else default)


def tune_ended() -> None:
    """After `Tuner.fit()`, while the summary and MLflow are written (until `uninstall`): a first
    signal is remembered (`STATE.late_signal`) and the writing finishes, so no result file or run
    is left half-written; a second stops at once. After a Ctrl-C in Tune's setup, before it
    listened for its graceful stop, nothing ran: no summary, KeyboardInterrupt (`before_trials`)."""
    STATE.tuner_ended = True
    if not STATE.tuner_started:
        uninstall()
        raise KeyboardInterrupt


def late_exit_code(code: int) -> int:
    """The search's exit code, 130 when a signal came while its summary was written (said here)."""
    if STATE.late_signal is None:
        return code
    print(f"vidtune search: interrupted ({STATE.late_signal}) after its last trial; its summary and "
          "MLflow's record were finished first", file=sys.stderr, flush=True)
    return 130


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if STATE.interrupted or STATE.late_signal:   # a second signal: stop now, without Tune's last snapshot
        raise KeyboardInterrupt
    if STATE.tuner_ended:
        STATE.late_signal = signal.Signals(signum).name
        print(f"\nvidtune search: {STATE.late_signal} received; finishing the summary and MLflow's record "
              "first (press Ctrl-C again to stop at once)", flush=True)
        return
    if not STATE.stepped or hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN:
        # Tune's setup (no step yet: no trial it could name as unfinished), nothing of it saved
        STATE.tuner_started = False
        raise KeyboardInterrupt
    STATE.signal_name = signal.Signals(signum).name
    STATE.unfinished = {t.trial_id for t in STATE.trials if t.status in LIVE_STATES}
    STATE.known = {t.trial_id for t in STATE.trials}
    print(f"\nvidtune search: {STATE.signal_name} received; stopping after saving the search's state "
          "(press Ctrl-C again to stop at once)", flush=True)
    if hasattr(signal, "SIGUSR1"):
        os.kill(os.getpid(), signal.SIGUSR1)   # Tune's graceful stop: saves the experiment, then ends
    else:
        raise KeyboardInterrupt


def before_trials(search_path: str, *, resume: bool) -> SearchInterrupted:
    """Ctrl-C before Tune's first saved state (Ray's start, the clip cache fill, the Tuner's
    setup): the error to raise. A new search's folder, holding only its log and saved options
    (which neither a resume nor the same command could use: "already exists"), is removed, so the
    same command starts it again; a resumed search is as it was and the same --resume continues it."""
    if resume:
        return SearchInterrupted(f"interrupted before the resumed search's first trial; {search_path} is "
                                 "as it was: continue it with --resume (resume=True from Python)")
    if "://" not in search_path:
        _drop_log_handlers(search_path)
        shutil.rmtree(search_path, ignore_errors=True)
    return SearchInterrupted(f"interrupted before the search's first trial; nothing was kept ({search_path} "
                             "removed): run the same command again to start it")


def _drop_log_handlers(folder: str) -> None:
    """Close the root logger's files under `folder` (the search's log), which would be opened
    again by the next record (a warning at exit) once the folder is gone; records go nowhere then,
    not to the console."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(folder):
            root.removeHandler(handler)
            handler.close()
            root.addHandler(logging.NullHandler())


def trial_unfinished(trial_id: str) -> bool:
    """The trial was pending or running when the search was interrupted, or Tune made it after
    (the step under way when the signal came goes on: a first trial can be added then)."""
    return STATE.interrupted and (trial_id in STATE.unfinished or trial_id not in STATE.known)


class InterruptWatch(Callback):
    """Keeps `STATE.trials` pointing at Tune's live trial list, so a signal can name the trials
    that were still unfinished."""

    def on_step_begin(self, iteration: int, trials: list[Trial], **info: Any) -> None:
        STATE.trials, STATE.stepped = trials, True


def one_line(error: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (at most `limit` characters), for a message to a person."""
    return " ".join(str(error).split())[:limit] or type(error).__name__


# -- the disk under --storage -------------------------------------------------------------------

class DiskFullError(VidtuneError, RuntimeError):
    """The search's storage (or the disk of a file it writes) has no space left."""


def disk_full(error: BaseException | None, storage: str) -> str | None:
    """Why `error` (an exception out of Tune, or a trial's error text) is a full disk, or None.
    Looks for errno 28 (ENOSPC) along the exception's chain and in its text (trial errors arrive
    as text from the workers), and at the free space left under a local `storage`."""
    said = no_space_left(error)
    if said:
        return said
    if error is not None and "://" not in storage:
        try:
            if shutil.disk_usage(storage).free < 1 << 20:
                return f"{storage} has less than 1 MB free"
        except OSError:
            pass
    return None


def trial_disk_full(results: Iterable[Any], storage: str) -> BaseException | None:
    """The error of the first trial in `results` (Tune's ResultGrid, or any Results with an
    `error`) that failed on a full disk (`disk_full`), or None. A trial's checkpoint can fill the
    disk before Tune's own state does: the Tuner then returns instead of raising, and the search
    must still stop on the full disk rather than end as an errored trial."""
    for result in results:
        error = getattr(result, "error", None)
        if error is not None and disk_full(error, storage):
            return error
    return None


def kept_checkpoints(experiment_path: str) -> str:
    """What a search that stopped on a full disk kept, read from its trials' Train runs
    (`<experiment>/train_runs/<trial>/epoch_NNNN`, whole by their checksums): "2 trials ran;
    checkpoints kept: t01 epochs 1-2, t02 none". "" on remote storage or with no trial."""
    if "://" in experiment_path:
        return ""
    runs = sorted(p for p in (Path(experiment_path) / "train_runs").glob("*") if p.is_dir())
    if not runs:
        return ""
    kept = []
    for run in runs:
        epochs = sorted(int(c.name.split("_")[1]) for c in run.glob("epoch_[0-9]*")
                        if c.is_dir() and checkpoint_problem(c) is None)
        span = ("none" if not epochs else f"epoch {epochs[0]}" if len(epochs) == 1 else
                f"epochs {epochs[0]}-{epochs[-1]}" if epochs == list(range(epochs[0], epochs[-1] + 1)) else
                f"epochs {', '.join(map(str, epochs))}")
        kept.append(f"{run.name} {span}")
    return f"{len(runs)} trial{'s' if len(runs) != 1 else ''} ran; checkpoints kept: {', '.join(kept)}"


# -- a failed trial's traceback ------------------------------------------------------------------

FAILURES_FOLDER = "failures"
# An exception's line in a traceback: `RuntimeError: ...`, `ray.exceptions.RayTaskError(...)`,
# `torch.OutOfMemoryError: ...`; a name ending like an exception's, at the start of the line.
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*"
                             r"(?:Error|Exception|Interrupt|Exit|Failure)\b.*$")


def exception_line(text: str, limit: int = 500) -> str:
    """The innermost exception of a traceback's text as `Type: message` (its first line, at most
    `limit` characters): the last line that starts with an exception's name; else the last
    non-blank line. Ray nests the worker's traceback inside its own, so the last one is the cause."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    found = [ln for ln in lines if _EXCEPTION_LINE.match(ln)]
    line = (found or lines or ["trial errored"])[-1]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def failure_file(experiment_path: str, name: str) -> Path:
    """Where a failed trial's whole traceback is kept: `<search>/failures/<name>.txt`, at the top
    of the search's folder (`experiment_path` may be Tune's folder inside it: `tune.config.layout`; Ray's
    session folder, where Tune's `error.txt` is, is not kept); on remote storage,
    ./vidtune-logs/<search name>/failures/<name>.txt."""
    search = layout.search_of(experiment_path)
    if "://" in search:
        return Path("vidtune-logs") / PurePosixPath(search).name / FAILURES_FOLDER / f"{name}.txt"
    return Path(search) / FAILURES_FOLDER / f"{name}.txt"


def keep_traceback(experiment_path: str, name: str, text: str) -> Path | None:
    """Write `text` (a trial's whole traceback) to its `failure_file` unless one is there already
    (the first writer, from Tune's error file, has the fullest text). None when it cannot be
    written (a full disk): the caller points at Tune's file instead."""
    path = failure_file(experiment_path, name)
    try:
        if not path.is_file():   # whole or not at all: a full disk leaves no empty or cut file
            write_atomically(path, text if text.endswith("\n") else text + "\n")
    except OSError:
        return None
    return path


def error_text(error: BaseException | str | None) -> str:
    """The whole text of a trial's error: an exception's formatted traceback (a Ray error's
    message holds the worker's traceback), or the text itself."""
    if isinstance(error, BaseException):
        return "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return str(error or "")


def read_error_file(path: str | None) -> str:
    """Tune's error file of a trial (`trial.error_file`); "" when it is gone or unreadable."""
    try:
        return Path(path).read_text(errors="replace") if path and Path(path).is_file() else ""
    except OSError:
        return ""
