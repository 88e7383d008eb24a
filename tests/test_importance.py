"""Parameter importance: fANOVA over finished trials whose objective depends on a known parameter."""
from __future__ import annotations

import math
import random

from matplotlib.image import imread
from mlflow.tracking import MlflowClient

from vidtune.tune.config.options import SearchSpace
from vidtune.tune.outputs.importance import MIN_TRIALS, finished_trials, param_importances
from vidtune.tune.outputs.results import TrialResult
from vidtune.tune.tracking.tracker import MLflowTracker

SPACE = SearchSpace(batch_sizes=(4, 8, 16), lr_min=1e-4, lr_max=3e-3)


def trials(value, n: int = 16, seed: int = 1) -> list[tuple[dict, float]]:
    """`n` (params, value) pairs drawn over SPACE, the value a function of (batch_size, lr)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        params = {"batch_size": rng.choice(SPACE.batch_sizes),
                  "lr": 10 ** rng.uniform(math.log10(SPACE.lr_min), math.log10(SPACE.lr_max))}
        out.append((params, value(params["batch_size"], params["lr"])))
    return out


def row(i: int, batch_size: int, lr: float, val_acc: float, status: str = "DONE",
        weight_decay: float | None = None) -> TrialResult:
    return TrialResult(trial_id=f"t{i}", batch_size=batch_size, lr=lr,
                    params={"weight_decay": weight_decay} if weight_decay is not None else {},
                    val_acc=val_acc, val_f1=val_acc / 2, clips_per_s=10.0, epoch_time_s=1.0, epochs=3,
                    status=status, checkpoint=None)


def test_the_parameter_the_objective_depends_on_explains_most_of_it():
    by_lr = param_importances(trials(lambda bs, lr: 0.9 - 0.2 * abs(math.log10(lr) + 3)), space=SPACE)
    by_bs = param_importances(trials(lambda bs, lr: {4: 0.5, 8: 0.7, 16: 0.6}[bs]), space=SPACE)
    assert list(by_lr.shares) == ["lr", "batch_size"] and by_lr.shares["lr"] > 0.8
    assert list(by_bs.shares) == ["batch_size", "lr"] and by_bs.shares["batch_size"] > 0.8
    for imp in (by_lr, by_bs):
        assert math.isclose(sum(imp.shares.values()), 1.0) and imp.trials == 16 and not imp.reason


def test_the_same_trials_give_the_same_shares():
    pairs = trials(lambda bs, lr: 0.6 + 0.1 * (bs == 8) - 0.1 * abs(math.log10(lr) + 3))
    assert param_importances(pairs).shares == param_importances(list(pairs)).shares


def test_sentence_and_mlflow_metrics():
    imp = param_importances(trials(lambda bs, lr: 0.6 + 0.05 * (bs == 8) - 0.2 * abs(math.log10(lr) + 3)))
    lr, bs = imp.shares["lr"], imp.shares["batch_size"]
    assert imp.sentence() == (f"lr explains {lr:.0%} of the variation in val_acc, batch_size {bs:.0%} "
                              "(fANOVA over 16 finished trials)")
    assert imp.metrics() == {"importance_lr": lr, "importance_batch_size": bs}


def test_below_the_minimum_nothing_is_computed_and_the_reason_says_so(tmp_path):
    imp = param_importances(trials(lambda bs, lr: lr, n=MIN_TRIALS - 1))
    assert imp.shares == {} and imp.metrics() == {} and imp.plot(tmp_path / "i.png") is None
    assert imp.sentence() == (f"parameter importance: not computed ({MIN_TRIALS - 1} finished trial(s); it "
                              f"needs at least {MIN_TRIALS}, below which one trial more or less can reorder "
                              "the parameters)")
    assert not (tmp_path / "i.png").exists()
    assert param_importances(trials(lambda bs, lr: lr, n=MIN_TRIALS)).shares


def test_a_flat_objective_has_nothing_to_explain():
    imp = param_importances(trials(lambda bs, lr: 0.5))
    assert imp.shares == {} and imp.reason == "every finished trial reached the same val_acc"


def test_rows_count_only_finished_trials_with_a_value_and_bring_weight_decay():
    rng = random.Random(0)
    rows = [row(i, rng.choice([4, 8]), 10 ** rng.uniform(-4, -2.5), 0.5 + 0.01 * i,
                weight_decay=1e-3 * (i + 1)) for i in range(MIN_TRIALS)]
    rows += [row(90, 8, 1e-3, 0.0, "OOM", 1e-3), row(91, 4, 1e-3, math.nan, "ERROR", 1e-3),
             row(92, 4, 1e-3, math.nan, "DONE", 1e-3), row(93, 4, 1e-3, 0.9, "UNFINISHED", 1e-3),
             row(94, 4, 1e-3, 0.4, "STOPPED", 1e-3)]
    assert len(finished_trials(rows)) == MIN_TRIALS + 1
    imp = param_importances(rows, objective="val_f1")
    assert imp.trials == MIN_TRIALS + 1 and imp.metric == "val_f1"
    assert set(imp.shares) == {"batch_size", "lr", "weight_decay"}
    # weight decay rises with the value, one for one: it explains the most
    assert next(iter(imp.shares)) == "weight_decay"


def test_the_plot_is_a_png_with_a_bar_per_parameter(tmp_path):
    imp = param_importances(trials(lambda bs, lr: 0.9 - 0.2 * abs(math.log10(lr) + 3)))
    path = imp.plot(tmp_path / "plots" / "importance.png", title="rwf-mvit")
    assert path == tmp_path / "plots" / "importance.png"
    height, width, _ = imread(path).shape
    assert width > height > 100


def test_importance_reaches_the_mlflow_parent_run(tmp_path):
    """The summary's path: the importances as metrics of the parent run, the chart as its artifact."""
    pairs = trials(lambda bs, lr: 0.9 - 0.2 * abs(math.log10(lr) + 3), n=12)
    rows = [row(i, params["batch_size"], params["lr"], acc) for i, (params, acc) in enumerate(pairs)]
    imp = param_importances(rows, space=SPACE)
    assert imp.shares, imp.reason
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    tracker = MLflowTracker(tracking_uri=uri, experiment="importance", experiment_path=str(tmp_path),
                            epochs=3, parent_params={}, parent_tags={}, child_params={})
    chart = imp.plot(tmp_path / "param_importance.png")
    tracker.log_summary(files=[chart], metrics=imp.metrics())
    parent = MlflowClient(uri).get_run(tracker.open_parent())
    metrics = parent.data.metrics
    assert metrics["importance_lr"] == imp.shares["lr"] > metrics["importance_batch_size"]
    assert "param_importance.png" in [a.path for a in MlflowClient(uri).list_artifacts(parent.info.run_id)]
