"""The search's console: what a person reads while it runs, and where everything else goes.

The libraries' log records, warnings and Ray's own lines go to a log file (`tune.outputs.search_log`), so
the console keeps only vidtune's lines (`--verbose` skips that). `SearchConsole` is the
Tune callback that prints a line when a trial starts, at most one line per epoch, and a line when
a trial ends: its best epoch's val_acc, that epoch and its steady clips/s, the numbers of its row
in the table (or the last lines of its error, and where its whole traceback is kept). Lines of
their own say when a trial ran out of memory or diverged, when Train restarted a trial's workers
(`restart_line`) and when an epoch decoded damaged clip-cache entries again. `--quiet` keeps only
the summary, whose first count is `outcome_line`.

The epoch's line carries the search's state (trials done / running / to start, the best so far,
the time left from the measured epoch times and the trials still planned: `SearchConsole.time_left`).
In a log file or CI output it is one line per trial epoch; on a terminal it is one progress line,
redrawn in place (carriage return) after a bar of the epochs trained so far, with the other lines above it.
"""
from __future__ import annotations

import math
import shutil
import statistics
import sys
import time
from typing import Any

from ray.tune import Callback
from ray.tune.experiment import Trial

from vidtune.trainer.training.history import best_epoch, latest_history
from vidtune.trainer.training.metrics import steady_state
from vidtune.trainer.training.report_keys import Key, number
from vidtune.tune.config import searched
from vidtune.tune.outputs.results import STATUSES, TrialResult, completed_trial_status
from vidtune.tune.running.budget import format_duration
from vidtune.tune.running.disk_full import stopped_by_full_disk
from vidtune.tune.running.faults import exception_line, keep_traceback, read_error_file
from vidtune.tune.running.trial import short_name


def outcome_line(rows: list[TrialResult], wall_s: float) -> str:
    """The end block's first count: `6 trials in 4m12s: 4 done, 1 stopped early, 1 diverged`
    (statuses in STATUSES order, those present only)."""
    counts = {s: sum(1 for r in rows if r.status == s) for s in STATUSES}
    ended = ", ".join(f"{n} {s.word}" for s, n in counts.items() if n)
    trials = f"{len(rows)} trial{'s' if len(rows) != 1 else ''}"
    return f"{trials} in {format_duration(wall_s)}{': ' + ended if ended else ''}"


# What the console keeps of each epoch's report (`SearchConsole._history`), beside the objective.
HISTORY_KEYS = tuple(k.value for k in (Key.VAL_ACC, Key.CLIPS_PER_S, Key.OOM, Key.DIVERGED))
TRAIN_RUNS = "train_runs"    # the trials' Train runs, in the experiment folder (tune.runner)
URI_SCHEMES = {"gcs": "gs"}  # pyarrow filesystem type name -> URI scheme, where they differ


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


class SearchConsole(Callback):
    """Prints a search's progress (see the module docstring). Holds nothing Tune cannot pickle
    (it is saved with the experiment). `concurrency`: trials run at once (None: the most seen
    running so far), for the time left; `tty`: draw the progress line in place (None: when
    stdout is a terminal). `rungs` (`tune.study.space.asha_rungs`, () without early stopping) and
    `reduction_factor`: ASHA's, for the epochs a trial is expected to train (`expected_epochs`)."""

    def __init__(self, *, num_samples: int, epochs: int, objective: str, quiet: bool = False,
                 concurrency: int | None = None, tty: bool | None = None,
                 rungs: tuple[tuple[int, ...], ...] = (), reduction_factor: int = 2):
        self.num_samples = num_samples
        self.epochs = epochs
        self.rungs = rungs
        self.reduction_factor = reduction_factor
        self.metric = Key.VAL_ACC.value if objective == "pareto" else objective
        self.quiet = quiet
        self.concurrency = concurrency
        self.tty = tty
        self._epochs_done: dict[str, int] = {}
        # per trial: epoch -> what the lines read of that epoch's report (HISTORY_KEYS), every
        # epoch it trained, those before a --resume too (`_seed`): its best epoch is then
        # `trainer.training.history.best_epoch`'s, the rule of the table, so both give one number
        self._history: dict[str, dict[int, dict[str, float]]] = {}
        self._first_s: list[float] = []     # trial start to its first report: start-up and epoch 1
        self._epoch_s: dict[int, list[float]] = {}   # epoch -> measured durations (training + scoring)
        self._most_running = 0
        self._retried: dict[str, str] = {}   # trial -> why its last try ended, while Tune retries it
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        """What belongs to this process only: times on its clock, the progress line on its screen."""
        self._started_at: float | None = None
        self._last_seen: dict[str, float] = {}    # trial -> monotonic time of its start / last report
        self._reported: set[str] = set()          # trials that reported since this process started them
        self._progress = ""                       # the progress line now drawn in place ("" none)
        self._seeded: set[str] = set()            # trials whose saved history this process has read

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_started_at", "_last_seen", "_reported", "_progress", "_seeded"):
            state.pop(key, None)   # a resumed search measures its own pace
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        fresh = SearchConsole(num_samples=state.get("num_samples", 1), epochs=state.get("epochs", 1),
                              objective=state.get("metric", Key.VAL_ACC.value))
        self.__dict__.update({**fresh.__dict__, **state})   # a callback saved before a field existed
        self._reset_process_state()

    # Tune hooks -----------------------------------------------------------------------------
    def on_trial_start(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        now = time.monotonic()
        self._started_at = self._started_at or now
        self._last_seen[trial.trial_id] = now
        self._reported.discard(trial.trial_id)
        self._note_running(trials)
        name = short_name(trial)
        number = name[1:].split("-", 1)[0]          # t03-... -> 03, the trial's number in the search
        cfg = trial.config or {}
        label = f"trial {int(number) if number.isdigit() else '?'}/{self.num_samples} {name}"
        why = self._retried.pop(trial.trial_id, None)
        if why is not None:   # Tune's retry (tune/running/trial_retry.py): its Train run goes on from its
        # checkpoint
            self._print(f"{label} started again from its last checkpoint (its last try ended: {why})")
            return
        values = ", ".join(p.said(cfg[p.name]) for p in searched.PARAMS if p.name in cfg)
        self._print(f"{label} started: {values}")

    def on_trial_recover(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        """A trial that failed and that Tune runs again (a lost node: --max-failures)."""
        text = read_error_file(getattr(trial, "error_file", None))
        self._retried[trial.trial_id] = exception_line(text) if text else "its process or node was lost"

    def on_trial_result(self, iteration: int, trials: list[Trial], trial: Trial, result: dict,
                        **info: Any) -> None:
        self._started_at = self._started_at or time.monotonic()
        epoch = int(result.get(Key.EPOCH) or 0)
        if epoch < 1:
            return
        name = short_name(trial)
        self._seed(trial)
        self._measure(trial.trial_id, epoch, result)
        self._epochs_done[trial.trial_id] = epoch
        self._history.setdefault(trial.trial_id, {})[epoch] = {
            k: number(result.get(k)) for k in {*HISTORY_KEYS, self.metric}}
        self._note_running(trials)
        restart = restart_line(name, result, worker_died=trial.trial_id in self._reported)
        if restart:
            self._print(restart)
        self._reported.add(trial.trial_id)
        repairs = int(result.get(Key.CACHE_REPAIRS, 0) or 0)
        if repairs > 0:
            entries = "entry" if repairs == 1 else "entries"
            self._print(f"{name}: {repairs} damaged clip-cache {entries} decoded again")
        if int(result.get(Key.OOM, 0) or 0):
            self._print(f"{name}  epoch {epoch}/{self.epochs}  OUT OF MEMORY at batch size "
                        f"{result.get(Key.BATCH_SIZE)} (peak {float(result.get(Key.PEAK_MEM_MB, 0)):.0f} MB)")
            self._progress_line(self.overall(trials))
        elif int(result.get(Key.DIVERGED, 0) or 0):
            # the trial's lr: the report's is the schedule's, ~0 at its end
            lr = float((trial.config or {}).get("lr", math.nan))
            self._print(f"{name}  epoch {epoch}/{self.epochs}  DIVERGED: training loss "
                        f"{float(result.get(Key.TRAIN_LOSS, math.nan))} at lr {lr:.3g}")
            self._progress_line(self.overall(trials))
        else:
            value = float(result.get(self.metric, math.nan))
            this = (f"{name}  epoch {epoch}/{self.epochs}  {self.metric} {value:.3f}  "
                    f"{float(result.get(Key.CLIPS_PER_S, 0)):.1f} clips/s  "
                    f"data wait {100 * float(result.get(Key.DATA_WAIT_FRAC, 0)):.0f}%")
            self._progress_line(self.overall(trials, latest=this))

    def on_trial_complete(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        self._seed(trial)
        last = getattr(trial, "last_result", None) or {}
        epoch = int(last.get(Key.EPOCH) or 0)
        status = completed_trial_status(trial, epochs=self.epochs)
        how = {"UNFINISHED": f"interrupted after epoch {epoch}",
               "OOM": "ended: out of memory (recorded as infeasible)",
               "DIVERGED": "ended: diverged (non-finite loss; recorded as infeasible)",
               "STOPPED": f"stopped early by ASHA after epoch {epoch}/{self.epochs}"}.get(status, "done")
        result = f": {self.trial_result(trial.trial_id, last)}" if status in ("DONE", "STOPPED") else ""
        self._print(f"{short_name(trial)} {how}{result}")

    def on_trial_error(self, iteration: int, trials: list[Trial], trial: Trial, **info: Any) -> None:
        if stopped_by_full_disk(trial.trial_id):   # unfinished, not failed: the search's last line says why
            return
        path = getattr(trial, "error_file", None)
        text = read_error_file(path)
        experiment = _experiment_path(trial)
        kept = keep_traceback(experiment, short_name(trial), text) if text and experiment else None
        lines = [ln for ln in text.splitlines() if ln.strip()][-6:]
        body = "".join(f"\n    {ln}" for ln in lines)
        reason = f": {exception_line(text)}" if text else ""
        self._print(f"{short_name(trial)} FAILED{reason} "
                    f"(full traceback: {kept or path or 'see the log'}){body}")

    def on_experiment_end(self, trials: list[Trial], **info: Any) -> None:
        if self._progress and not self.quiet:   # end the line drawn in place: the summary follows
            print(flush=True)
        self._progress = ""

    # what it measured ---------------------------------------------------------------------
    def _measure(self, trial_id: str, epoch: int, result: dict[str, Any]) -> None:
        """Time from the trial's start (first report in this process: start-up and an epoch) or
        from its last report (one epoch, training and scoring)."""
        now = time.monotonic()
        since = self._last_seen.get(trial_id)
        self._last_seen[trial_id] = now
        if since is None:
            return
        if trial_id not in self._reported:
            self._first_s.append(now - since)
        else:
            self._epoch_s.setdefault(epoch, []).append(now - since)
        # the epoch's own span (no start-up), as the worker measured it
        span = float(result.get(Key.EPOCH_END_TS, math.nan)) - float(result.get(Key.EPOCH_START_TS, math.nan))
        if trial_id not in self._reported and math.isfinite(span) and span > 0:
            self._epoch_s.setdefault(epoch, []).append(span)

    def _note_running(self, trials: list[Trial]) -> None:
        self._most_running = max(self._most_running, sum(1 for t in trials if t.status == "RUNNING"))

    def _seed(self, trial: Trial) -> None:
        """Once per trial and process: the epochs its latest checkpoint's record holds
        (`trainer.training.history`, `epochs.json` in its Train run) that this process has not seen
        reported: after a --resume, those trained before it. A report seen here wins."""
        if trial.trial_id in self._seeded:
            return
        self._seeded.add(trial.trial_id)
        experiment = _experiment_path(trial)
        if not experiment:
            return
        saved = latest_history(f"{experiment.rstrip('/')}/{TRAIN_RUNS}/{short_name(trial)}")
        mine = self._history.setdefault(trial.trial_id, {})
        for epoch, record in saved.items():
            mine.setdefault(epoch, {k: number(record.get(k)) for k in {*HISTORY_KEYS, self.metric}})

    def best_of(self, trial_id: str) -> tuple[int, float, float] | None:
        """(epoch, val_acc, objective) of the trial's best epoch (`trainer.training.history.best_epoch`:
        by the objective's metric, ties to the later, among the epochs that trained), None
        before one."""
        best = best_epoch(self._history.get(trial_id, {}), self.metric)
        if best is None:
            return None
        epoch, record = best
        return epoch, record[Key.VAL_ACC], record.get(self.metric, math.nan)

    def trial_result(self, trial_id: str, last: dict[str, Any]) -> str:
        """`best val_acc 0.719 at epoch 3, 41.2 clips/s`: the trial's best epoch by the objective and its
        steady speed over every epoch it trained, as its row in the table (from the last report
        when none was seen)."""
        epoch, acc, value = self.best_of(trial_id) or (
            int(last.get(Key.EPOCH) or 0), float(last.get(Key.VAL_ACC, math.nan)),
            float(last.get(self.metric, math.nan)))
        trained = {e: r[Key.CLIPS_PER_S] for e, r in self._history.get(trial_id, {}).items()
                   if not (r.get(Key.OOM) == 1 or r.get(Key.DIVERGED) == 1)}
        speed = steady_state(trained or {epoch: float(last.get(Key.CLIPS_PER_S, math.nan))})
        other = f" ({self.metric} {value:.3f})" if self.metric != Key.VAL_ACC else ""
        clips = f", {speed:.1f} clips/s" if math.isfinite(speed) else ""
        return f"best val_acc {acc:.3f}{other} at epoch {epoch}{clips}"

    # text -----------------------------------------------------------------------------------
    def overall(self, trials: list[Trial], latest: str = "") -> str:
        """`t01-...  epoch 2/4  val_acc 0.750  ...  |  2/6 trials done, 1 running, 3 to start; best
        t02-bs8-lr1e-3 val_acc 0.812; about 3m10s left` (`latest`: the epoch just reported)."""
        done = len(_ended(trials))
        running = sum(1 for t in trials if t.status == "RUNNING")
        to_start = max(0, self.num_samples - done - running)
        for t in trials:   # after a --resume, the epochs and trials that ended before it count too
            self._seed(t)
        bests = ((self.best_of(n), n) for n in self._history)
        best = max(((b[2], n) for b, n in bests if b is not None and math.isfinite(b[2])), default=None)
        names = {t.trial_id: short_name(t) for t in trials}
        best_text = f"; best {names.get(best[1], best[1])} {self.metric} {best[0]:.3f}" if best else ""
        left = self.time_left(trials)
        eta = f"; about {format_duration(left)} left" if left is not None and left >= 1 else ""
        line = (f"{done}/{self.num_samples} trials done, {running} running, {to_start} to start"
                f"{best_text}{eta}")
        return f"{latest}  |  {line}" if latest else f"  {line}"

    def expected_epochs(self, done: int, reached: dict[tuple[int, int], float]) -> float:
        """Epochs a trial that has trained `done` is expected to train still, ASHA's stops
        counted. At each of its bracket's rungs ASHA stops it when it is below the (1 - 1/R)
        quantile of the trials already recorded there: with none recorded it goes on, else (ranks
        being exchangeable) it stops with probability 1 - 1/R. `reached`: (bracket, rung) ->
        trials expected to be recorded there before this one; updated with this trial's chance of
        getting there (trials still to start are estimated in turn). A trial joins one bracket,
        taken here as equally likely. Without early stopping: every epoch left."""
        if not self.rungs:
            return float(max(0, self.epochs - done))
        stop = 1 - 1 / self.reduction_factor
        total = 0.0
        for b, rungs in enumerate(self.rungs):
            alive, trained, at = 1.0, 0.0, done
            for rung in rungs:
                if rung <= done:
                    continue
                trained += alive * (rung - at)
                at = rung
                before = reached.get((b, rung), 0.0)
                reached[(b, rung)] = before + alive / len(self.rungs)
                alive *= 1 - stop * min(1.0, before)
            total += trained + alive * max(0, self.epochs - at)
        return total / len(self.rungs)

    def time_left(self, trials: list[Trial]) -> float | None:
        """Seconds left, from the measured times and the plan: the epochs the running trials are
        expected to train still (`expected_epochs`: all of them without early stopping, fewer
        with ASHA's rungs ahead) at the steady epoch time, plus each trial still to start (start-up
        and epoch 1 as measured, then its expected epochs), shared among `concurrency` trials at a
        time; never less than the longest running trial's own expected remainder. None before
        anything was measured."""
        later = [s for e, spans in self._epoch_s.items() if e >= 2 for s in spans]
        epoch_s = _median(later or [s for spans in self._epoch_s.values() for s in spans])
        first_s = _median(self._first_s)
        if not math.isfinite(epoch_s) and not math.isfinite(first_s):
            return None
        epoch_s = epoch_s if math.isfinite(epoch_s) else first_s
        first_s = first_s if math.isfinite(first_s) else epoch_s
        ended = _ended(trials)
        # the trials recorded at each rung so far: every one that reported that epoch
        reached = {(b, rung): sum(1.0 for e in self._epochs_done.values() if e >= rung) / len(self.rungs)
                   for b, rungs in enumerate(self.rungs) for rung in rungs}
        now = time.monotonic()
        remainders = []
        running = [t for t in trials if t.status == "RUNNING" and t.trial_id not in ended]
        for t in running:
            done = self._epochs_done.get(t.trial_id)
            if done is not None:
                remainders.append(self.expected_epochs(done, reached) * epoch_s)
            else:   # started, no report yet
                whole = first_s + (self.expected_epochs(0, reached) - 1) * epoch_s
                remainders.append(max(epoch_s, whole - (now - self._last_seen.get(t.trial_id, now))))
        to_start = max(0, self.num_samples - len(ended) - len(running))
        to_start_s = sum(first_s + (self.expected_epochs(0, reached) - 1) * epoch_s for _ in range(to_start))
        at_once = max(1, self.concurrency or self._most_running)
        return max((sum(remainders) + to_start_s) / at_once, max(remainders, default=0.0))

    def _progress_line(self, text: str) -> None:
        """The state after an epoch: one line per epoch in a log file; in place on a terminal."""
        if self.quiet:
            return
        if not self._on_terminal():
            print(text, flush=True)
            return
        if sum(self._epochs_done.values()):   # a bar of epochs trained out of every trial's epochs
            share = min(1.0, sum(self._epochs_done.values()) / max(1, self.num_samples * self.epochs))
            text = f"[{'#' * round(20 * share):<20}] {text.strip()}"
        width = shutil.get_terminal_size((120, 24)).columns
        self._progress = text[:max(20, width - 1)]
        print(f"\r\x1b[K{self._progress}", end="", flush=True)

    def _on_terminal(self) -> bool:
        return sys.stdout.isatty() if self.tty is None else self.tty

    def _print(self, line: str) -> None:
        """A line of its own; on a terminal, above the progress line, which is drawn again."""
        if self.quiet:
            return
        if self._progress:
            print(f"\r\x1b[K{line}\n{self._progress}", end="", flush=True)
        else:
            print(line, flush=True)


def restart_line(name: str, result: dict[str, Any], *, worker_died: bool) -> str | None:
    """The line for a trial's first report after its run restarted (`resumed_from_epoch` > 0, or
    `damaged_checkpoints` > 0: see `trainer.cluster.worker.METRIC_KEYS`), else None. `worker_died`: the
    trial had reported before in this search process, so Train restarted its worker group (not a
    --resume)."""
    resumed = int(result.get(Key.RESUMED_FROM_EPOCH, 0) or 0)
    damaged = int(result.get(Key.DAMAGED_CHECKPOINTS, 0) or 0)
    if resumed <= 0 and damaged <= 0:
        return None
    why = "worker died; " if worker_died else ""
    skipped = f" ({damaged} damaged checkpoint{'s' if damaged > 1 else ''} skipped)" if damaged else ""
    if resumed > 0:
        return f"{why}{name} continues from epoch {resumed}{skipped}"
    return f"{why}{name} starts again from epoch 1: no whole checkpoint{skipped}"


def _experiment_path(trial: Trial) -> str | None:
    """The trial's experiment folder (a URI on remote storage), or None when Tune's trial has no
    storage to say it. Tune's `StorageContext` holds the path on its filesystem (no URI scheme:
    pyarrow took it off) and the filesystem; it has no `storage_path` (reading that attribute
    once made every trial's saved history invisible here, after a --resume too)."""
    storage = getattr(trial, "storage", None)
    try:
        path, kind = str(storage.experiment_fs_path), str(storage.storage_filesystem.type_name)
    except AttributeError:
        return None
    return path if kind == "local" else f"{URI_SCHEMES.get(kind, kind)}://{path}"


def _ended(trials: list) -> set[str]:
    """Ids of the trials Tune has ended (done, stopped, failed)."""
    return {t.trial_id for t in trials if t.status in ("TERMINATED", "ERROR")}
