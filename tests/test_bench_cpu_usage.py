"""bench/cpu_usage.py: process kinds from titles, and a sampler that counts the processes started
while it runs (and only those)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from bench.cpu_usage import CpuSampler, available, kind


@pytest.mark.parametrize("title, expected", [
    ("ray::TrainController.run", "ray::TrainController"),
    ("ray::RayTrainWorker", "ray::RayTrainWorker"),
    ("/v/bin/python -u /repo/tune/search.py --data x", "search.py"),
    ("/v/bin/python -m bench.search_overhead --plain-spec f", "python -m bench.search_overhead"),
    ("/v/ray/core/src/ray/raylet/raylet --raylet_socket_name=/t", "raylet"),
    ("ray-dashboard-NodeHead-0 (/v/bin/python -B -c from multiprocessing)", "ray-dashboard-NodeHead"),
    ("/v/bin/python -c from multiprocessing.spawn import spawn_main", "python (multiprocessing child)"),
    ("", "?"),
])
def test_kind_of_a_process_title(title, expected):
    assert kind(title) == expected


BUSY = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"


@pytest.mark.skipif(not available(), reason="needs Linux /proc")
def test_sampler_counts_the_processes_started_inside_it_and_their_cpu():
    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])   # started before: not counted
    try:
        with CpuSampler(interval_s=0.05) as sampler:
            subprocess.run([sys.executable, "-u", "-c", BUSY, "busy-marker"], check=True)
    finally:
        before.kill()
    usage = sampler.usage
    n, cpu = usage.by_kind["python -c"]
    assert n == 1 and cpu >= 0.4          # the busy child: one process, its ~0.6 s of CPU (last sample)
    assert usage.machine_busy_s >= cpu - 0.05
    assert usage.to_dict()["by_kind"]["python -c"]["processes"] == 1
