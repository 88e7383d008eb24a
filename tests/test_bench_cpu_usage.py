"""bench/cpu_usage.py: process kinds from titles, and a sampler that counts the processes started
while it runs (and only those)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from bench.common import merge_intervals, union_length
from bench.cpu_usage import CpuSampler, CpuUsage, Step, kind, process_kind


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


@pytest.mark.parametrize("title, previous, expected", [
    ("ray::IDLE", None, "ray::IDLE"),
    ("ray::TrainController.run", "ray::IDLE", "ray::TrainController"),           # given an actor
    ("ray::IDLE", "ray::TrainController", "ray::TrainController"),
    ("ray::execute", "ray::RayTrainWorker", "ray::RayTrainWorker"),              # a method's title
    ("", "ray::RayTrainWorker", "ray::RayTrainWorker"),                          # title unreadable
    ("/v/bin/python -m bench.search_overhead", "python -c", "python -m bench.search_overhead"),
])
def test_a_process_keeps_its_first_ray_kind(title, previous, expected):
    assert process_kind(title, previous) == expected


BUSY = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"


def test_sampler_counts_the_processes_started_inside_it_and_their_cpu(tmp_path):
    # Both processes are scripts of one name, a kind of their own: the sampler counts the machine's
    # processes, and another test process (pytest-xdist's other worker) starts `python -c` ones.
    (tmp_path / "before").mkdir()
    (tmp_path / "inside").mkdir()
    (tmp_path / "before" / "sampled_marker.py").write_text("import time\ntime.sleep(3)\n")
    (tmp_path / "inside" / "sampled_marker.py").write_text(BUSY)
    # started before: not counted
    before = subprocess.Popen([sys.executable, str(tmp_path / "before" / "sampled_marker.py")])
    try:
        with CpuSampler(interval_s=0.05) as sampler:
            subprocess.run([sys.executable, "-u", str(tmp_path / "inside" / "sampled_marker.py")], check=True)
    finally:
        before.kill()
    usage = sampler.usage
    n, cpu = usage.by_kind["sampled_marker.py"]
    assert n == 1 and cpu >= 0.4          # the busy child: one process, its ~0.6 s of CPU (last sample)
    assert usage.machine_busy_s >= cpu - 0.05
    assert usage.to_dict()["by_kind"]["sampled_marker.py"]["processes"] == 1


def test_within_counts_the_steps_inside_the_windows_in_proportion():
    usage = CpuUsage(timeline=[Step(0.0, 1.0, 2.0, {"train": 1.8, "ray::X": 0.2}),
                               Step(1.0, 2.0, 1.0, {"ray::X": 1.0}),
                               Step(2.0, 4.0, 4.0, {"train": 4.0})])
    # [0.5, 1.0] and its overlapping twin [0.5, 0.8] count once; [3.0, 5.0] covers half the last step
    covered, busy, by_kind = usage.within([(0.5, 1.0), (0.5, 0.8), (3.0, 5.0)])
    assert covered == pytest.approx(1.5)
    assert busy == pytest.approx(0.5 * 2.0 + 0.5 * 4.0)
    assert by_kind == pytest.approx({"train": 0.9 + 2.0, "ray::X": 0.1})
    assert usage.within([(1.2, 1.2)]) == (0.0, 0.0, {})     # an empty window counts nothing


def test_the_timeline_adds_up_to_each_kinds_cpu():
    with CpuSampler(interval_s=0.05) as sampler:
        subprocess.run([sys.executable, "-u", "-c", BUSY, "busy-marker"], check=True)
    usage = sampler.usage
    steps = usage.timeline
    assert len(steps) >= 5 and all(a.end == b.start for a, b in zip(steps, steps[1:], strict=False))
    in_steps = sum(step.by_kind.get("python -c", 0.0) for step in steps)
    assert in_steps == pytest.approx(usage.by_kind["python -c"][1])
    covered, _, by_kind = usage.within([(steps[0].start, steps[-1].end)])
    assert by_kind["python -c"] == pytest.approx(in_steps)


def test_intervals_merge_once_and_their_union_length():
    spans = [(4.0, 5.0), (0.0, 1.0), (0.5, 2.0), (3.0, 3.0), (5.0, 6.0)]
    # overlapping and touching joined, empty dropped
    assert merge_intervals(spans) == [(0.0, 2.0), (4.0, 6.0)]
    assert union_length(spans) == 4.0
