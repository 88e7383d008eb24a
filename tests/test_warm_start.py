"""--warm-start: an earlier search's trials.csv or Optuna study -> the points and values that seed
Ray's OptunaSearch, inside the new space only, with a clear error for each unusable source."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest
from ray.tune.search.optuna import OptunaSearch

from vidtune.flags import ConfigError
from vidtune.tune.config.options import SearchOptions, SearchSpace
from vidtune.tune.outputs.results import TrialResult
from vidtune.tune.outputs.tables import write_csv
from vidtune.tune.running.ray_internals import optuna_study
from vidtune.tune.study.space import param_space
from vidtune.tune.study.warm_start import load_warm_start

SPACE = SearchSpace(batch_sizes=(4, 8), lr_min=1e-4, lr_max=3e-3)
HEADER = "name,trial_id,status,batch_size,lr,weight_decay,best_val_acc,val_f1,best_epoch\n"


def write(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trials.csv").write_text(text)
    return folder


def row(trial_id: str, batch_size: int, lr: float, val_acc: float, status: str = "DONE") -> TrialResult:
    return TrialResult(trial_id=trial_id, batch_size=batch_size, lr=lr, val_acc=val_acc,
                    val_f1=val_acc - 0.1, clips_per_s=10.0, epoch_time_s=2.0, epochs=3, status=status,
                    checkpoint=None, best_epoch=3)


def test_a_real_two_trial_search_seeds_a_study_that_holds_both(tmp_path):
    """trials.csv as tune/outputs/results.py writes it -> OptunaSearch as tune/study/space.py builds it."""
    write_csv([row("a", 4, 2.5e-4, 0.61), row("b", 8, 1.2e-3, 0.74)], tmp_path / "search" / "trials.csv")
    ws = load_warm_start(str(tmp_path / "search"), SPACE, "val_acc")
    assert ws.line() == f"--warm-start: 2 finished trials of {tmp_path / 'search'} seed the study"

    searcher = OptunaSearch(points_to_evaluate=ws.points_to_evaluate, evaluated_rewards=ws.evaluated_rewards,
                            sampler=optuna.samplers.TPESampler(seed=0))
    searcher.set_search_properties("val_acc", "max", param_space(SearchOptions(space=SPACE)))
    trials = optuna_study(searcher).trials
    assert [(t.params, t.value, t.state.name) for t in trials] == [
        ({"batch_size": 8, "lr": 1.2e-3}, 0.74, "COMPLETE"),
        ({"batch_size": 4, "lr": 2.5e-4}, 0.61, "COMPLETE")]
    assert optuna_study(searcher).best_trial.params == {"batch_size": 8, "lr": 1.2e-3}


def test_trials_outside_the_new_space_or_without_a_result_are_left_out_and_counted(tmp_path):
    folder = write(tmp_path / "s", HEADER + "\n".join([
        "t1,1,DONE,8,0.001,,0.7000,0.6,3",
        "t2,2,STOPPED,4,0.0002,,0.5500,0.5,1",      # ASHA stopped it: it has a value
        "t3,3,DONE,16,0.001,,0.8000,0.7,3",         # batch size no longer searched
        "t4,4,DONE,8,0.01,,0.3000,0.2,3",           # above the new --lr-max
        "t5,5,OOM,8,0.001,,nan,nan,",
        "t6,6,DIVERGED,4,0.003,,nan,nan,",
        "t7,7,DONE,4,0.0001,,nan,nan,",             # finished without a value
        "t8,8,DONE,4,0.003,,0.6000,0.5,2",          # written at --lr-max (3 significant digits)
    ]) + "\n")
    ws = load_warm_start(str(folder), SPACE, "val_acc")
    assert ws.points_to_evaluate == [{"batch_size": 8, "lr": 1e-3}, {"batch_size": 4, "lr": 2e-4},
                                     {"batch_size": 4, "lr": 3e-3}]
    assert ws.evaluated_rewards == [0.7, 0.55, 0.6]
    assert ws.left_out == {"outside the new space (batch size not in --batch-sizes)": 1,
                           "outside the new space (lr outside --lr-min/--lr-max)": 1,
                           "without a result (OOM)": 1, "without a result (DIVERGED)": 1,
                           "without a result (no value)": 1}
    assert ws.line().endswith("seed the study; 5 left out (1 outside the new space (batch size not in "
                              "--batch-sizes), 1 outside the new space (lr outside --lr-min/--lr-max), "
                              "1 without a result (OOM), 1 without a result (DIVERGED), "
                              "1 without a result (no value))")


def test_rounded_bounds_are_clipped_into_the_space(tmp_path):
    folder = write(tmp_path / "s", HEADER + "a,1,DONE,4,0.000333,,0.5,0.4,1\n")
    ws = load_warm_start(str(folder), replace(SPACE, lr_min=1 / 3000), "val_acc")   # 3.3333e-4
    assert ws.points_to_evaluate == [{"batch_size": 4, "lr": 1 / 3000}]


def test_the_old_objective_column_and_val_f1_and_the_csv_file_itself(tmp_path):
    old = write(tmp_path / "old", "name,trial_id,status,batch_size,lr,weight_decay,val_acc,val_f1\n"
                                  "a,1,DONE,4,0.001,,0.6500,0.5000\n")
    assert load_warm_start(str(old), SPACE, "val_acc").evaluated_rewards == [0.65]
    assert load_warm_start(str(old / "trials.csv"), SPACE, "val_f1").evaluated_rewards == [0.5]


def test_weight_decay_when_searched(tmp_path):
    space = replace(SPACE, search_weight_decay=True, weight_decay_min=1e-4, weight_decay_max=1e-2)
    folder = write(tmp_path / "s", HEADER + "\n".join([
        "a,1,DONE,4,0.001,0.001,0.6,0.5,1", "b,2,DONE,4,0.001,0.05,0.7,0.6,1",
        "c,3,DONE,4,0.001,,0.8,0.7,1"]))
    ws = load_warm_start(str(folder), space, "val_acc")
    assert ws.points_to_evaluate == [{"batch_size": 4, "lr": 1e-3, "weight_decay": 1e-3}]
    assert ws.left_out == {
        "outside the new space (weight decay outside --weight-decay-min/--weight-decay-max)": 1,
        "outside the new space (no weight decay (the earlier search did not search it))": 1}
    # Not searched now: the earlier trials' weight decays are not part of the point.
    points = load_warm_start(str(folder), SPACE, "val_acc").points_to_evaluate
    assert points == [{"batch_size": 4, "lr": 1e-3}] * 3


def test_a_fixed_lr_is_matched_but_not_part_of_the_point(tmp_path):
    folder = write(tmp_path / "s", HEADER + "a,1,DONE,4,0.001,,0.6,0.5,1\nb,2,DONE,8,0.002,,0.7,0.6,1\n")
    ws = load_warm_start(str(folder), replace(SPACE, lr_min=1e-3, lr_max=1e-3), "val_acc")
    assert ws.points_to_evaluate == [{"batch_size": 4}] and ws.evaluated_rewards == [0.6]


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: p, "has no trials.csv"),
    (lambda p: write(p / "s", HEADER + "a,1,OOM,4,0.001,,nan,nan,\n"),
     r"no usable trial .*1 without a result"),
    (lambda p: write(p / "s", HEADER), r"no usable trial .*it has no trials"),
    (lambda p: write(p / "s", "x,y\n1,2\n"), "is not a vidtune trials.csv: no column status, batch_size, lr, "
                                             "best_val_acc or val_acc"),
    (lambda p: write(p / "s", HEADER + "a,1,DONE,four,0.001,,0.6,0.5,1\n"), "line 2: invalid literal"),
])
def test_unusable_folders_name_the_flag_and_the_problem(tmp_path, make, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_warm_start(str(make(tmp_path)), SPACE, "val_acc")
    assert e.value.flag == "--warm-start"


def test_an_unreadable_csv(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "trials.csv").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="cannot read"):
        load_warm_start(str(folder), SPACE, "val_acc")


def test_pareto_is_refused():
    with pytest.raises(ConfigError, match="not with --objective pareto"):
        load_warm_start("anything", SPACE, "pareto")


def make_study(url: str, name: str, trials: list[tuple[dict, float | None, float]]) -> None:
    study = optuna.create_study(study_name=name, storage=url, direction="maximize")
    dists = {"batch_size": optuna.distributions.CategoricalDistribution([4, 8, 16]),
             "lr": optuna.distributions.FloatDistribution(1e-5, 1e-1, log=True)}
    for params, value, constraint in trials:
        state = optuna.trial.TrialState.COMPLETE if value is not None else optuna.trial.TrialState.FAIL
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=value,
                                                  state=state, system_attrs={"constraints": [constraint]}))


def test_an_optuna_storage_seeds_its_feasible_complete_trials(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    make_study(url, "earlier", [({"batch_size": 8, "lr": 1e-3}, 0.7, 0.0),
                                ({"batch_size": 8, "lr": 2e-3}, 0.0, 1.0),      # out of memory
                                ({"batch_size": 4, "lr": 5e-4}, None, 0.0),     # failed
                                ({"batch_size": 16, "lr": 1e-3}, 0.9, 0.0)])    # outside the new space
    ws = load_warm_start(url, SPACE, "val_acc")            # the storage's only study
    assert ws.points_to_evaluate == [{"batch_size": 8, "lr": 1e-3}] and ws.evaluated_rewards == [0.7]
    assert ws.left_out == {"without a result (infeasible)": 1, "without a result (FAIL)": 1,
                           "outside the new space (batch size not in --batch-sizes)": 1}
    make_study(url, "other", [])
    with pytest.raises(ConfigError, match=r"holds 2 studies \(earlier, other\); name one after a #"):
        load_warm_start(url, SPACE, "val_acc")
    assert load_warm_start(f"{url}#earlier", SPACE, "val_acc").evaluated_rewards == [0.7]
    with pytest.raises(ConfigError, match="has no study 'nope'"):
        load_warm_start(f"{url}#nope", SPACE, "val_acc")
    with pytest.raises(ConfigError, match="the new search's own study"):
        load_warm_start(f"{url}#earlier", SPACE, "val_acc", own_storage=url, own_study="earlier")


def test_a_url_that_is_no_optuna_storage(tmp_path):
    with pytest.raises(ConfigError, match="cannot open the Optuna storage"):
        load_warm_start("nosuchdriver://x/y", SPACE, "val_acc")
