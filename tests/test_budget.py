"""--time-budget: the duration parser, the TimeBudget searcher on a fake clock, and one real Tune
run on a local Ray in which the budget stops new trials while the running ones finish."""
from __future__ import annotations

import optuna
import pytest
import ray
from ray import tune
from ray.tune.search import Searcher, SearchGenerator
from ray.tune.search.optuna import OptunaSearch

from vidtune.flags import ConfigError
from vidtune.trainer.ray_setup.launch import init_ray
from vidtune.tune.running.budget import TimeBudget, format_duration, parse_duration
from vidtune.tune.running.ray_internals import optuna_study, restored_searcher

SPACE = {"batch_size": tune.choice([4, 8]), "lr": tune.loguniform(1e-4, 1e-2)}


@pytest.mark.parametrize("text, seconds", [("2h", 7200), ("90m", 5400), ("3600s", 3600), ("1h30m", 5400),
                                           ("45", 45), ("1.5h", 5400), ("2H", 7200), (" 10m ", 600),
                                           ("1h0m30s", 3630), (120, 120)])
def test_parse_duration_accepts_the_documented_forms(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0", "0s", "-5", "-1h", "2 hours", "h", "", "1x", "m30", "1h 30m", "nan"])
def test_parse_duration_rejects_with_the_flag_the_value_and_the_forms(text):
    with pytest.raises(ConfigError) as e:
        parse_duration(text)
    assert e.value.flag == "--time-budget"
    assert repr(text) in str(e.value) and "90m" in str(e.value) and "3600s" in str(e.value)


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (0.4, "0s"), (5, "5s"), (45, "45s"), (59.6, "1m"), (60, "1m"), (90, "1m30s"), (180, "3m"),
    (252, "4m12s"), (605, "10m05s"), (3599, "59m59s"), (3600, "1h"), (3700, "1h01m"), (5400, "1h30m"),
    (5430, "1h30m"), (7200, "2h"), (90061, "25h01m"), (-3, "0s")])
def test_format_duration_two_largest_units(seconds, text):
    """The console's (`4 trials in 4m12s`, `about 1h01m left`) and the budget's one formatter."""
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds", [1, 45, 59, 60, 61, 90, 599, 3599, 3600, 3660, 5400, 7200, 86400, 90000])
def test_format_duration_reads_back(seconds):
    """What the budget prints, `--time-budget` takes: exact to the second under an hour, to the
    minute above it."""
    assert parse_duration(format_duration(seconds)) == seconds
    assert parse_duration(format_duration(seconds + 59)) == (seconds + 59 if seconds + 59 < 3600
                                                             else (seconds + 59) // 60 * 60)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def optuna_searcher() -> OptunaSearch:
    searcher = OptunaSearch(sampler=optuna.samplers.TPESampler(seed=0))
    searcher.set_search_properties("val_acc", "max", SPACE)
    return searcher


def test_suggest_finishes_once_the_budget_is_spent_and_stays_finished():
    clock = FakeClock()
    budget = TimeBudget(optuna_searcher(), 60, clock=clock)
    assert budget.metric == "val_acc" and budget.mode == "max"
    assert isinstance(budget.suggest("a"), dict)
    clock.now += 59
    assert isinstance(budget.suggest("b"), dict)
    assert not budget.ended_by_budget and budget.summary_line(4) is None
    clock.now += 1
    assert budget.suggest("c") == Searcher.FINISHED
    clock.now -= 30   # never un-finishes
    assert budget.suggest("d") == Searcher.FINISHED
    assert budget.ended_by_budget and budget.trials_started == 2
    assert budget.summary_line(4) == ("the time budget (--time-budget 1m) ended the search: 2 of 4 trials "
                                      "started, and those finished")


def test_results_reach_the_wrapped_optuna_study():
    inner = optuna_searcher()
    budget = TimeBudget(inner, 3600, clock=FakeClock())
    config = budget.suggest("a")
    budget.on_trial_result("a", {"val_acc": 0.4, "training_iteration": 1})
    budget.on_trial_complete("a", {"val_acc": 0.6, **config})
    (done,) = optuna_study(inner).trials
    assert done.state == optuna.trial.TrialState.COMPLETE and done.value == 0.6
    assert done.params == config


def test_tunes_save_and_resume_keep_the_budget_used_and_the_study(tmp_path):
    """The way Tune saves and resumes a search: SearchGenerator.save_to_dir / restore_from_dir."""
    clock = FakeClock()
    budget = TimeBudget(optuna_searcher(), 100, clock=clock)
    budget.suggest("a")
    budget.on_trial_complete("a", {"val_acc": 0.5})
    clock.now += 70
    SearchGenerator(budget).save_to_dir(str(tmp_path), session_str="s1")

    resumed_clock = FakeClock()
    resumed_clock.now = 5.0   # another process: another monotonic origin
    resumed = TimeBudget(OptunaSearch(sampler=optuna.samplers.TPESampler(seed=0)), 100, clock=resumed_clock)
    SearchGenerator(resumed).restore_from_dir(str(tmp_path))
    assert resumed.trials_started == 1 and not resumed.ended_by_budget
    assert [t.value for t in optuna_study(resumed.searcher).trials] == [0.5]
    assert isinstance(resumed.suggest("b"), dict)    # 70 s used: 30 s left, counted from now
    resumed_clock.now += 29
    assert isinstance(resumed.suggest("c"), dict)
    resumed_clock.now += 1
    assert resumed.suggest("d") == Searcher.FINISHED


@pytest.fixture
def local_ray():
    """This module's own one-CPU Ray, unless the session's (tests/conftest.py) is already up."""
    started = init_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.mark.slow
def test_a_tiny_budget_starts_fewer_trials_than_num_samples_and_lets_them_finish(local_ray, tmp_path):
    # The clock reads 10 s per trial started: trials 1-3 start at 0, 10 and 20 s; at 30 s the
    # budget of 25 s is spent, so the 4th suggestion finishes the search, whatever the machine's speed.
    def three_steps(config):   # defined here: Ray pickles it by value (workers cannot import tests/)
        for step in range(1, 4):
            tune.report({"val_acc": config["lr"] * step, "step": step})

    holder: list[TimeBudget] = []
    budget = TimeBudget(optuna_searcher_unset(), 25, clock=lambda: 10.0 * holder[0].trials_started)
    holder.append(budget)
    tuner = tune.Tuner(
        tune.with_resources(three_steps, {"cpu": 0.5}), param_space=SPACE,
        tune_config=tune.TuneConfig(metric="val_acc", mode="max", num_samples=8, search_alg=budget,
                                    max_concurrent_trials=2),
        run_config=tune.RunConfig(name="budget", storage_path=str(tmp_path), verbose=0))
    results = tuner.fit()
    assert budget.ended_by_budget and budget.trials_started == 3
    assert len(results) == 3 < 8 and results.num_errors == 0
    # Each trial started ran to its last step: the budget stopped none of them.
    assert sorted(r.metrics["step"] for r in results) == [3, 3, 3]
    assert len(optuna_study(budget.searcher).trials) == 3
    assert budget.summary_line(8).startswith("the time budget (--time-budget 25s) ended the search: 3 of 8")

    # --resume: the restored Tuner's searcher is the budget, its state as Tune saved it, so the
    # summary of the resumed search still says the budget ended it (not "lost the others").
    restored = tune.Tuner.restore(str(tmp_path / "budget"), trainable=tune.with_resources(three_steps,
                                                                                           {"cpu": 0.5}))
    assert len(restored.fit()) == 3
    again = restored_searcher(restored)
    assert isinstance(again, TimeBudget) and again is not budget
    assert again.ended_by_budget and again.trials_started == 3


def optuna_searcher_unset() -> OptunaSearch:
    """As `tune.study.space.build_searcher` makes it: Tune gives it the space and metric."""
    return OptunaSearch(sampler=optuna.samplers.TPESampler(seed=0))
