"""vidtune.tune.outputs.uncertainty and tune.outputs.answer: Wilson intervals on known counts, the summary
sentences."""
from __future__ import annotations

import dataclasses
import math

import pytest
from scipy.stats import binomtest

from vidtune.tune.config import searched
from vidtune.tune.config.options import SearchSpace
from vidtune.tune.outputs import answer
from vidtune.tune.outputs.answer import answer_lines
from vidtune.tune.outputs.results import TrialResult
from vidtune.tune.outputs.uncertainty import accuracy_interval, format_accuracy, half_width, wilson_interval


@pytest.mark.parametrize("correct, n, low, high", [
    (8, 10, 0.4902, 0.9433),     # textbook values (Newcombe 1998, method 3)
    (0, 10, 0.0, 0.2775),
    (10, 10, 0.7225, 1.0),
    (24, 32, 0.5789, 0.8674),
    (81, 263, 0.2553, 0.3662),   # Newcombe's 81/263
])
def test_wilson_interval_matches_known_values(correct, n, low, high):
    lo, hi = wilson_interval(correct, n)
    assert lo == pytest.approx(low, abs=5e-4) and hi == pytest.approx(high, abs=5e-4)


@pytest.mark.parametrize("n", [1, 2, 7, 32, 200, 398])
def test_wilson_interval_is_scipys_for_every_count(n):
    """The hand-written interval against scipy's (installed with scikit-learn and MLflow, not a
    declared dependency of the library): every count of n clips."""
    for correct in range(n + 1):
        theirs = binomtest(correct, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson_interval(correct, n) == pytest.approx((theirs.low, theirs.high), abs=1e-12)


def test_interval_edges_and_bad_counts():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(11, 10)
    assert all(math.isnan(x) for x in accuracy_interval(math.nan, 32))
    assert accuracy_interval(0.75, 32) == wilson_interval(24, 32)
    # more clips, a narrower interval
    assert half_width(0.75, 400) < half_width(0.75, 32) / 3


def test_format_accuracy():
    assert format_accuracy(0.75, 32) == "0.750 [0.58, 0.87]"     # Wilson's: not symmetric about 0.75
    assert format_accuracy(0.75, 0) == "0.750"
    assert format_accuracy(math.nan, 32) == "-"


def row(name, bs, lr, acc, speed, status="DONE"):
    return TrialResult(trial_id=name, batch_size=bs, lr=lr, val_acc=acc, val_f1=acc,
                    clips_per_s=speed, epoch_time_s=10.0, epochs=3, status=status, checkpoint=None,
                    name=name, best_epoch=3)


SEARCHED = searched.domains(SearchSpace(lr_min=1e-4, lr_max=1e-2, batch_sizes=(4, 8, 16)))


def test_best_first_then_a_faster_trial_as_good_within_the_uncertainty():
    rows = [row("t1", 4, 1e-3, 0.750, 10.0), row("t2", 16, 1e-3, 0.719, 30.0), row("t3", 8, 1e-3, 0.40, 50.0),
            row("t4", 8, 1e-3, math.nan, math.nan, status="OOM")]
    lines = answer_lines(rows, objective="val_acc", val_clips=32, domains=SEARCHED)
    assert lines[0].startswith("Best: t1 (batch 4, lr 1.00e-03), val_acc 0.750 [0.58, 0.87] at epoch 3")
    assert "t2 (batch 16" in lines[1] and "200% faster (30.0 clips/s)" in lines[1]
    assert "giving up 0.031" in lines[1]
    assert any("32 clips: one clip is 3.1 points" in line for line in lines)
    assert any("top 2 trials are within" in line for line in lines)
    # t3 is faster but outside the interval: not offered
    assert not any("t3" in line for line in lines)


def test_a_faster_trial_is_offered_only_when_it_is_faster_than_the_noise():
    """A gain under 10%, or under the spread between trials of one batch size, is not offered:
    1.4% faster was "1.0x faster"; the gain is said as a percentage."""
    best, slightly = row("t1", 4, 1e-3, 0.750, 46.8), row("t2", 16, 1e-3, 0.719, 47.46)
    lines = answer_lines([best, slightly], objective="val_acc", val_clips=32)
    assert not any("faster" in line for line in lines)
    assert any("top 2 trials are within" in line for line in lines)      # still as good
    quick = row("t2", 16, 1e-3, 0.719, 57.6)
    lines = answer_lines([best, quick], objective="val_acc", val_clips=32)
    assert "t2 (batch 16" in lines[1] and "23% faster (57.6 clips/s)" in lines[1]
    # two batch-4 trials 30% apart: speeds are that noisy here, 23% is not a gain
    noisy = [best, quick, row("t3", 4, 3e-3, 0.40, 36.0)]
    assert answer.speed_noise(noisy) == pytest.approx(0.3)
    assert not any("faster" in line for line in answer_lines(noisy, objective="val_acc", val_clips=32))
    assert answer.speed_noise([best, quick]) == answer.MIN_SPEED_GAIN


def test_a_large_validation_set_separates_the_same_accuracies():
    rows = [row("t1", 4, 1e-3, 0.750, 10.0), row("t2", 16, 1e-3, 0.719, 30.0)]
    lines = answer_lines(rows, objective="val_acc", val_clips=5000)
    assert not any("faster" in line or "within the best" in line for line in lines)


@pytest.mark.parametrize("lr, bs, flag", [(1.1e-4, 8, "--lr-min"), (9e-3, 8, "--lr-max"),
                                          (1e-3, 4, "--batch-sizes"), (1e-3, 16, "--batch-sizes")])
def test_a_best_value_at_the_edge_of_its_range_says_which_flag_to_widen(lr, bs, flag):
    lines = answer_lines([row("t1", bs, lr, 0.8, 10.0)], objective="val_acc", val_clips=32, domains=SEARCHED)
    assert any(flag in line and "edge" in line or flag in line and "one searched" in line for line in lines)


def test_a_weight_decay_at_the_edge_of_its_searched_range_names_its_flag():
    space = SearchSpace(lr_min=1e-4, lr_max=1e-2, batch_sizes=(4, 8, 16), search_weight_decay=True,
                        weight_decay_min=1e-4, weight_decay_max=1e-1)
    best = dataclasses.replace(row("t1", 8, 1e-3, 0.8, 10.0), params={"weight_decay": 0.09})
    lines = answer_lines([best], objective="val_acc", val_clips=32, domains=searched.domains(space))
    assert [line for line in lines if "edge" in line] == [
        "The best weight decay (9.00e-02) is at the upper edge of the searched range (1.00e-04 to 1.00e-01): "
        "a larger one may be better; raise --weight-decay-max."]
    assert lines[0].startswith("Best: t1 (batch 8, lr 1.00e-03, wd 9.00e-02)")


def test_a_best_value_in_the_middle_gives_no_warning():
    lines = answer_lines([row("t1", 8, 1e-3, 0.8, 10.0)], objective="val_acc", val_clips=32,
                         domains=SEARCHED)
    assert not any("--lr-" in line or "--batch-sizes" in line for line in lines)


def test_no_usable_trial_no_answer():
    assert answer_lines([row("t1", 8, 1e-3, math.nan, math.nan, status="OOM")], objective="val_acc",
                        val_clips=32) == []


def test_an_f1_objective_names_f1_and_keeps_the_accuracy_interval():
    lines = answer_lines([row("t1", 8, 1e-3, 0.8, 10.0)], objective="val_f1", val_clips=32)
    assert lines[0].startswith("Best: t1 (batch 8, lr 1.00e-03), val_f1 0.800, val_acc 0.800 [0.65, 0.91]")


def _at(name: str, best_epoch: int, *, status: str = "DONE", epochs: int = 6) -> TrialResult:
    r = row(name, 8, 1e-3, 0.7 + 0.01 * best_epoch, 10.0, status=status)
    return dataclasses.replace(r, best_epoch=best_epoch, epochs=epochs)


@pytest.mark.parametrize("trials, hint", [
    ([_at("a", 6), _at("b", 6), _at("c", 6)], "3 of 3"),                 # the demo: every one at its last
    ([_at("a", 6), _at("b", 6), _at("c", 3)], "2 of 3"),
    ([_at("a", 6), _at("b", 4), _at("c", 3)], None),                     # one of three: no rule
    ([_at("a", 6), _at("b", 6), _at("c", 3), _at("d", 2)], None),        # half is not most
    ([_at("a", 6)], None),                                               # one trial speaks for no search
    ([_at("a", 2, epochs=2), _at("b", 2, epochs=2)], None),              # 2 epochs: last is best by chance
    # ASHA's stopped trials ran fewer epochs: their last epoch says nothing of a full training
    ([_at("a", 6), _at("b", 2, status="STOPPED", epochs=2), _at("c", 2, status="STOPPED", epochs=2)], None),
])
def test_most_finished_trials_best_at_their_last_epoch_say_raise_epochs(trials, hint):
    lines = answer_lines(trials, objective="val_acc", val_clips=32)
    said = [line for line in lines if "--epochs" in line]
    if hint is None:
        assert said == []
    else:
        assert len(said) == 1 and said[0].startswith(hint) and "all 6 epochs" in said[0]
