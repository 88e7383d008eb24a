"""Replay a search against a learning-curve table: a discrete-event simulation with a simulated clock.

The searcher and scheduler are the real objects (`tune.study.space.build_searcher` / `build_scheduler`,
or a baseline's), called as Ray 2.60's `TuneController` calls them
(ray/tune/execution/tune_controller.py `_process_trial_result`, `stop_trial`):

- a free slot (at most `concurrency` trials at once) asks `searcher.suggest(trial_id)` and the
  scheduler gets `on_trial_add`;
- each epoch's result goes to `scheduler.on_trial_result`; on CONTINUE the searcher gets
  `on_trial_result` too; on STOP (ASHA's verdict, or its max_t) or after the last epoch, the
  scheduler gets `on_trial_complete` and the searcher `on_trial_complete` with that result, its
  val_acc the best of the trial's epochs (as `tune.study.space.whole_history_result` tells Optuna).

A trial's epoch takes the table's seconds (train + eval) and each trial pays `start_cost_s` once,
before its first epoch. The clock is the wall time of a machine that runs `concurrency` trials
at once (with 1, device time). What the search would pick at each moment is its best observed
trial (highest val_acc at any epoch so far, as `tune.outputs.results.best_trial`), judged by that
configuration's seed-mean final val_acc in the table.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from ray.tune.schedulers import TrialScheduler

from bench.sq_table import Curve, Table


class Searcher(Protocol):
    def suggest(self, trial_id: str) -> dict[str, Any] | None: ...
    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None: ...
    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None,
                          error: bool = False) -> None: ...


@dataclass
class SimTrial:
    """What ASHA reads of a Tune `Trial` (its `trial_id`), plus the replay's bookkeeping."""

    trial_id: str
    batch_size: int
    lr: float                      # the lr the trial trains with (the searcher scales it, if asked)
    curve: Curve
    started_s: float
    epochs_run: int = 0
    best_acc: float = float("-inf")
    ended_s: float | None = None


@dataclass
class Trace:
    """One replay: the trials, and the judged value of the pick each time the pick changed."""

    table_seed: int                                     # the training seed whose curves it read
    trials: list[SimTrial] = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)    # (clock s, judged val_acc)
    end_s: float = 0.0

    def value_at(self, t: float) -> float:
        """The judged val_acc of the pick at clock `t` (NaN before the first result)."""
        value = float("nan")
        for when, v in self.steps:
            if when > t:
                break
            value = v
        return value

    def time_to(self, target: float) -> float:
        """First clock time the pick is judged >= `target` (inf when never)."""
        return next((when for when, v in self.steps if v >= target - 1e-12), float("inf"))


def replay(table: Table, searcher: Searcher, scheduler: TrialScheduler | None, *, num_samples: int,
           concurrency: int, table_seed: int, start_cost_s: float) -> Trace:
    """Run one search against `table` (module docstring); `table_seed`: the training seed whose
    curves every trial reads (a search trains all its trials with one seed, `--seed`)."""
    trace, running = Trace(table_seed), {}
    events: list[tuple[float, int, str]] = []   # (clock at the end of the trial's next epoch, order, id)
    order, clock, pick = 0, 0.0, None

    def start() -> bool:
        nonlocal order
        trial_id = f"{len(trace.trials):05d}"
        config = searcher.suggest(trial_id)
        if config is None:
            return False
        batch = int(config["batch_size"])
        lr = float(config["lr"])
        trial = SimTrial(trial_id, batch, lr, table.curve(batch, lr, table_seed), started_s=clock)
        trace.trials.append(trial)
        running[trial_id] = trial
        if scheduler is not None:
            scheduler.on_trial_add(None, trial)
        heapq.heappush(events, (clock + start_cost_s + trial.curve.epoch_s[0], order, trial_id))
        order += 1
        return True

    while True:
        while len(running) < concurrency and len(trace.trials) < num_samples and start():
            pass
        if not events:
            break
        clock, _, trial_id = heapq.heappop(events)
        trial = running[trial_id]
        trial.epochs_run += 1
        epoch = trial.epochs_run
        acc = trial.curve.val_acc[epoch - 1]
        result = {"epoch": epoch, "training_iteration": epoch, "val_acc": acc, "trial_id": trial_id}
        decision = (scheduler.on_trial_result(None, trial, result) if scheduler is not None
                    else TrialScheduler.CONTINUE)
        if decision != TrialScheduler.STOP:
            searcher.on_trial_result(trial_id, result)
        if decision == TrialScheduler.STOP or epoch == table.epochs:
            if scheduler is not None:
                scheduler.on_trial_complete(None, trial, result)
            # the searcher is told the trial's best epoch, as tune.study.space.whole_history_result does
            searcher.on_trial_complete(trial_id, result={**result, "val_acc": max(trial.best_acc, acc)})
            trial.ended_s = clock
            del running[trial_id]
        else:
            heapq.heappush(events, (clock + trial.curve.epoch_s[epoch], order, trial_id))
            order += 1
        trial.best_acc = max(trial.best_acc, acc)
        best = max(trace.trials, key=lambda t: t.best_acc)   # ties: the earlier trial, as max() keeps
        if best is not pick:
            pick = best
            trace.steps.append((clock, table.final_mean(best.batch_size, best.lr)))
    trace.end_s = clock
    return trace


class GridSearcher:
    """The full grid as a searcher: every configuration once, in an order shuffled by `seed`."""

    def __init__(self, configs: list[tuple[int, float]], seed: int):
        order = np.random.default_rng(seed).permutation(len(configs))
        self.queue = [configs[i] for i in order]

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        if not self.queue:
            return None
        batch, lr = self.queue.pop(0)
        return {"batch_size": batch, "lr": lr}

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        pass

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None,
                          error: bool = False) -> None:
        pass
