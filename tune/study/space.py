"""What the search explores and how: the parameter space, the Optuna TPE searcher, ASHA.

The space is Tune's (`tune.choice` / `tune.loguniform`); Ray's `OptunaSearch` converts it to
Optuna distributions. Single objective: metric/mode go to `TuneConfig` (the searcher and ASHA
read them from there). Pareto: the searcher gets a metric list and mode list (Optuna's
multi-objective TPE) and `TuneConfig` gets none, since Tune itself knows only one metric.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import optuna
from ray import tune
from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY
from ray.tune.result import TRAINING_ITERATION
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import Searcher
from ray.tune.search.optuna import OptunaSearch

from vidtune.trainer.training.history import BEST_EPOCH_METRICS, best_epoch, read_history
from vidtune.trainer.training.report_keys import Key, number
from vidtune.tune.config import searched
from vidtune.tune.config.options import RANDOM_START_CAP, SearchOptions, SearchSpace
from vidtune.tune.outputs.status import Status
from vidtune.tune.running.budget import TimeBudget, parse_duration
from vidtune.tune.running.faults import trial_unfinished
from vidtune.tune.running.ray_internals import optuna_pending_trial, optuna_study
from vidtune.tune.study import dashboard as study
from vidtune.tune.study.warm_start import load_warm_start

# Both maximised. The speed is the steady state (median of epochs 2..; trainer.training.metrics.steady_state),
# which every epoch's report carries, so Optuna ranks the same speed the table shows.
PARETO_METRICS = (Key.VAL_ACC.value, Key.STEADY_CLIPS_PER_S.value)
TIME_ATTR = Key.EPOCH.value                 # the worker reports a 1-based epoch every epoch
# Optuna constraints (> 0 = infeasible), one per way a trial can fail to give a result; every
# trial with a result gets both, feasible ones 0.
OOM_CONSTRAINT = "out_of_memory"
DIVERGED_CONSTRAINT = "diverged"


@dataclass(frozen=True)
class Objective:
    """What Tune / Optuna optimise. `metric` is None for pareto (Tune gets no metric then)."""

    metric: str | None
    mode: str | None
    searcher_metric: str | list[str]
    searcher_mode: str | list[str]

    @property
    def is_pareto(self) -> bool:
        return self.metric is None


def objective_for(name: str) -> Objective:
    """`val_acc` / `val_f1` (maximised), or `pareto` (val_acc and steady clips/s, both maximised)."""
    if name == "pareto":
        return Objective(None, None, list(PARETO_METRICS), ["max"] * len(PARETO_METRICS))
    return Objective(name, "max", name, "max")


def param_space(opts: SearchOptions) -> dict[str, Any]:
    """Tune search space: each parameter the search searches (`tune.config.searched`) as a Tune domain:
    a choice categorical, a range log-uniform or uniform by its scale, a fixed range a constant."""
    assert opts.space.batch_sizes, \
        "batch sizes are resolved (with_defaults_for_hardware) before the space is built"
    return {name: tune_domain(d) for name, d in searched.domains(opts.space).items()}


def tune_domain(d: searched.Domain) -> Any:
    """One parameter's `Domain` as Tune's space holds it."""
    if d.param.is_choice:
        return tune.choice(list(d.choices))
    if d.fixed:
        return d.low
    return tune.loguniform(d.low, d.high) if d.param.scale == "log" else tune.uniform(d.low, d.high)


class VidtuneOptunaSearch(OptunaSearch):
    """OptunaSearch that records out of memory and divergence as infeasible trials: Optuna
    constraint `out_of_memory` or `diverged` > 0 (feasible trials get 0 for both), with the user
    attribute `failure_reason`, so TPE learns to avoid that region (a batch size that does not
    fit, an lr that blows up) instead of ignoring the trial as it would a FAIL and proposing the
    same values again.

    Each epoch is an intermediate value, its own (`_report_last_epoch` adds the one Tune never
    hands `on_trial_result`), so optuna-dashboard's curves are MLflow's; the trial's value is its
    best epoch's (a PRUNED one's: Optuna's, its last epoch's).

    With `--lr-scaling` (`space`), Optuna draws the lr for the reference batch and the trial's
    config gets the lr it trains with (`trial_lr`), so Tune's trial config, the results table,
    the CSV and MLflow show that one; the drawn lr stays the Optuna trial's parameter."""

    def __init__(self, *args: Any, space: SearchSpace | None = None, epochs: int = 0, val_clips: int = 0,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._lr_space = space if space is not None and space.lr_scaling != "none" else None
        self._epochs = epochs          # a trial's full length: fewer epochs trained = stopped early (PRUNED)
        self._val_clips = val_clips    # validation clips: the accuracy's 95% interval in the study
        self._named: set[str] = set()  # Tune trial ids whose Optuna trial carries its vidtune name
        self._reported: dict[str, int] = {}   # Tune trial id -> the last step Ray reported to Optuna

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a searcher pickled by an older vidtune (a --resume) lacks the later attributes
        self.__dict__.update({"_epochs": 0, "_val_clips": 0, "_named": set(), "_reported": {}, **state})

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec: Any) -> bool:
        done = super().set_search_properties(metric, mode, config, **spec)
        ot_study = optuna_study(self)   # Ray keeps it private: see tune/running/ray_internals.py
        if done and ot_study is not None and self.metric:
            # optuna-dashboard and Optuna's plots name the objective(s), not "Objective 0"; Optuna
            # calls it experimental (since 3.2), on every call
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                ot_study.set_metric_names(study.metric_names(self.metric))
        return done

    def suggest(self, trial_id: str) -> dict | None:
        config = super().suggest(trial_id)
        if self._lr_space is not None and isinstance(config, dict) and "lr" in config:
            lr = trial_lr(self._lr_space, int(config["batch_size"]), float(config["lr"]))
            config = {**config, "lr": lr}
        return config

    def _told_already(self, trial_id: str) -> bool:
        """Whether the study already holds this trial's end: a trial that errored was told to
        Optuna as FAIL, in the study's database, and a --resume runs it again. Optuna cannot
        reopen a finished trial, so it stays FAIL there; Tune's results, trials.csv and MLflow
        carry its new result."""
        ot_trial, ot_study = optuna_pending_trial(self, trial_id), optuna_study(self)
        if ot_trial is None or ot_study is None:
            return False
        running = ot_study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        return ot_trial.number not in {t.number for t in running}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if self._told_already(trial_id):
            return
        if trial_id not in self._named:   # the dashboard names a running trial from its first epoch
            ot_trial = optuna_pending_trial(self, trial_id)
            if ot_trial is not None:
                named = {study.NAME_ATTR: study.trial_name(trial_id, result),
                         study.STATUS_ATTR: study.RUNNING}
                for key, value in named.items():
                    ot_trial.set_user_attr(key, value)
                study.save_trial_note(ot_trial, named)   # the dashboard's page of "Trial 0" names it
                self._named.add(trial_id)
        super().on_trial_result(trial_id, result)
        if isinstance(self.metric, str) and TRAINING_ITERATION in result:   # what Ray reported
            self._reported[trial_id] = int(result[TRAINING_ITERATION])

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if self._told_already(trial_id):
            return
        ot_trial = optuna_pending_trial(self, trial_id)   # Ray keeps it private: see
        # tune/running/ray_internals.py
        if ot_trial is not None and result:
            for key, constraint, reason in ((Key.OOM, OOM_CONSTRAINT, Status.OOM.word),
                                            (Key.DIVERGED, DIVERGED_CONSTRAINT, Status.DIVERGED.word)):
                failed = int(result.get(key, 0) or 0) == 1
                ot_trial.set_constraint(constraint, 1.0 if failed else 0.0)
                if failed:
                    ot_trial.set_user_attr("failure_reason", reason)
        if result and not error:
            self._report_last_epoch(trial_id, ot_trial, result)
        best = best_of_history(result, history_metric(self.metric)) if result else None
        if result and isinstance(self.metric, str) and best and best[1].get(self.metric) is not None:
            result = {**result, self.metric: best[1][self.metric]}   # `whole_history_result`
        attrs = study.trial_attrs(trial_id, result, epochs=self._epochs,
                                  val_clips=self._val_clips, error=error,
                                  finished=not trial_unfinished(trial_id), best=best[1] if best else None)
        if ot_trial is not None:
            for key, value in attrs.items():
                ot_trial.set_user_attr(key, value)
            study.save_trial_note(ot_trial, attrs)
        if ot_trial is not None and result and not error and study.pruned(attrs) \
                and isinstance(self.metric, str) and result.get(self.metric) is not None:
            # ASHA stopped it: PRUNED, not COMPLETE (Ray tells PRUNED for a result without the
            # metric). Optuna values a pruned trial by its last intermediate value, the epoch ASHA
            # stopped it at; its best epoch's value, the table's, is its `val_acc` attribute.
            result = {k: v for k, v in result.items() if k != self.metric}
        super().on_trial_complete(trial_id, result=result, error=error)

    def _report_last_epoch(self, trial_id: str, ot_trial: Any, result: dict) -> None:
        """Report a trial's last epoch as its own intermediate value: Tune hands the searcher no
        `on_trial_result` for the result it stops a trial on (ASHA's stop, and ASHA's max_t at a
        trial's last epoch), so without it the dashboard's curve would lack the epoch MLflow
        shows last. Not for an out-of-memory or diverged report (its 0 is no accuracy)."""
        if ot_trial is None or not isinstance(self.metric, str):
            return   # pareto: Optuna keeps no intermediate values for several objectives
        value = number(result.get(self.metric))
        step = int(result.get(TRAINING_ITERATION) or result.get(Key.EPOCH) or 0)
        failed = any(int(result.get(k, 0) or 0) == 1 for k in (Key.OOM, Key.DIVERGED))
        if math.isfinite(value) and not failed and step > self._reported.get(trial_id, 0):
            ot_trial.report(value, step)
            self._reported[trial_id] = step


def whole_history_result(result: dict[str, Any], metric: str) -> dict[str, Any]:
    """A trial's last Tune result with `metric` set to its value at the trial's best epoch over
    every epoch it trained (`best_of_history`), the number the results table, `trials.csv`,
    MLflow and `--warm-start` give that trial, so Optuna learns the same one. Unchanged when the
    history has no value of `metric`."""
    best = best_of_history(result, metric)
    if best is None or best[1].get(metric) is None:
        return result
    return {**result, metric: best[1][metric]}


def best_of_history(result: dict[str, Any], metric: str) -> tuple[int, dict[str, Any]] | None:
    """(epoch, report) of a trial's best epoch by `metric` over every epoch it trained
    (`trainer.training.history.best_epoch`), from its last Tune result.

    The epochs come from `epochs.json` in the checkpoint the result came with (Train's
    `TuneReportCallback` puts its path in the result): after `--resume` Tune's results for a trial
    restart, the checkpoint's record holds the epochs from before the interruption. The last
    epoch alone when the result has no readable checkpoint (an out-of-memory or diverged end;
    remote storage); None when no epoch trained."""
    path = result.get(CHECKPOINT_PATH_KEY)
    history = read_history(path) if path and "://" not in str(path) else {}
    epoch = int(result.get(Key.EPOCH) or 0)
    if epoch >= 1:
        history[epoch] = {**history.get(epoch, {}), **result}
    return best_epoch(history, metric)


def history_metric(metric: str | list[str] | None) -> str:
    """The metric a trial's best epoch is chosen by for the searcher's `metric`: itself (val_acc,
    val_f1), val_acc for pareto (a list) as the results table does."""
    return metric if isinstance(metric, str) and metric in BEST_EPOCH_METRICS else Key.VAL_ACC.value


def reference_batch(space: SearchSpace) -> int | None:
    """The batch size a searched lr is meant for under `--lr-scaling`: `--lr-reference-batch`,
    else the smallest searched batch size (None when there is none)."""
    return space.lr_reference_batch or (min(space.batch_sizes) if space.batch_sizes else None)


def trial_lr(space: SearchSpace, batch_size: int, lr: float) -> float:
    """The lr a trial of `batch_size` trains with, from the searched `lr` (`--lr-scaling`: meant
    for the reference batch, scaled by the batch ratio or its square root; `none`: as drawn)."""
    if space.lr_scaling == "none":
        return lr
    reference = reference_batch(space) or batch_size
    ratio = batch_size / reference
    return lr * (ratio if space.lr_scaling == "linear" else math.sqrt(ratio))


def random_start_trials(opts: SearchOptions) -> int:
    """Random trials before TPE: `--random-start-trials`, else min(RANDOM_START_CAP, max(2, n/2))
    (Optuna's default of 10 would make a short search random; tune.config.options says why 6)."""
    return opts.random_start_trials or min(RANDOM_START_CAP, max(2, opts.num_samples // 2))


def build_sampler(opts: SearchOptions) -> optuna.samplers.BaseSampler:
    """The seeded Optuna sampler `--sampler` names: TPE (`--tpe` multivariate or univariate) or the
    Gaussian-process `GPSampler`, each random for its first `random_start_trials` trials."""
    with warnings.catch_warnings():   # Optuna calls multivariate TPE experimental, on every build
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if opts.sampler == "gp":
            return optuna.samplers.GPSampler(seed=opts.train.seed, n_startup_trials=random_start_trials(opts))
        return optuna.samplers.TPESampler(seed=opts.train.seed, n_startup_trials=random_start_trials(opts),
                                          multivariate=opts.tpe == "multivariate")


def build_searcher(opts: SearchOptions, objective: Objective, *, study_name: str,
                   val_clips: int = 0) -> Searcher:
    """Seeded TPE (or GP, `--sampler`: `build_sampler`) through Ray's OptunaSearch; the study goes
    to `--optuna-storage` (`tune.preflight` fills its default: beside the MLflow store), its trials
    carrying what optuna-dashboard shows (`tune.study.dashboard`; `val_clips`: the validation
    clips, for the accuracy's interval).
    `--warm-start`: an earlier search's finished trials inside this space seed the study.
    `--time-budget`: wrapped in `tune.running.budget.TimeBudget`, which starts no trial after the budget."""
    sampler = build_sampler(opts)
    storage = optuna.storages.RDBStorage(opts.optuna_storage) if opts.optuna_storage else None
    kwargs: dict[str, Any] = dict(sampler=sampler, storage=storage, study_name=opts.study_name or study_name,
                                  space=opts.space, epochs=opts.train.epochs, val_clips=val_clips)
    if opts.warm_start:
        seed = load_warm_start(opts.warm_start, opts.space, opts.objective, own_storage=opts.optuna_storage,
                               own_study=opts.study_name or study_name)
        print(seed.line(), flush=True)
        kwargs.update(points_to_evaluate=seed.points_to_evaluate, evaluated_rewards=seed.evaluated_rewards)
    if objective.is_pareto:
        kwargs.update(metric=objective.searcher_metric, mode=objective.searcher_mode)
    searcher = VidtuneOptunaSearch(**kwargs)
    return TimeBudget(searcher, parse_duration(opts.time_budget)) if opts.time_budget else searcher


def early_stopping_enabled(opts: SearchOptions) -> bool:
    """ASHA runs when asked (default), with >= 3 epochs to compare on, and never in pareto mode
    (ASHA ranks by a single metric)."""
    return opts.early_stop and opts.train.epochs >= 3 and opts.objective != "pareto"


def build_scheduler(opts: SearchOptions) -> ASHAScheduler | None:
    """ASHA on the per-epoch reports with `--asha-brackets` brackets, or None (Tune's FIFO) when
    early stopping is off."""
    if not early_stopping_enabled(opts):
        return None
    return ASHAScheduler(time_attr=TIME_ATTR, max_t=opts.train.epochs, grace_period=grace_period(opts),
                         reduction_factor=opts.reduction_factor, brackets=asha_brackets(opts))


def grace_period(opts: SearchOptions) -> int:
    """Epochs each trial runs before ASHA may stop it: `--grace-period`, else `--grace-share` of
    `--epochs` rounded half up, at least 1; never above `--epochs`."""
    epochs = opts.train.epochs
    grace = opts.grace_period if opts.grace_period is not None else int(opts.grace_share * epochs + 0.5)
    return max(1, min(grace, epochs))


def milestones(*, grace: int, reduction_factor: int, brackets: int,
               epochs: int) -> tuple[tuple[int, ...], ...]:
    """The epochs at which ASHA compares a trial with the others, per bracket (Ray's
    `AsyncHyperBandScheduler`: bracket s's milestones are grace x R^(s+k)), only those below
    `epochs` (at the last epoch there is nothing left to stop)."""
    out = []
    for s in range(brackets):
        rungs, k = [], 0
        while grace * reduction_factor ** (s + k) < epochs:
            rungs.append(grace * reduction_factor ** (s + k))
            k += 1
        out.append(tuple(rungs))
    return tuple(out)


def asha_brackets(opts: SearchOptions) -> int:
    """`--asha-brackets`, at most as many as have a rung below `--epochs` (Ray's bracket k's first
    rung is grace x R^k; one at or past max_t stops nothing and Ray would still draw trials into it)."""
    every = milestones(grace=grace_period(opts), reduction_factor=opts.reduction_factor,
                       brackets=opts.asha_brackets, epochs=opts.train.epochs)
    return max(1, sum(1 for rungs in every if rungs))


def asha_rungs(opts: SearchOptions) -> tuple[tuple[int, ...], ...]:
    """The search's ASHA `milestones` per bracket, as the console's time left counts them (()
    without early stopping)."""
    if not early_stopping_enabled(opts):
        return ()
    return milestones(grace=grace_period(opts), reduction_factor=opts.reduction_factor,
                      brackets=asha_brackets(opts), epochs=opts.train.epochs)
