"""The search's console: what a person reads while it runs, and where everything else goes.

`quiet_libraries` sends Ray's, Tune's, Train's and the libraries' log records and warnings to a
log file (the console keeps only vidtune's lines; `--verbose` skips it). `SearchConsole` is the
Tune callback that prints, per trial, one line when it starts and one per epoch, then an overall
line (trials done / running / to start, the best so far, the time left), and a line when it ends
(with the last lines of its error when it failed, and where its whole traceback is kept). Lines
of their own say when Train restarted a trial's workers (`restart_line`) and when an epoch
decoded damaged clip-cache entries again. `--quiet` keeps only the summary.

Every line is plain text (no redraw), so a log file or CI output reads the same as a terminal;
on a terminal the overall line starts with a bar of the epochs trained so far.
"""
from __future__ import annotations

import io
import logging
import math
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

# Each library configures its loggers when imported: `quiet_libraries` redirects them after.
import mlflow  # noqa: F401
import optuna
from ray.tune import Callback
from ray.tune.experiment import Trial

from tune.faults import exception_line, keep_traceback, read_error_file
from tune.results import completed_trial_status
from tune.trial import short_name

# Loggers whose records go to the log file, not the console.
LIBRARY_LOGGERS = ("ray", "mlflow", "optuna", "alembic", "urllib3", "filelock", "py.warnings", "matplotlib")
LOG_FILE = "search.log"


def log_file_for(experiment_path: str, name: str) -> Path:
    """The search's log file: in its experiment folder, or ./vidtune-logs/NAME.log when the
    experiment is on remote storage (s3://)."""
    if "://" in experiment_path:
        return Path("vidtune-logs") / f"{name}.log"
    return Path(experiment_path) / LOG_FILE


def quiet_libraries(log_path: Path) -> Path:
    """Send the libraries' log records (INFO and up) and Python warnings to `log_path`, none to
    the console. Call before `ray.init` (with `configure_logging=False`, `log_to_driver=False`)."""
    optuna.logging.disable_default_handler()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # On the root logger: `ray.init` empties the "ray" logger's handlers, and its records then
    # reach the root (a handler on "ray" itself would be gone, and Python's last-resort handler
    # would print its warnings on the console).
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.setLevel(logging.INFO)
        logger.propagate = True
    # The log may sit on a disk that fills up (--storage): a record that cannot be written is
    # dropped, not reported with a traceback on the console.
    logging.raiseExceptions = False
    logging.captureWarnings(True)
    warnings.simplefilter("default")
    return log_path


# What Ray prints on the driver's own streams, bypassing logging: the raylet's warnings and the
# workers' lines, prefixed `(raylet)` or `(Name pid=123)` (with colour codes on a terminal).
RAY_PREFIX = re.compile(r"^(\x1b\[[0-9;]*m)*\((raylet|[\w.]*\s*pid=\d+[^)]*)\)")


class RayLinesToLog(io.TextIOBase):
    """A stdout/stderr stand-in that sends Ray's prefixed lines (see RAY_PREFIX) to the log file
    and everything else to the console."""

    def __init__(self, console: TextIO, log: TextIO):
        self.console, self.log, self._partial = console, log, ""

    def write(self, text: str) -> int:
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            if RAY_PREFIX.match(line):
                self._to_log(line + "\n")
            else:
                self.console.write(line + "\n")
        return len(text)

    def _to_log(self, text: str) -> None:
        try:
            self.log.write(text)
        except (OSError, ValueError):   # a full disk (or a closed log) must not stop the search
            pass

    def flush(self) -> None:
        if self._partial and not RAY_PREFIX.match(self._partial):
            self.console.write(self._partial)
            self._partial = ""
        self.console.flush()
        try:
            self.log.flush()
        except (OSError, ValueError):
            pass

    def isatty(self) -> bool:
        return self.console.isatty()

    def fileno(self) -> int:
        return self.console.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.console, "encoding", "utf-8")


def keep_ray_lines_off_the_console(log_path: Path) -> TextIO:
    """Replace sys.stdout/sys.stderr by `RayLinesToLog` filters writing Ray's lines to `log_path`.
    Returns that file, for the caller to close once it has put the streams back."""
    log = open(log_path, "a", encoding="utf-8", buffering=1)
    sys.stdout = RayLinesToLog(sys.stdout, log)
    sys.stderr = RayLinesToLog(sys.stderr, log)
    return log


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class SearchConsole(Callback):
    """Prints a search's progress (see the module docstring). Holds nothing Tune cannot pickle
    (it is saved with the experiment)."""

    def __init__(self, *, num_samples: int, epochs: int, objective: str, quiet: bool = False):
        self.num_samples = num_samples
        self.epochs = epochs
        self.metric = "val_acc" if objective == "pareto" else objective
        self.quiet = quiet
        self._started_at: float | None = None
        self._epochs_done: dict[str, int] = {}
        self._best: tuple[float, str] | None = None
        self._reported: set[str] = set()   # trials that reported since this process started them

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_started_at"] = None   # a resumed search measures its own pace
        state["_reported"] = set()
        return state

    # Tune hooks -----------------------------------------------------------------------------
    def on_trial_start(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self._started_at = self._started_at or time.monotonic()
        self.__dict__.setdefault("_reported", set()).discard(trial.trial_id)
        name = short_name(trial)
        number = name[1:].split("-", 1)[0]          # t03-... -> 03, the trial's number in the search
        cfg = trial.config or {}
        extra = f", weight decay {cfg['weight_decay']:.3g}" if "weight_decay" in cfg else ""
        self._print(f"trial {int(number) if number.isdigit() else '?'}/{self.num_samples} {name} started: "
                    f"batch size {cfg.get('batch_size')}, lr {float(cfg.get('lr', math.nan)):.3g}{extra}")

    def on_trial_result(self, iteration: int, trials: list[Trial], trial: Trial, result: dict,
                        **info: Any) -> None:
        self._started_at = self._started_at or time.monotonic()
        epoch = int(result.get("epoch") or 0)
        if epoch < 1:
            return
        self._epochs_done[trial.trial_id] = epoch
        # absent from a callback saved before it existed
        reported = self.__dict__.setdefault("_reported", set())
        restart = restart_line(short_name(trial), result, worker_died=trial.trial_id in reported)
        if restart:
            self._print(restart)
        reported.add(trial.trial_id)
        repairs = int(result.get("cache_repairs", 0) or 0)
        if repairs > 0:
            entries = "entry" if repairs == 1 else "entries"
            self._print(f"{short_name(trial)}: {repairs} damaged clip-cache {entries} decoded again")
        if int(result.get("oom", 0) or 0):
            self._print(f"{short_name(trial)}  epoch {epoch}/{self.epochs}  OUT OF MEMORY at batch size "
                        f"{result.get('batch_size')} (peak {float(result.get('peak_mem_mb', 0)):.0f} MB)")
        elif int(result.get("diverged", 0) or 0):
            # the trial's lr: the report's is the schedule's, ~0 at its end
            lr = float((trial.config or {}).get("lr", math.nan))
            self._print(f"{short_name(trial)}  epoch {epoch}/{self.epochs}  DIVERGED: training loss "
                        f"{float(result.get('train_loss', math.nan))} at lr {lr:.3g}")
        else:
            value = float(result.get(self.metric, math.nan))
            if math.isfinite(value) and (self._best is None or value > self._best[0]):
                self._best = (value, short_name(trial))
            self._print(f"{short_name(trial)}  epoch {epoch}/{self.epochs}  {self.metric} {value:.3f}  "
                        f"{float(result.get('clips_per_s', 0)):.1f} clips/s  "
                        f"data wait {100 * float(result.get('data_wait_frac', 0)):.0f}%")
        self._print(self.overall(trials))

    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        last = trial.last_result or {}
        epoch = int(last.get("epoch") or 0)
        status = completed_trial_status(trial, epochs=self.epochs)
        how = {"UNFINISHED": f"interrupted after epoch {epoch}",
               "OOM": "ended: out of memory (recorded as infeasible)",
               "DIVERGED": "ended: diverged (non-finite loss; recorded as infeasible)",
               "STOPPED": f"stopped early by ASHA after epoch {epoch}/{self.epochs}"}.get(
            status, f"done ({self.metric} {float(last.get(self.metric, math.nan)):.3f})")
        self._print(f"{short_name(trial)} {how}")

    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        path = getattr(trial, "error_file", None)
        text = read_error_file(path)
        experiment = _experiment_path(trial)
        kept = keep_traceback(experiment, short_name(trial), text) if text and experiment else None
        lines = [ln for ln in text.splitlines() if ln.strip()][-6:]
        body = "".join(f"\n    {ln}" for ln in lines)
        reason = f": {exception_line(text)}" if text else ""
        self._print(f"{short_name(trial)} FAILED{reason} "
                    f"(full traceback: {kept or path or 'see the log'}){body}")

    # text -----------------------------------------------------------------------------------
    def overall(self, trials: list[Trial]) -> str:
        """`2/6 trials done, 1 running, 3 to start; best t02-bs8-lr1e-3 val_acc 0.812; about 3m10s left`."""
        done = len(_ended(trials))
        running = sum(1 for t in trials if t.status == "RUNNING")
        to_start = max(0, self.num_samples - done - running)
        best = f"; best {self._best[1]} {self.metric} {self._best[0]:.3f}" if self._best else ""
        line = (f"{done}/{self.num_samples} trials done, {running} running, {to_start} to start"
                f"{best}{self._eta(trials)}")
        if sys.stdout.isatty():   # a bar of epochs trained out of at most every trial's epochs
            share = min(1.0, sum(self._epochs_done.values()) / max(1, self.num_samples * self.epochs))
            return f"  [{'#' * round(20 * share):<20}] {line}"
        return f"  {line}"

    def _eta(self, trials: list) -> str:
        """Time left at the pace so far: epochs still to train (at most every trial's last epoch;
        ASHA may stop some sooner) over epochs trained per second."""
        if self._started_at is None:
            return ""
        elapsed = time.monotonic() - self._started_at
        trained = sum(self._epochs_done.values())
        if trained < 1 or elapsed <= 0:
            return ""
        ended = _ended(trials)
        left = sum(self.epochs - e for tid, e in self._epochs_done.items() if tid not in ended)
        left += self.epochs * max(0, self.num_samples - len(self._epochs_done))
        return f"; about {_duration(left * elapsed / trained)} left" if left else ""

    def _print(self, line: str) -> None:
        if not self.quiet:
            print(line, flush=True)


def restart_line(name: str, result: dict[str, Any], *, worker_died: bool) -> str | None:
    """The line for a trial's first report after its run restarted (`resumed_from_epoch` > 0, or
    `damaged_checkpoints` > 0: see `trainer.worker.METRIC_KEYS`), else None. `worker_died`: the
    trial had reported before in this search process, so Train restarted its worker group (not a
    --resume)."""
    resumed = int(result.get("resumed_from_epoch", 0) or 0)
    damaged = int(result.get("damaged_checkpoints", 0) or 0)
    if resumed <= 0 and damaged <= 0:
        return None
    why = "worker died; " if worker_died else ""
    skipped = f" ({damaged} damaged checkpoint{'s' if damaged > 1 else ''} skipped)" if damaged else ""
    if resumed > 0:
        return f"{why}{name} continues from epoch {resumed}{skipped}"
    return f"{why}{name} starts again from epoch 1: no whole checkpoint{skipped}"


def _experiment_path(trial: Trial) -> str | None:
    """The trial's experiment folder (a URI on remote storage), or None when Tune's trial has no
    storage to say it."""
    storage = getattr(trial, "storage", None)
    try:
        if "://" in str(storage.storage_path):
            return f"{str(storage.storage_path).rstrip('/')}/{storage.experiment_dir_name}"
        return storage.experiment_fs_path
    except AttributeError:
        return None


def _ended(trials: list) -> set[str]:
    """Ids of the trials Tune has ended (done, stopped, failed)."""
    return {t.trial_id for t in trials if t.status in ("TERMINATED", "ERROR")}
