"""The strategies a replay compares, each built from `SearchOptions` the way the search builds it.

`default` is whatever `SearchOptions()` holds now (the tool's defaults with `--data` given);
`before` is the defaults this benchmark replaced; the candidates change one knob or a few. The
baselines: `grid` (every configuration once, shuffled), `random` (Optuna's RandomSampler through
the same `VidtuneOptunaSearch`, twice as many trials as the grid has configurations, so that the
count never ends it within the grid's time) and `random+asha` (the same with the
ASHA `tune.space.build_scheduler` builds, grace 1, reduction factor 2).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import optuna

from bench.sq_replay import GridSearcher, Trace, replay
from bench.sq_table import Table
from vidtune.tune.options import SearchOptions
from vidtune.tune.space import (
    VidtuneOptunaSearch,
    build_scheduler,
    build_searcher,
    objective_for,
    param_space,
)

OBJECTIVE = objective_for("val_acc")


@dataclass(frozen=True)
class Strategy:
    name: str
    kind: str = "tpe"                                        # tpe | random | grid
    changes: dict[str, Any] = field(default_factory=dict)    # SearchOptions fields; "space.x" for the space
    asha: bool = True                                        # random: with build_scheduler's ASHA


# The defaults before this benchmark (tune/options.py until issue 17).
BEFORE = {"num_samples": 4, "grace_period": 1, "reduction_factor": 2, "tpe": "univariate",
          "random_start_trials": None, "space.lr_scaling": "none"}


def strategies() -> list[Strategy]:
    """Baselines, the default now and before, then the candidates (each from `before`, one knob or a
    few changed; `n` is --num-samples)."""
    def cand(name: str, **changes: Any) -> Strategy:
        return Strategy(name, changes={**BEFORE, **{k.replace("__", "."): v for k, v in changes.items()}})

    return [
        Strategy("grid", kind="grid"), Strategy("random", kind="random", asha=False),
        Strategy("random+asha", kind="random"), Strategy("default"), Strategy("before", changes=BEFORE),
        cand("n=8", num_samples=8), cand("n=12", num_samples=12), cand("n=16", num_samples=16),
        cand("n=12 multivariate", num_samples=12, tpe="multivariate"),
        cand("n=12 start=3", num_samples=12, random_start_trials=3),
        cand("n=12 start=8", num_samples=12, random_start_trials=8),
        cand("n=12 grace=2", num_samples=12, grace_period=2),
        cand("n=12 rf=3", num_samples=12, reduction_factor=3),
        cand("n=12 no-asha", num_samples=12, early_stop=False),
        cand("n=12 lr-linear", num_samples=12, space__lr_scaling="linear"),
        cand("n=12 lr-sqrt", num_samples=12, space__lr_scaling="sqrt"),
        cand("n=12 start=2", num_samples=12, random_start_trials=2),
        cand("n=12 start=4", num_samples=12, random_start_trials=4),
        cand("n=8 start=3", num_samples=8, random_start_trials=3),
        cand("n=16 start=3", num_samples=16, random_start_trials=3),
        cand("n=12 start=3 multivariate", num_samples=12, random_start_trials=3, tpe="multivariate"),
        cand("n=12 start=3 rf=3", num_samples=12, random_start_trials=3, reduction_factor=3),
        cand("n=12 start=3 lr-sqrt", num_samples=12, random_start_trials=3, space__lr_scaling="sqrt"),
        cand("n=10", num_samples=10),
        cand("n=8 multivariate", num_samples=8, tpe="multivariate"),
        cand("n=10 multivariate", num_samples=10, tpe="multivariate"),
        cand("n=16 multivariate", num_samples=16, tpe="multivariate"),
        cand("n=12 multivariate grace=2", num_samples=12, tpe="multivariate", grace_period=2),
        cand("n=12 multivariate rf=3", num_samples=12, tpe="multivariate", reduction_factor=3),
        cand("n=12 multivariate start=4", num_samples=12, tpe="multivariate", random_start_trials=4),
        cand("n=12 multivariate lr-sqrt", num_samples=12, tpe="multivariate", space__lr_scaling="sqrt"),
    ]


def options_for(table: Table, strategy: Strategy, seed: int) -> SearchOptions:
    """The options of one replay: the strategy's changes on the defaults, with the table's batch
    sizes, lr range and epochs, and `seed` as the search's seed."""
    o = SearchOptions()
    o = replace(o, train=o.train.with_overrides(epochs=table.epochs, seed=seed),
                space=replace(o.space, batch_sizes=table.batch_sizes, lr_min=table.lrs[0],
                              lr_max=table.lrs[-1]))
    top = {k: v for k, v in strategy.changes.items() if not k.startswith("space.")}
    space = {k.removeprefix("space."): v for k, v in strategy.changes.items() if k.startswith("space.")}
    return replace(o, **top, space=replace(o.space, **space))


def run_strategy(table: Table, strategy: Strategy, seed: int, *, concurrency: int,
                 start_cost_s: float) -> Trace:
    """One replay of `strategy` with replay seed `seed` (the sampler's seed; the table's training
    seed is `seeds[seed % len(seeds)]`)."""
    np.random.seed(seed)          # ASHA draws a bracket from numpy's global generator
    opts = options_for(table, strategy, seed)
    table_seed = table.seeds[seed % len(table.seeds)]
    n, scheduler = opts.num_samples, build_scheduler(opts)
    if strategy.kind == "grid":
        searcher, n, scheduler = GridSearcher(table.configs, seed), len(table.configs), None
    elif strategy.kind == "random":
        searcher = VidtuneOptunaSearch(sampler=optuna.samplers.RandomSampler(seed=seed))
        n = 2 * len(table.configs)     # never the limit within the grid's time, ASHA or not
        scheduler = scheduler if strategy.asha else None
    else:
        searcher = build_searcher(opts, OBJECTIVE, study_name=f"replay-{seed}")
    if strategy.kind != "grid":
        searcher.set_search_properties(OBJECTIVE.metric, OBJECTIVE.mode, param_space(opts))
    if scheduler is not None:
        scheduler.set_search_properties(OBJECTIVE.metric, OBJECTIVE.mode)
    # With --lr-scaling the searcher itself hands out the lr a trial trains with (tune.space).
    return replay(table, searcher, scheduler, num_samples=n, concurrency=concurrency, table_seed=table_seed,
                  start_cost_s=start_cost_s)
