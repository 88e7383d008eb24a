"""The search's console and names: short trial names, one line per epoch (in place on a
terminal), the trial-end line, the time left, the end block's count by outcome, the markdown
table, what counts as a full disk, and which lines are Ray's (sent to the log file)."""
from __future__ import annotations

import errno
import io
import math
import statistics
from types import SimpleNamespace

import pytest
from ray.train._internal.storage import StorageContext  # what Tune gives each trial (not public)

from vidtune.numbers import short_number
from vidtune.trainer.training.history import write_history
from vidtune.tune.outputs import console, results, search_log, tables
from vidtune.tune.running import faults
from vidtune.tune.running.trial import short_name
from vidtune.tune.study import space


def _trial(number: int, trial_id: str = "abc123", status: str = "RUNNING", **config):
    return SimpleNamespace(experiment_tag=f"{number}_batch_size=8,lr=0.001", trial_id=trial_id, status=status,
                           config={"batch_size": 8, "lr": 2.5e-4, **config}, last_result={}, error_file=None)


def test_short_names_are_readable_and_stable():
    assert short_number(2.5e-4) == "2.5e-4" and short_number(1e-3) == "1e-3"
    assert short_number(0.00113873) == "1.1e-3"
    assert short_name(_trial(3)) == "t03-bs8-lr2.5e-4"
    assert short_name(_trial(12, weight_decay=0.01)) == "t12-bs8-lr2.5e-4-wd1e-2"
    assert short_name(SimpleNamespace(experiment_tag="", trial_id="x9", config={})) == "t-x9"


def test_one_line_per_epoch_names_the_trial_epoch_best_and_time_left(capsys):
    c = console.SearchConsole(num_samples=3, epochs=2, objective="val_acc", tty=False)
    a, b = _trial(1, "a"), _trial(2, "b", status="PENDING")
    c.on_trial_start(0, [a, b], a)
    c.on_trial_result(0, [a, b], a,
                      {"epoch": 1, "val_acc": 0.75, "clips_per_s": 40.0, "data_wait_frac": 0.05})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "trial 1/3 t01-bs8-lr2.5e-4 started: batch size 8, lr 0.00025"
    assert len(out) == 2                                    # the epoch: one line, with the search's state
    assert out[1].startswith("t01-bs8-lr2.5e-4  epoch 1/2  val_acc 0.750  40.0 clips/s  data wait 5%  |  "
                             "0/3 trials done, 1 running, 2 to start; best t01-bs8-lr2.5e-4 val_acc 0.750")
    a.status, a.last_result = "TERMINATED", {"epoch": 1, "val_acc": 0.75, "clips_per_s": 40.0}
    c.on_trial_complete(0, [a, b], a)
    assert capsys.readouterr().out == ("t01-bs8-lr2.5e-4 stopped early by ASHA after epoch 1/2: "
                                       "best val_acc 0.750 at epoch 1, 40.0 clips/s\n")
    quiet = console.SearchConsole(num_samples=1, epochs=1, objective="val_acc", quiet=True)
    quiet.on_trial_start(0, [a], a)
    assert capsys.readouterr().out == ""


def test_the_trial_end_line_gives_the_best_epoch_and_steady_speed_like_the_table(capsys):
    c = console.SearchConsole(num_samples=1, epochs=3, objective="val_acc", tty=False)
    a = _trial(2, "a")
    c.on_trial_start(0, [a], a)
    for epoch, acc, speed in ((1, 0.6, 10.0), (2, 0.719, 40.0), (3, 0.656, 42.4)):
        c.on_trial_result(0, [a], a, {"epoch": epoch, "val_acc": acc, "clips_per_s": speed})
    a.status, a.last_result = "TERMINATED", {"epoch": 3, "val_acc": 0.656, "clips_per_s": 42.4}
    capsys.readouterr()
    c.on_trial_complete(0, [a], a)
    # not the last epoch's 0.656: epoch 2's, and the median speed of epochs 2 and 3
    assert capsys.readouterr().out == "t02-bs8-lr2.5e-4 done: best val_acc 0.719 at epoch 2, 41.2 clips/s\n"


def test_under_val_f1_the_trial_end_line_names_the_best_epoch_by_f1(capsys):
    """The console follows the objective as the table does: accuracy peaks at epoch 2, F1 at 3."""
    c = console.SearchConsole(num_samples=1, epochs=3, objective="val_f1", tty=False)
    a = _trial(2, "a")
    c.on_trial_start(0, [a], a)
    for epoch, acc, f1 in ((1, 0.6, 0.4), (2, 0.85, 0.5), (3, 0.8, 0.78)):
        c.on_trial_result(0, [a], a, {"epoch": epoch, "val_acc": acc, "val_f1": f1, "clips_per_s": 40.0})
    a.status, a.last_result = "TERMINATED", {"epoch": 3, "val_acc": 0.8, "val_f1": 0.78, "clips_per_s": 40.0}
    capsys.readouterr()
    c.on_trial_complete(0, [a], a)
    assert capsys.readouterr().out == ("t02-bs8-lr2.5e-4 done: best val_acc 0.800 (val_f1 0.780) at epoch 3, "
                                       "40.0 clips/s\n")


def test_on_a_terminal_the_progress_line_is_redrawn_in_place(capsys):
    c = console.SearchConsole(num_samples=2, epochs=3, objective="val_acc", tty=True)
    a = _trial(1, "a")
    c.on_trial_start(0, [a], a)
    capsys.readouterr()
    for epoch in (1, 2):
        c.on_trial_result(0, [a], a, {"epoch": epoch, "val_acc": 0.5, "clips_per_s": 20.0})
    out = capsys.readouterr().out
    assert "\n" not in out and out.count("\r\x1b[K") == 2   # two epochs, no new line
    assert out.rsplit("\r\x1b[K", 1)[1].startswith("[#######             ] t01-bs8-lr2.5e-4  epoch 2/3")
    b = _trial(2, "b")
    c.on_trial_start(0, [a, b], b)                             # a line of its own above the progress line
    out = capsys.readouterr().out
    assert out.startswith("\r\x1b[Ktrial 2/2 t02-bs8-lr2.5e-4 started") and "\n[#######" in out
    c.on_experiment_end([a, b])
    assert capsys.readouterr().out == "\n"                     # the summary starts on a line of its own


def test_time_left_comes_from_the_measured_epochs_and_the_plan(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    c = console.SearchConsole(num_samples=4, epochs=3, objective="val_acc", concurrency=2, tty=False)
    a, b = _trial(1, "a"), _trial(2, "b")
    for t in (a, b):
        c.on_trial_start(0, [a, b], t)
    clock[0] = 20.0   # start-up and epoch 1 took 20 s; the epoch itself 10 s (as the worker timed it)
    for t in (a, b):
        c.on_trial_result(0, [a, b], t, {"epoch": 1, "val_acc": 0.5, "epoch_start_ts": 1000.0,
                                         "epoch_end_ts": 1010.0})
    # a and b: 2 epochs x 10 s each; 2 trials to start: 20 s + 2 x 10 s each; 2 at a time
    assert c.time_left([a, b]) == (2 * 20 + 2 * 40) / 2
    assert "about 1m left" in c.overall([a, b])
    clock[0] = 25.0   # epoch 2 takes 5 s: the steady epochs replace epoch 1's pace
    c.on_trial_result(0, [a, b], a, {"epoch": 2, "val_acc": 0.5})
    assert c.time_left([a, b]) == (1 * 5 + 2 * 5 + 2 * (20 + 2 * 5)) / 2
    serial = console.SearchConsole(num_samples=4, epochs=3, objective="val_acc", concurrency=1)
    serial.__dict__.update({k: v for k, v in c.__dict__.items() if k.startswith("_")})
    assert serial.time_left([a, b]) == 2 * c.time_left([a, b])
    assert console.SearchConsole(num_samples=1, epochs=1, objective="val_acc").time_left([a]) is None


def test_the_end_block_counts_the_trials_by_outcome():
    rows = [_row(f"t{i}", status) for i, status in
            enumerate(["DONE", "DIVERGED", "DONE", "STOPPED", "DONE", "DONE"])]
    assert console.outcome_line(rows, 252.0) == "6 trials in 4m12s: 4 done, 1 stopped early, 1 diverged"
    assert console.outcome_line(rows[:1], 5.0) == "1 trial in 5s: 1 done"
    assert console.outcome_line([_row("a", "OOM"), _row("b", "ERROR"), _row("c", "UNFINISHED")], 3700) == \
        "3 trials in 1h01m: 1 out of memory, 1 failed, 1 interrupted"


def _row(name: str, status: str) -> results.TrialResult:
    return results.TrialResult(trial_id=name, batch_size=8, lr=1e-3, val_acc=0.5, val_f1=0.5,
                            clips_per_s=10.0, epoch_time_s=1.0, epochs=2, status=status, checkpoint=None)


def test_markdown_table_for_the_parent_description():
    row = results.TrialResult(trial_id="a", batch_size=8, lr=2.5e-4, val_acc=0.8125,
                           val_f1=0.8, clips_per_s=41.234, epoch_time_s=2.0, epochs=3, status="DONE",
                           checkpoint=None, name="t01-bs8-lr2.5e-4", best_epoch=2)
    oom = results.TrialResult(trial_id="b", batch_size=64, lr=1e-3, val_acc=math.nan,
                           val_f1=math.nan, clips_per_s=math.nan, epoch_time_s=math.nan, epochs=1,
                           status="OOM", checkpoint=None, name="t02-bs64-lr1e-3")
    lines = tables.format_markdown([row, oom], val_clips=32).splitlines()
    assert lines[0].startswith("| trial | batch | lr | best val_acc | epoch |")
    assert lines[1].startswith("|---|")
    assert lines[2] == ("| t01-bs8-lr2.5e-4 | 8 | 2.50e-04 | 0.812 [0.65, 0.91] | 2 | 0.800 | 41.2 | 3 "
                        "| DONE |")
    assert lines[3].endswith("| - | - | - | - | 1 | OOM |")
    assert "[" not in tables.format_markdown([row])          # the clip count unknown: no interval


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


def test_a_trial_that_failed_on_a_full_disk_stops_the_search_as_tune_would(tmp_path):
    """The race the disk-full fault test lost once: the trial's checkpoint copy (pyarrow) met the
    full disk before Tune's own state did, so the Tuner returned and the search ended as "no
    trial produced a usable result (1 ERROR)" instead of "disk full at PATH"."""
    from types import SimpleNamespace

    copy = RuntimeError("OSError: [Errno 28] Error writing bytes to file. Detail: [errno 28] No space left "
                        "on device")
    results = [SimpleNamespace(error=None), SimpleNamespace(error=RuntimeError("a bug")),
               SimpleNamespace(error=copy)]
    assert faults.trial_disk_full(results, str(tmp_path)) is copy
    assert faults.trial_disk_full(results[:2], str(tmp_path)) is None     # tmp_path has room


def test_rays_lines_go_to_the_log_and_ours_to_the_console():
    screen, log = io.StringIO(), io.StringIO()
    out = search_log.RayLinesToLog(screen, log)
    out.write("\x1b[33m(raylet)\x1b[0m WARNING: 8 PYTHON worker processes\ntrial 1/2 started\n")
    out.write("(RayTrainWorker pid=12, ip=10.0.0.1) Error in training function\n(epoch 2) is ours\n")
    out.flush()
    assert screen.getvalue() == "trial 1/2 started\n(epoch 2) is ours\n"
    assert "(raylet)" in log.getvalue() and "RayTrainWorker pid=12" in log.getvalue()


def test_asha_rungs_are_rays_milestones_below_the_last_epoch():
    assert space.milestones(grace=1, reduction_factor=2, brackets=1, epochs=6) == ((1, 2, 4),)
    assert space.milestones(grace=1, reduction_factor=2, brackets=2, epochs=6) == ((1, 2, 4), (2, 4))
    assert space.milestones(grace=2, reduction_factor=3, brackets=1, epochs=6) == ((2,),)


def test_expected_epochs_count_the_trials_asha_is_likely_to_stop():
    c = console.SearchConsole(num_samples=4, epochs=6, objective="val_acc", rungs=((1, 2, 4),),
                              reduction_factor=2)
    reached: dict = {}
    assert c.expected_epochs(0, reached) == 6            # the first trial: nothing to compare it with
    # the second meets one trial at each rung: past each with probability 1/2
    assert c.expected_epochs(0, reached) == 1 + 0.5 * 1 + 0.25 * 2 + 0.125 * 2
    assert c.expected_epochs(4, {}) == 2                   # past its last rung: the rest, surely
    flat = console.SearchConsole(num_samples=4, epochs=6, objective="val_acc")
    assert flat.expected_epochs(2, {}) == 4                # no early stopping: every epoch left


def test_time_left_with_asha_is_below_the_every_epoch_bound(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    asha = console.SearchConsole(num_samples=4, epochs=6, objective="val_acc", concurrency=1, tty=False,
                                 rungs=((1, 2, 4),), reduction_factor=2)
    flat = console.SearchConsole(num_samples=4, epochs=6, objective="val_acc", concurrency=1, tty=False)
    a = _trial(1, "a")
    for c in (asha, flat):
        c.on_trial_start(0, [a], a)
    for epoch in range(1, 7):
        clock[0] = 10.0 * epoch
        for c in (asha, flat):
            c.on_trial_result(0, [a], a, {"epoch": epoch, "val_acc": 0.5, "epoch_start_ts": 0.0,
                                          "epoch_end_ts": 10.0})
    a.status = "TERMINATED"
    # 3 trials to start, each 10 s to its first report then 10 s an epoch: 60 s each when none is
    # stopped; with ASHA each meets the others at its rungs
    assert flat.time_left([a]) == 3 * 60
    reached: dict = {(0, 1): 1.0, (0, 2): 1.0, (0, 4): 1.0}
    expected = sum(10 + (asha.expected_epochs(0, reached) - 1) * 10 for _ in range(3))
    assert asha.time_left([a]) == expected < 3 * 60


def _replay_demo(monkeypatch) -> list[tuple[int, int, float, float]]:
    """tests/data/demo_timeline.json (a real `make demo`) replayed through SearchConsole on a fake
    clock, as Tune's callbacks would call it: (trial, epoch, estimated seconds left, the seconds
    the search still took) at each report."""
    import json
    from pathlib import Path

    doc = json.loads((Path(__file__).parent / "data" / "demo_timeline.json").read_text())
    clock = [0.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    rungs = space.milestones(grace=doc["grace"], reduction_factor=doc["reduction_factor"], brackets=1,
                               epochs=doc["epochs"])
    c = console.SearchConsole(num_samples=len(doc["trials"]), epochs=doc["epochs"], objective="val_acc",
                              concurrency=1, tty=False, rungs=rungs, reduction_factor=doc["reduction_factor"])
    trials = [_trial(i + 1, t["trial_id"], status="PENDING") for i, t in enumerate(doc["trials"])]
    events = sorted([(t["start_s"], i, None) for i, t in enumerate(doc["trials"])] +
                    [(r["at_s"], i, r) for i, t in enumerate(doc["trials"]) for r in t["reports"]],
                    key=lambda e: e[0])
    end, out = events[-1][0], []
    for at, i, report in events:
        clock[0] = at
        if report is None:
            for earlier in trials[:i]:
                earlier.status = "TERMINATED"
            trials[i].status = "RUNNING"
            c.on_trial_start(0, trials, trials[i])
            continue
        c.on_trial_result(0, trials, trials[i], {"epoch": report["epoch"], "val_acc": report["val_acc"],
                                                 "epoch_start_ts": 0.0, "epoch_end_ts": report["epoch_s"]})
        out.append((i + 1, report["epoch"], c.time_left(trials), end - at))
    return out


def test_time_left_on_a_recorded_demo_is_near_what_the_search_took(monkeypatch, capsys):
    """From the second trial on, the estimate is within 25% of the time the demo still took once
    ASHA's decisions about the running trial are made (past its rung), and within 40% before:
    the last trial could have been stopped at epoch 3 (probability 1/2) and was not."""
    points = [(trial, epoch, left / truth) for trial, epoch, left, truth in _replay_demo(monkeypatch)
              if trial >= 2 and truth > 0]
    capsys.readouterr()
    assert len(points) == 14
    decided = [ratio for trial, epoch, ratio in points if epoch >= 3]
    assert all(0.75 <= ratio <= 1.25 for ratio in decided), points
    assert all(0.6 <= ratio <= 1.25 for _, _, ratio in points), points
    # it leans low (median 0.85 here): the later trials' batch 4 epochs were slower than the first's
    assert statistics.median(ratio for _, _, ratio in points) == pytest.approx(1.0, abs=0.2)


def test_after_a_resume_the_trial_end_and_best_so_far_lines_use_the_whole_history(capsys, tmp_path):
    """A fresh console, as after --resume (the console Tune restores holds nothing of the runs
    before): t01 trained epochs 1-2 before the interruption (0.500 at epoch 1 is its best) and
    retrains from its epoch-2 checkpoint; t02 had ended before it with 0.625. The trial-end line
    and the best so far read every epoch (`epochs.json` of each trial's latest checkpoint), as
    the table does, not only this process's reports (it said "0.375 at epoch 4").

    The trials carry Tune's own storage object, as restored trials do (`Tuner.restore` gives each
    a `StorageContext` at the search's folder): a stand-in with other attributes once hid that
    the console read one Tune's object does not have, and so never found the saved history."""
    experiment = tmp_path / "s" / "ray"
    storage = StorageContext(storage_path=str(tmp_path), experiment_dir_name="s/ray")
    a, b = _trial(1, "a"), _trial(2, "b", status="TERMINATED")
    a.storage = b.storage = storage
    for trial, history in ((a, {1: 0.5, 2: 0.375}), (b, {1: 0.5, 2: 0.625})):
        folder = experiment / "train_runs" / short_name(trial) / "epoch_0002"
        folder.mkdir(parents=True)
        write_history(folder, {e: {"epoch": e, "val_acc": acc, "clips_per_s": 30.0 + e}
                               for e, acc in history.items()})
    c = console.SearchConsole(num_samples=2, epochs=4, objective="val_acc", tty=False)
    c.on_trial_start(0, [a, b], a)
    capsys.readouterr()
    for epoch in (3, 4):
        c.on_trial_result(0, [a, b], a, {"epoch": epoch, "val_acc": 0.375, "clips_per_s": 40.0,
                                         "resumed_from_epoch": 2 if epoch == 3 else 0})
    out = capsys.readouterr().out
    assert "t01-bs8-lr2.5e-4 continues from epoch 2" in out
    assert out.rstrip().endswith("best t02-bs8-lr2.5e-4 val_acc 0.625"), out     # t02, ended before
    a.status, a.last_result = "TERMINATED", {"epoch": 4, "val_acc": 0.375, "clips_per_s": 40.0}
    c.on_trial_complete(0, [a, b], a)
    # epoch 1's 0.500 (as the table), and the median speed of epochs 2-4: 32, 40, 40
    assert capsys.readouterr().out == "t01-bs8-lr2.5e-4 done: best val_acc 0.500 at epoch 1, 40.0 clips/s\n"
    rows = results.live_row("a", a.config, {1: {"val_acc": 0.5}, 2: {"val_acc": 0.375}, 3: {"val_acc": 0.375},
                                            4: {"val_acc": 0.375}}, "DONE")
    assert (rows.best_epoch, rows.val_acc) == (1, 0.5)          # the table's rule, on the same epochs
    # on remote storage the folder is a URI again (pyarrow keeps the scheme in its filesystem)
    remote = SimpleNamespace(experiment_fs_path="bucket/s/ray",
                             storage_filesystem=SimpleNamespace(type_name="s3"))
    assert console._experiment_path(SimpleNamespace(storage=remote)) == "s3://bucket/s/ray"


def test_a_trial_tune_runs_again_says_so_and_why(capsys, tmp_path):
    """A lost node's trial is retried by Tune (tune/running/trial_retry.py): its second start says it
    goes on from its checkpoint and why the first try ended, not "started" as if new."""
    c = console.SearchConsole(num_samples=2, epochs=3, objective="val_acc", tty=False)
    a = _trial(1, "a")
    c.on_trial_start(0, [a], a)
    error = tmp_path / "error.txt"
    error.write_text("Failure # 1\nTraceback (most recent call last):\n  ...\n"
                     "ray.exceptions.ActorDiedError: The actor died unexpectedly\n")
    a.error_file = str(error)
    c.on_trial_recover(0, [a], a)
    c.on_trial_start(0, [a], a)
    out = capsys.readouterr().out.splitlines()
    assert out == ["trial 1/2 t01-bs8-lr2.5e-4 started: batch size 8, lr 0.00025",
                   "trial 1/2 t01-bs8-lr2.5e-4 started again from its last checkpoint (its last try ended: "
                   "ray.exceptions.ActorDiedError: The actor died unexpectedly)"]
    c.on_trial_start(0, [a], a)                    # a later start (a --resume) is a plain one again
    assert "started: batch size 8" in capsys.readouterr().out
