"""trainer/training/utilization.py: the cores other processes kept busy on the machine during an epoch."""
from __future__ import annotations

import math

import psutil
import pytest


def test_other_cores_subtracts_every_worker_of_the_run_on_a_node():
    from vidtune.trainer.training.utilization import CpuWindow, other_cores

    one = {"n1": [CpuWindow(busy_s=3.0, own_s=2.0, wall_s=2.0)]}
    assert other_cores(one) == pytest.approx(0.5)
    # two workers on n1 see the same machine: both their own times come off it
    two = {"n1": [CpuWindow(4.0, 1.8, 2.0), CpuWindow(4.0, 1.8, 2.0)], "n2": [CpuWindow(2.0, 1.0, 2.0)]}
    assert other_cores(two) == pytest.approx(0.5)      # the busiest node: n2 (0.5) vs n1 (0.2)
    assert other_cores({"n1": [CpuWindow(1.0, 1.5, 2.0)]}) == 0.0     # never below zero
    assert math.isnan(other_cores({"n1": [None]}))                    # no /proc: unknown


def test_other_cpu_load_counts_other_processes_not_this_ones_children(tmp_path):
    import subprocess
    import sys
    import time

    from vidtune.trainer.training.utilization import OtherCpuLoad

    # 1.2 s of CPU time (not wall time: on a busy machine it still burns all of it), then a mark
    done = tmp_path / "done"
    spin = f"import time\nwhile time.process_time() < 1.2: pass\nopen({str(done)!r}, 'w').close()"
    load = OtherCpuLoad()
    load.start()
    subprocess.run([sys.executable, "-c", spin], check=True)        # a child: this run's own
    own = load.stop()
    assert own.own_s >= 1.1                                          # counted as this process tree's
    done.unlink()
    load.start()
    # the same spin, detached (its parent shell exits): another process on the machine
    subprocess.run(["sh", "-c", f"'{sys.executable}' -c \"{spin}\" &"], check=True)
    deadline = time.time() + 60
    while not done.exists() and time.time() < deadline:
        time.sleep(0.05)
    other = load.stop()
    assert done.exists(), "the detached spinner did not finish"
    assert other.own_s < 0.5                                         # not this tree's ...
    assert other.busy_s - other.own_s >= 1.1                         # ... but the machine's: other load


def test_a_grandchilds_cpu_time_is_this_process_trees():
    """A process started by a child (a DataLoader worker's own helper, a shell's command) counts
    as this tree's while it runs, not only this process's direct children."""
    import subprocess
    import sys
    import time

    from vidtune.trainer.training.utilization import process_tree_cpu, tree_cpu_since

    spin = "import time\nwhile time.process_time() < 1.0: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c",
                              f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"])
    try:
        before = process_tree_cpu()
        deadline = time.time() + 60
        while tree_cpu_since(before, process_tree_cpu()) < 0.9 and time.time() < deadline:
            time.sleep(0.1)
        # the grandchild's second of CPU, while it lives
        assert tree_cpu_since(before, process_tree_cpu()) >= 0.9
    finally:
        for process in psutil.Process(child.pid).children(recursive=True):
            process.kill()
        child.kill()
        child.wait()


def test_a_descendant_that_ends_in_the_window_never_makes_the_own_time_negative():
    """A process of the tree that used CPU before the window and ended in it (e.g. a Ray process
    an earlier run left behind) takes its time away: the window must not count it as negative."""
    from vidtune.trainer.training.utilization import tree_cpu_since

    before = {(10, 1.0): 5.0, (11, 2.0): 3.0}          # pid 11 used 3 s, then ended
    now = {(10, 1.0): 5.5, (12, 9.0): 0.25}           # pid 12 is new; pid 10 is the same process
    assert tree_cpu_since(before, now) == 0.75
    # the same pid with another start time is another process: all of its time is new
    assert tree_cpu_since({(10, 1.0): 5.0}, {(10, 7.0): 0.5}) == 0.5
