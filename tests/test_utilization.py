"""trainer/utilization.py: the cores other processes kept busy on the machine during an epoch."""
from __future__ import annotations

import math
from pathlib import Path

import pytest


def test_other_cores_subtracts_every_worker_of_the_run_on_a_node():
    from trainer.utilization import CpuWindow, other_cores

    one = {"n1": [CpuWindow(busy_s=3.0, own_s=2.0, wall_s=2.0)]}
    assert other_cores(one) == pytest.approx(0.5)
    # two workers on n1 see the same machine: both their own times come off it
    two = {"n1": [CpuWindow(4.0, 1.8, 2.0), CpuWindow(4.0, 1.8, 2.0)], "n2": [CpuWindow(2.0, 1.0, 2.0)]}
    assert other_cores(two) == pytest.approx(0.5)      # the busiest node: n2 (0.5) vs n1 (0.2)
    assert other_cores({"n1": [CpuWindow(1.0, 1.5, 2.0)]}) == 0.0     # never below zero
    assert math.isnan(other_cores({"n1": [None]}))                    # no /proc: unknown


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="needs Linux /proc")
def test_other_cpu_load_counts_other_processes_not_this_ones_children():
    import subprocess
    import sys
    import time

    from trainer.utilization import OtherCpuLoad, other_cores

    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.2: pass"
    load = OtherCpuLoad()
    load.start()
    subprocess.run([sys.executable, "-c", spin], check=True)        # a child: this run's own
    own = load.stop()
    load.start()
    # the same spin, detached (its parent shell exits): another process on the machine
    subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{spin}" &'], check=True)
    time.sleep(1.6)
    other = load.stop()
    assert own.own_s >= 1.0 and other_cores({"n": [own]}) < 0.5
    assert other_cores({"n": [other]}) > 0.4
