"""`--time-budget`: after this much wall time no new trial starts; the running ones finish.

Tune's own `TuneConfig.time_budget_s` is not it: its `TimeoutStopper.stop_all()` makes the
controller stop every trial, running ones too (ray/tune/execution/tune_controller.py
`_stop_experiment_if_needed`), so the trials cut short would have no final result. Instead the
searcher says it has finished: `TimeBudget.suggest` returns `Searcher.FINISHED` once the budget
is spent; Tune's `SearchGenerator` then marks the search finished and creates no more trials,
and the controller ends the experiment when the live trials are done (`TuneController.is_finished`:
every trial finished and the search algorithm finished). Checked against Ray 2.60.

The budget counts from the search's first suggestion (after Ray started and the clip cache is
filled). A resumed search (`--resume`) keeps the budget it was started with and the time it had
already used; the time it spent stopped does not count.
"""
from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any

from ray.tune.search import Searcher

from vidtune.flags import ConfigError

FLAG = "--time-budget"
FORMS = "a number of seconds (3600) or hours, minutes and seconds with units (2h, 90m, 3600s, 1h30m)"
_UNITS = re.compile(r"(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m)?(?:(?P<s>\d+(?:\.\d+)?)s)?")
_PLAIN = re.compile(r"\d+(?:\.\d+)?")


def parse_duration(value: str | int | float, flag: str = FLAG) -> float:
    """"2h", "90m", "3600s", "1h30m", "45" (seconds) -> seconds (float, > 0). ConfigError naming
    `flag`, the value and the accepted forms on anything else (0, negative, "2 hours", "h")."""
    text = str(value).strip().lower()
    seconds = math.nan
    if _PLAIN.fullmatch(text):
        seconds = float(text)
    else:
        units = _UNITS.fullmatch(text)
        if text and units and any(units.groupdict().values()):
            h, m, s = (float(units[k] or 0) for k in "hms")
            seconds = h * 3600 + m * 60 + s
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(flag, f"{value!r} is not a time budget; give {FORMS}, above 0")
    return seconds


def format_duration(seconds: float) -> str:
    """Whole seconds in the two largest units, the second zero-padded, zero units at the end left
    out: 45 -> "45s", 90 -> "1m30s", 180 -> "3m", 3700 -> "1h01m", 7200 -> "2h". The console's and
    the budget's one formatter; `parse_duration` reads it back (to the minute above an hour)."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    parts = [(h, "h"), (m, "m")] if h else [(m, "m"), (s, "s")] if m else [(s, "s")]
    text = f"{parts[0][0]}{parts[0][1]}"
    if len(parts) == 2 and parts[1][0]:
        text += f"{parts[1][0]:02d}{parts[1][1]}"
    return text


class TimeBudget(Searcher):
    """A Searcher that passes everything to the one it wraps (Ray's OptunaSearch here) and
    returns `Searcher.FINISHED` from `suggest` once `budget_s` of wall time has passed since
    its first suggestion. `ended_by_budget` (the budget stopped new trials) and
    `trials_started` (suggestions handed to Tune) are what the summary reads. `clock`:
    seconds, monotonic (tests inject their own)."""

    def __init__(self, searcher: Searcher, budget_s: float, *, clock: Callable[[], float] = time.monotonic):
        super().__init__(metric=searcher.metric, mode=searcher.mode)
        self.searcher = searcher
        self.budget_s = float(budget_s)
        self.ended_by_budget = False
        self.trials_started = 0
        self._clock = clock
        self._started_at: float | None = None   # clock at the first suggestion of this run
        self._used_before_s = 0.0                # used by the runs before a --resume

    # --- the budget ---------------------------------------------------------------------------
    def elapsed_s(self) -> float:
        """Budget used so far: this run's time since its first suggestion plus earlier runs'."""
        ran = 0.0 if self._started_at is None else self._clock() - self._started_at
        return self._used_before_s + ran

    def suggest(self, trial_id: str) -> dict | str | None:
        if self._started_at is None:
            self._started_at = self._clock()
        if self.ended_by_budget or self.elapsed_s() >= self.budget_s:
            if not self.ended_by_budget:
                self.ended_by_budget = True
                print(f"{FLAG} {format_duration(self.budget_s)} reached after {self.trials_started} "
                      "trial(s): no new trial starts; the running ones finish", flush=True)
            return Searcher.FINISHED
        config = self.searcher.suggest(trial_id)
        if config not in (None, Searcher.FINISHED):
            self.trials_started += 1
        return config

    def summary_line(self, num_samples: int) -> str | None:
        """The summary's sentence when the budget ended the search, else None."""
        if not self.ended_by_budget:
            return None
        return (f"the time budget ({FLAG} {format_duration(self.budget_s)}) ended the search: "
                f"{self.trials_started} of {num_samples} trials started, and those finished")

    # --- everything else goes to the wrapped searcher ------------------------------------------
    @property
    def metric(self) -> Any:
        return self.searcher.metric

    @property
    def mode(self) -> Any:
        return self.searcher.mode

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec: Any) -> bool:
        return self.searcher.set_search_properties(metric, mode, config, **spec)

    def set_max_concurrency(self, max_concurrent: int) -> bool:
        return self.searcher.set_max_concurrency(max_concurrent)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        self.searcher.on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        self.searcher.on_trial_complete(trial_id, result=result, error=error)

    def add_evaluated_point(self, parameters: dict, value: float, error: bool = False, pruned: bool = False,
                            intermediate_values: list[float] | None = None) -> None:
        self.searcher.add_evaluated_point(parameters, value, error, pruned, intermediate_values)

    # Tune's SearchGenerator saves a wrapper (any searcher with a `.searcher`) by its get_state()
    # in search_gen_state-*.json and the innermost searcher by its own save(); a resume calls
    # set_state() on the wrapper unpickled from tuner.pkl (ray/tune/search/search_generator.py).
    def get_state(self) -> dict[str, Any]:
        return {"budget_s": self.budget_s, "used_s": self.elapsed_s(),
                "ended_by_budget": self.ended_by_budget, "trials_started": self.trials_started}

    def set_state(self, state: dict[str, Any]) -> None:
        """A resume: the budget used so far; the clock restarts at the next suggestion."""
        self.budget_s = float(state["budget_s"])
        self._used_before_s = float(state["used_s"])
        self.ended_by_budget = bool(state["ended_by_budget"])
        self.trials_started = int(state["trials_started"])
        self._started_at = None

    def save(self, checkpoint_path: str) -> None:
        self.searcher.save(checkpoint_path)

    def restore(self, checkpoint_path: str) -> None:
        self.searcher.restore(checkpoint_path)
