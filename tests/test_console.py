"""The search's console and names: short trial names, the progress lines, the markdown table,
what counts as a full disk, and which lines are Ray's (sent to the log file)."""
from __future__ import annotations

import errno
import io
import math
from types import SimpleNamespace

from tune import console, faults, results
from tune.trial import short_lr, short_name


def _trial(number: int, trial_id: str = "abc123", status: str = "RUNNING", **config):
    return SimpleNamespace(experiment_tag=f"{number}_batch_size=8,lr=0.001", trial_id=trial_id, status=status,
                           config={"batch_size": 8, "lr": 2.5e-4, **config}, last_result={}, error_file=None)


def test_short_names_are_readable_and_stable():
    assert short_lr(2.5e-4) == "2.5e-4" and short_lr(1e-3) == "1e-3" and short_lr(0.00113873) == "1.1e-3"
    assert short_name(_trial(3)) == "t03-bs8-lr2.5e-4"
    assert short_name(_trial(12, weight_decay=0.01)) == "t12-bs8-lr2.5e-4-wd1e-2"
    assert short_name(SimpleNamespace(experiment_tag="", trial_id="x9", config={})) == "t-x9"


def test_progress_lines_name_the_trial_epoch_best_and_time_left(capsys):
    c = console.SearchConsole(num_samples=3, epochs=2, objective="val_acc")
    a, b = _trial(1, "a"), _trial(2, "b", status="PENDING")
    c.on_trial_start(0, [a, b], a)
    c.on_trial_result(0, [a, b], a,
                      {"epoch": 1, "val_acc": 0.75, "clips_per_s": 40.0, "data_wait_frac": 0.05})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "trial 1/3 t01-bs8-lr2.5e-4 started: batch size 8, lr 0.00025"
    assert out[1] == "t01-bs8-lr2.5e-4  epoch 1/2  val_acc 0.750  40.0 clips/s  data wait 5%"
    assert out[2].startswith("  0/3 trials done, 1 running, 2 to start; best t01-bs8-lr2.5e-4 val_acc 0.750")
    assert "left" in out[2]                                 # 5 epochs to go at the pace so far
    a.status, a.last_result = "TERMINATED", {"epoch": 1, "val_acc": 0.75}
    c.on_trial_complete(0, [a, b], a)
    assert "stopped early by ASHA after epoch 1/2" in capsys.readouterr().out
    quiet = console.SearchConsole(num_samples=1, epochs=1, objective="val_acc", quiet=True)
    quiet.on_trial_start(0, [a], a)
    assert capsys.readouterr().out == ""


def test_markdown_table_for_the_parent_description():
    row = results.TrialRow(trial_id="a", batch_size=8, lr=2.5e-4, weight_decay=None, val_acc=0.8125,
                           val_f1=0.8, clips_per_s=41.234, epoch_time_s=2.0, epochs=3, status="DONE",
                           checkpoint=None, name="t01-bs8-lr2.5e-4", best_epoch=2)
    oom = results.TrialRow(trial_id="b", batch_size=64, lr=1e-3, weight_decay=None, val_acc=math.nan,
                           val_f1=math.nan, clips_per_s=math.nan, epoch_time_s=math.nan, epochs=1,
                           status="OOM", checkpoint=None, name="t02-bs64-lr1e-3")
    lines = results.format_markdown([row, oom]).splitlines()
    assert lines[0].startswith("| trial | batch | lr | val_acc |") and lines[1].startswith("|---|")
    assert lines[2] == "| t01-bs8-lr2.5e-4 | 8 | 2.50e-04 | 0.812 | 0.800 | 2 | 41.2 | 3 | DONE |"
    assert lines[3].endswith("| - | - | - | - | 1 | OOM |")


def test_a_full_disk_is_recognised_along_the_exception_chain(tmp_path):
    inner = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError("checkpoint upload failed") from e
    except RuntimeError as outer:
        assert faults.disk_full(outer, str(tmp_path)) == str(inner)
    assert faults.disk_full(RuntimeError("WorkerGroupError: ... [Errno 28] ..."), str(tmp_path))
    assert faults.disk_full(RuntimeError("a bug"), str(tmp_path)) is None      # tmp_path has room


def test_rays_lines_go_to_the_log_and_ours_to_the_console():
    screen, log = io.StringIO(), io.StringIO()
    out = console.RayLinesToLog(screen, log)
    out.write("\x1b[33m(raylet)\x1b[0m WARNING: 8 PYTHON worker processes\ntrial 1/2 started\n")
    out.write("(RayTrainWorker pid=12, ip=10.0.0.1) Error in training function\n(epoch 2) is ours\n")
    out.flush()
    assert screen.getvalue() == "trial 1/2 started\n(epoch 2) is ours\n"
    assert "(raylet)" in log.getvalue() and "RayTrainWorker pid=12" in log.getvalue()
