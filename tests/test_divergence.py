"""A run whose training loss becomes inf or NaN ends as DIVERGED: `vidtune train` says
so and exits 1, and the search's console says so. (The loop's check: tests/test_loop.py; the
worker's report: tests/test_worker.py; the table, Optuna and MLflow: tests/test_report.py,
tests/test_space.py, tests/test_tracking.py.)"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from vidtune.tune.outputs import console


def test_train_cli_says_why_a_run_has_no_result():
    from vidtune.trainer.commands.train_run import failure_message, format_epoch

    diverged = {"epoch": 2, "diverged": 1, "oom": 0, "train_loss": math.nan, "lr": 9.5e5, "batch_size": 8}
    message = failure_message(diverged, lr=1e6)
    assert "diverged in epoch 2" in message and "nan" in message and "lower --lr (e.g. 100000)" in message
    assert format_epoch(diverged, 3) == "epoch 2/3  DIVERGED: training loss nan; stopped, no checkpoint"
    oom = {"epoch": 1, "oom": 1, "diverged": 0, "batch_size": 64, "peak_mem_mb": 1.0}
    assert failure_message(oom, lr=1e-3).startswith("out of memory at batch size 64; lower --batch-size")
    assert failure_message({"epoch": 3, "oom": 0, "diverged": 0, "val_acc": 0.5}, lr=1e-3) is None


def test_search_console_says_a_trial_diverged(capsys):
    c = console.SearchConsole(num_samples=2, epochs=3, objective="val_acc")
    trial = SimpleNamespace(experiment_tag="1_batch_size=8,lr=1e6", trial_id="a", status="RUNNING",
                            config={"batch_size": 8, "lr": 1e6}, last_result={}, error_file=None)
    # lr: the schedule's at the end of the epoch; the line gives the trial's
    last = {"epoch": 1, "diverged": 1, "oom": 0, "train_loss": math.nan, "lr": 0.0, "val_acc": 0.0}
    c.on_trial_result(0, [trial], trial, last)
    trial.status, trial.last_result = "TERMINATED", last
    c.on_trial_complete(0, [trial], trial)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "t01-bs8-lr1e6  epoch 1/3  DIVERGED: training loss nan at lr 1e+06"
    assert "best" not in lines[1]                       # its 0.0 is no result
    assert lines[2] == "t01-bs8-lr1e6 ended: diverged (non-finite loss; recorded as infeasible)"


# ---------------------------------------------------------------- on Ray (slow)

@pytest.mark.slow
def test_train_cli_reports_divergence_and_exits_1(ray_session, synthetic_root, tmp_path, capsys):
    """`vidtune train --lr 1e6` prints the diverged epoch, says to lower --lr and exits
    1; it does not end on "training reported no checkpoint" (Train's result holds only reports
    that came with a checkpoint, so the worker's last report is read from the printer)."""
    from vidtune.trainer.commands import train

    code = train.main(["--data", str(synthetic_root), "--epochs", "2", "--batch-size", "8",
                       "--precision", "fp32", "--model", "tiny", "--lr", "1e6", "--loader-workers", "0",
                       "--storage", str(tmp_path), "--name", "diverges"])
    out = capsys.readouterr()
    assert code == 1
    assert "epoch 1/2  DIVERGED: training loss nan" in out.out
    assert "error: training diverged in epoch 1" in out.err and "lower --lr (e.g. 100000)" in out.err
    assert "no checkpoint" not in out.err


def test_a_search_without_a_usable_trial_says_why_and_what_to_change():
    from types import SimpleNamespace

    from vidtune.tune.config.options import parse_options
    from vidtune.tune.summary import no_usable_trial

    rows = [SimpleNamespace(status=s) for s in ("DIVERGED", "DIVERGED", "OOM")]
    line = no_usable_trial(parse_options(["--smoke-test"]), rows)
    assert line.startswith("no trial produced a usable result (2 DIVERGED, 1 OOM)")
    assert "lower --lr-max" in line and "lower --batch-sizes" in line
