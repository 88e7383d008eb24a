"""The strategies a replay compares, each built from `SearchOptions` the way the search builds it.

`default` is whatever `SearchOptions()` holds now (the tool's defaults with `--data` given);
`before` is the defaults issue 17 replaced, `issue17` the ones it chose; the candidates change one
knob or a few. The
baselines: `grid` (every configuration once, shuffled), `random` (Optuna's RandomSampler through
the same `VidtuneOptunaSearch`, twice as many trials as the grid has configurations, so that the
count never ends it within the grid's time) and `random+asha` (the same with the
ASHA `tune.study.space.build_scheduler` builds with grace 1, reduction factor 2, one bracket, whatever
the defaults are: `BASELINE_ASHA`).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import optuna
from ray.tune.search.bohb import TuneBOHB

from bench.sq_replay import GridSearcher, Trace, replay
from bench.sq_table import Table
from vidtune.tune.config.options import SearchOptions
from vidtune.tune.study.space import (
    VidtuneOptunaSearch,
    build_scheduler,
    build_searcher,
    objective_for,
    param_space,
)

OBJECTIVE = objective_for("val_acc")
GROUPS = ("issue17", "issue29")       # the candidate lists `strategies` knows, the newest last


@dataclass(frozen=True)
class Strategy:
    name: str
    kind: str = "tpe"                                        # tpe | random | grid | bohb
    changes: dict[str, Any] = field(default_factory=dict)    # SearchOptions fields; "space.x" for the space
    asha: bool = True                                        # random: with build_scheduler's ASHA


# The defaults before issue 17's benchmark (tune/config/options.py until issue 17).
BEFORE = {"num_samples": 4, "grace_period": 1, "reduction_factor": 2, "tpe": "univariate",
          "random_start_trials": None, "space.lr_scaling": "none", "asha_brackets": 1, "sampler": "tpe"}
# random + ASHA's scheduler, fixed (not the defaults' ASHA, which the baseline would follow).
BASELINE_ASHA = {"grace_period": 1, "reduction_factor": 2, "asha_brackets": 1}
# The defaults issue 17 chose on one table, and issue 29's candidates change.
ISSUE17 = {**BEFORE, "num_samples": 12, "tpe": "multivariate"}


def _pinned(changes: dict[str, Any]) -> dict[str, Any]:
    """`changes` with the random start written out as the rule in force when these candidates were
    defined, min(10, max(2, n/2)), where they leave it to the default: the shipped cap is now
    tune.config.options.RANDOM_START_CAP, and a candidate must mean the same thing in every replay."""
    if "random_start_trials" in changes and changes["random_start_trials"] is None:
        n = changes.get("num_samples", SearchOptions().num_samples)
        changes = {**changes, "random_start_trials": min(10, max(2, n // 2))}
    return changes


def _cand(base: dict[str, Any], name: str, **changes: Any) -> Strategy:
    """A candidate: `base` with `changes` (keyword `space__x` for the space's field x; `share=F`
    for a grace period of F x --epochs: `grace_share` F and no `grace_period`)."""
    changes = {k.replace("__", "."): v for k, v in changes.items()}
    if "share" in changes:
        changes["grace_share"], changes["grace_period"] = changes.pop("share"), None
    return Strategy(name, changes=_pinned({**base, **changes}))


def strategies(group: str = "issue29") -> list[Strategy]:
    """Baselines and the default now, then the candidates of `group`: `issue17` (each from
    `before`, one knob or a few changed; `n` is --num-samples) or `issue29` (each from issue 17's
    defaults: ASHA brackets, a grace period as a share of --epochs, the GP sampler, more trials)."""
    baselines = [Strategy("grid", kind="grid"), Strategy("random", kind="random", asha=False),
                 Strategy("random+asha", kind="random", changes=BASELINE_ASHA), Strategy("default"),
                 Strategy("before", changes=_pinned(BEFORE))]
    if group == "issue17":
        return baselines + _issue17_candidates()
    d17 = ISSUE17

    def c(name: str, **changes: Any) -> Strategy:
        return _cand(d17, name, **changes)

    return baselines + [
        Strategy("issue17", changes=_pinned(d17)),
        c("grace=2", grace_period=2), c("share=.3", share=0.3), c("share=.4", share=0.4),
        c("share=.5", share=0.5),
        c("brackets=2", asha_brackets=2), c("brackets=3", asha_brackets=3),
        c("share=.3 brackets=2", share=0.3, asha_brackets=2),
        c("share=.3 brackets=3", share=0.3, asha_brackets=3),
        c("rf=3 brackets=2", reduction_factor=3, asha_brackets=2),
        c("gp", sampler="gp"), c("gp share=.3", sampler="gp", share=0.3),
        c("n=16", num_samples=16), c("n=20", num_samples=20),
        c("n=16 share=.3", num_samples=16, share=0.3), c("n=16 brackets=2", num_samples=16, asha_brackets=2),
        c("n=16 share=.3 brackets=2", num_samples=16, share=0.3, asha_brackets=2),
        c("n=20 share=.3", num_samples=20, share=0.3), c("n=20 brackets=2", num_samples=20, asha_brackets=2),
        c("n=16 gp", num_samples=16, sampler="gp"),
        c("n=16 share=.4", num_samples=16, share=0.4), c("n=20 share=.4", num_samples=20, share=0.4),
        c("share=.4 brackets=2", share=0.4, asha_brackets=2),
        c("n=16 share=.4 brackets=2", num_samples=16, share=0.4, asha_brackets=2),
        c("no-asha", early_stop=False), c("n=16 start=4", num_samples=16, random_start_trials=4),
        # Added once `tiny-s4crf24px80-e6-lr11`, the first judged table after the above were
        # chosen, was missed by their pick (38 % of the grid's time): fewer random starts reach a
        # wide top sooner; a hedged ASHA or a later grace keeps TPE's early picks from being cut.
        c("n=16 start=6", num_samples=16, random_start_trials=6),
        c("n=16 start=6 share=.4", num_samples=16, random_start_trials=6, share=0.4),
        c("n=16 start=4 share=.4", num_samples=16, random_start_trials=4, share=0.4),
        c("n=16 start=4 brackets=2", num_samples=16, random_start_trials=4, asha_brackets=2),
        c("n=16 start=6 brackets=2", num_samples=16, random_start_trials=6, asha_brackets=2),
        c("n=20 start=6 share=.4", num_samples=20, random_start_trials=6, share=0.4),
        c("n=12 start=4", random_start_trials=4),
        c("n=12 start=4 share=.4", random_start_trials=4, share=0.4),
        # Added once `tiny-s6fps12px64-e7-lr11`, recorded after the above were chosen, was missed by
        # their pick (35 % of the grid's time): its early ranks favour batch 4 where batch 8 ends
        # best, at about twice the lr. A searched lr scaled with the batch size lets TPE carry what
        # one batch size taught it to the other; a second bracket or a later grace hedges the ranks.
        c("n=20 start=6 share=.4 lr-sqrt", num_samples=20, random_start_trials=6, share=0.4,
          space__lr_scaling="sqrt"),
        c("n=20 start=6 share=.4 lr-linear", num_samples=20, random_start_trials=6, share=0.4,
          space__lr_scaling="linear"),
        c("n=16 start=6 share=.4 lr-sqrt", num_samples=16, random_start_trials=6, share=0.4,
          space__lr_scaling="sqrt"),
        c("n=20 start=6 lr-sqrt", num_samples=20, random_start_trials=6, space__lr_scaling="sqrt"),
        c("n=20 start=6 share=.4 rf=3 brackets=2", num_samples=20, random_start_trials=6, share=0.4,
          reduction_factor=3, asha_brackets=2),
        c("n=20 start=6 rf=3 brackets=2", num_samples=20, random_start_trials=6, reduction_factor=3,
          asha_brackets=2),
        c("n=20 start=6 share=.5", num_samples=20, random_start_trials=6, share=0.5),
        c("n=20 start=8 share=.4", num_samples=20, random_start_trials=8, share=0.4),
        c("n=24 start=6 share=.4", num_samples=24, random_start_trials=6, share=0.4),
    ] + ([Strategy("bohb-kde+asha", kind="bohb", changes=_pinned(d17))] if bohb_installed() else [])


def bohb_installed() -> bool:
    """TuneBOHB's own dependencies (hpbandster, ConfigSpace) are not the project's: a reference
    point where they are importable (`pip install --target DIR hpbandster ConfigSpace`, then
    PYTHONPATH=DIR)."""
    return all(importlib.util.find_spec(m) is not None for m in ("hpbandster", "ConfigSpace"))


class BudgetedBOHB:
    """Ray's `TuneBOHB` (BOHB's per-budget kernel density model) under ASHA instead of
    `HyperBandForBOHB`, whose pausing and resuming of trials the replay does not simulate: each
    epoch's result is handed to BOHB as an observation at budget = epoch, which is what
    `HyperBandForBOHB` puts in `hyperband_info`."""

    def __init__(self, seed: int):
        self.inner = TuneBOHB(seed=seed)       # raises unless hpbandster + ConfigSpace import

    def set_search_properties(self, metric: str, mode: str, config: dict[str, Any]) -> bool:
        return self.inner.set_search_properties(metric, mode, config)

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        return self.inner.suggest(trial_id)

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        self.inner.on_trial_result(trial_id, {**result, "hyperband_info": {"budget": result["epoch"]}})

    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None,
                          error: bool = False) -> None:
        if result is not None:     # the stopping epoch is an observation too
            self.inner.on_trial_result(trial_id, {**result, "hyperband_info": {"budget": result["epoch"]}})
        self.inner.on_trial_complete(trial_id, result=result, error=error)


def _issue17_candidates() -> list[Strategy]:
    def cand(name: str, **changes: Any) -> Strategy:
        return _cand(BEFORE, name, **changes)

    return [
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
    elif strategy.kind == "bohb":
        searcher = BudgetedBOHB(seed)
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
    # With --lr-scaling the searcher itself hands out the lr a trial trains with (tune.study.space).
    return replay(table, searcher, scheduler, num_samples=n, concurrency=concurrency, table_seed=table_seed,
                  start_cost_s=start_cost_s)
