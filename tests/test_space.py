"""The search space, the seeded Optuna searcher (OOM and divergence = infeasible, pareto, stored
study), ASHA."""
from __future__ import annotations

import optuna
import pytest
from ray.tune.search.sample import Categorical, Float, LogUniform

from vidtune.flags import build
from vidtune.tune.config.options import SPECS, SearchOptions
from vidtune.tune.runner import searcher_params
from vidtune.tune.running.ray_internals import optuna_study
from vidtune.tune.study import space

PATHS = {s.path.rsplit(".", 1)[-1]: s.path for s in SPECS}   # "epochs" -> "train.epochs"


def _opts(**kw) -> SearchOptions:
    return build(SearchOptions, {PATHS[k]: v for k, v in {"batch_sizes": (4, 8, 16), **kw}.items()})


def test_param_space_batch_sizes_are_categorical_and_lr_log_uniform():
    s = space.param_space(_opts(lr_min=1e-5, lr_max=1e-3))
    assert set(s) == {"batch_size", "lr"}
    assert isinstance(s["batch_size"], Categorical) and s["batch_size"].categories == [4, 8, 16]
    assert isinstance(s["lr"], Float) and isinstance(s["lr"].get_sampler(), LogUniform)
    assert (s["lr"].lower, s["lr"].upper) == (1e-5, 1e-3)


def test_weight_decay_is_searched_only_when_asked():
    s = space.param_space(_opts(search_weight_decay=True, weight_decay_min=1e-4, weight_decay_max=0.1))
    assert (s["weight_decay"].lower, s["weight_decay"].upper) == (1e-4, 0.1)
    assert "weight_decay" not in space.param_space(_opts())


def _suggestions(seed: int, n: int = 4) -> list[dict]:
    opts = _opts(seed=seed, num_samples=8)
    searcher = space.build_searcher(opts, space.objective_for("val_acc"), study_name="t")
    searcher.set_search_properties("val_acc", "max", space.param_space(opts))
    out = []
    for i in range(n):
        cfg = searcher.suggest(f"t{i}")
        out.append(cfg)
        searcher.on_trial_complete(f"t{i}", {"val_acc": cfg["lr"] * 100, "oom": 0, "training_iteration": 1})
    return out


def test_searcher_is_seeded():
    a, b, c = _suggestions(0), _suggestions(0), _suggestions(1)
    assert a == b
    assert a != c
    assert all(cfg["batch_size"] in (4, 8, 16) and 1e-4 <= cfg["lr"] <= 3e-3 for cfg in a)


def test_out_of_memory_trial_is_infeasible_for_optuna():
    opts = _opts()
    searcher = space.build_searcher(opts, space.objective_for("val_acc"), study_name="t")
    searcher.set_search_properties("val_acc", "max", space.param_space(opts))
    searcher.suggest("ok")
    searcher.suggest("oom")
    searcher.on_trial_complete("ok", {"val_acc": 0.8, "oom": 0})
    searcher.on_trial_complete("oom", {"val_acc": 0.0, "oom": 1})
    ok, oom = optuna_study(searcher).trials
    assert oom.user_attrs == {"failure_reason": "out of memory", "status": "out of memory",
                              "vidtune_trial": "t-oom"}
    # Optuna constraints: > 0 infeasible, <= 0 feasible (read by TPE).
    assert oom.constraints == {space.OOM_CONSTRAINT: 1.0, space.DIVERGED_CONSTRAINT: 0.0}
    assert ok.constraints == {space.OOM_CONSTRAINT: 0.0, space.DIVERGED_CONSTRAINT: 0.0}


def test_diverged_trial_is_infeasible_for_optuna():
    """A trial whose loss went NaN reports val_acc 0.0 and diverged=1: Optuna records it
    COMPLETE but infeasible (not a FAIL that TPE would ignore), with its reason."""
    from optuna.trial import TrialState

    opts = _opts()
    searcher = space.build_searcher(opts, space.objective_for("val_acc"), study_name="t")
    searcher.set_search_properties("val_acc", "max", space.param_space(opts))
    searcher.suggest("ok")
    searcher.suggest("nan")
    searcher.on_trial_complete("ok", {"val_acc": 0.6, "oom": 0, "diverged": 0})
    searcher.on_trial_complete("nan", {"val_acc": 0.0, "oom": 0, "diverged": 1})
    ok, nan = optuna_study(searcher).trials
    assert nan.state == TrialState.COMPLETE and nan.user_attrs["failure_reason"] == "diverged"
    assert nan.user_attrs["status"] == "diverged"
    assert nan.constraints == {space.OOM_CONSTRAINT: 0.0, space.DIVERGED_CONSTRAINT: 1.0}
    # Optuna's rule: feasible when every constraint is <= 0
    feasible = [t.number for t in optuna_study(searcher).trials
                if all(v <= 0 for v in t.constraints.values())]
    assert feasible == [0]


def test_optuna_is_told_the_best_epoch_of_every_epoch_trained_even_after_a_resume(tmp_path):
    """After --resume Tune's results for a trial restart; the last result's checkpoint holds the
    whole record (epochs.json). Optuna gets the best epoch's value (by val_acc, as the table and
    trials.csv), here epoch 1's, from before the interruption; without a readable checkpoint it
    gets the last result's."""
    from ray.tune.integration.ray_train import CHECKPOINT_PATH_KEY

    from vidtune.trainer.training.history import write_history

    checkpoint = tmp_path / "epoch_0004"
    checkpoint.mkdir()
    write_history(checkpoint, {1: {"epoch": 1, "val_acc": 0.5, "val_f1": 0.61},
                               2: {"epoch": 2, "val_acc": 0.4375, "val_f1": 0.4},
                               3: {"epoch": 3, "val_acc": 0.9, "val_f1": 0.9, "diverged": 1},
                               4: {"epoch": 4, "val_acc": 0.375, "val_f1": 0.3}})
    last = {"epoch": 4, "val_acc": 0.375, "val_f1": 0.3, "oom": 0, CHECKPOINT_PATH_KEY: str(checkpoint)}
    assert space.whole_history_result(last, "val_acc")["val_acc"] == 0.5
    assert space.whole_history_result(last, "val_f1")["val_f1"] == 0.61      # at the best epoch by val_acc
    remote = {**last, CHECKPOINT_PATH_KEY: "s3://b/k"}
    assert space.whole_history_result(remote, "val_acc")["val_acc"] == 0.375

    opts = _opts(epochs=4)
    searcher = space.build_searcher(opts, space.objective_for("val_acc"), study_name="t")
    searcher.set_search_properties("val_acc", "max", space.param_space(opts))
    searcher.suggest("resumed")
    searcher.suggest("plain")
    searcher.on_trial_complete("resumed", last)
    searcher.on_trial_complete("plain", {"epoch": 4, "val_acc": 0.6, "oom": 0})
    assert [t.value for t in optuna_study(searcher).trials] == [0.5, 0.6]


def test_pareto_searches_accuracy_and_throughput_together():
    obj = space.objective_for("pareto")
    assert obj.is_pareto and obj.metric is None and obj.mode is None
    opts = _opts(objective="pareto")
    searcher = space.build_searcher(opts, obj, study_name="p")
    searcher.set_search_properties(None, None, space.param_space(opts))
    searcher.suggest("a")
    searcher.on_trial_complete("a", {"val_acc": 0.7, "steady_clips_per_s": 30.0, "oom": 0})
    study = optuna_study(searcher)
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MAXIMIZE"]
    assert study.trials[0].values == [0.7, 30.0]


def test_study_is_stored_for_optuna_dashboard(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    opts = _opts(optuna_storage=url)
    searcher = space.build_searcher(opts, space.objective_for("val_f1"), study_name="my-search")
    searcher.set_search_properties("val_f1", "max", space.param_space(opts))
    searcher.suggest("a")
    searcher.on_trial_complete("a", {"val_f1": 0.6, "oom": 0})
    study = optuna.load_study(study_name="my-search", storage=url)
    assert [t.value for t in study.trials] == [0.6]
    assert study.trials[0].params["batch_size"] in (4, 8, 16)


@pytest.mark.parametrize("kw, on", [
    (dict(epochs=3), True),
    (dict(epochs=2), False),                       # too few epochs to compare
    (dict(epochs=5, early_stop=False), False),     # --no-early-stop
    (dict(epochs=5, objective="pareto"), False),   # ASHA ranks one metric only
])
def test_asha_only_when_it_can_work(kw, on):
    opts = _opts(**kw)
    assert space.early_stopping_enabled(opts) is on
    sched = space.build_scheduler(opts)
    assert (sched is not None) is on
    if on:
        assert sched._max_t == opts.train.epochs and sched._time_attr == "epoch"
        # grace period 1, reduction factor 2: a trial may be stopped after epoch 1 and 2 of 3
        assert sorted(milestone for milestone, _ in sched._brackets[0]._rungs) == [1, 2]


def test_the_parent_run_records_how_the_search_searched():
    """vidtune.tune.runner.searcher_params: the settings that make two searches differ, as MLflow params."""
    default = searcher_params(_opts(num_samples=12))
    assert default == {"sampler": "tpe", "tpe": "multivariate", "random_start_trials": 6,
                       "early_stopping": "asha", "grace_period": 1, "reduction_factor": 2, "asha_brackets": 1,
                       "lr_scaling": "none", "time_budget": None, "warm_start": None}
    other = searcher_params(_opts(num_samples=8, tpe="univariate", lr_scaling="sqrt", early_stop=False,
                                  time_budget="2h"))
    assert other["tpe"] == "univariate" and other["random_start_trials"] == 4
    assert other["early_stopping"] == "off" and "grace_period" not in other
    assert other["lr_scaling"] == "sqrt" and other["lr_reference_batch"] == 4   # the smallest batch
    assert other["time_budget"] == "2h"
    gp = searcher_params(_opts(num_samples=12, epochs=8, sampler="gp", grace_share=0.3, asha_brackets=2))
    assert gp["sampler"] == "gp" and gp["grace_period"] == 2 and gp["asha_brackets"] == 2


def test_the_gp_sampler_is_optunas_gaussian_process():
    sampler = space.build_sampler(_opts(num_samples=12, sampler="gp"))
    assert isinstance(sampler, optuna.samplers.GPSampler)
    assert isinstance(space.build_sampler(_opts(num_samples=12)), optuna.samplers.TPESampler)
