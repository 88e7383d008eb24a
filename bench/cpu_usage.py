"""Where a command's CPU time goes, by process kind (read with psutil).

`CpuSampler` runs beside a command (bench/search_overhead.py wraps each side in one). Every
`interval_s` it reads, for each process started after the sampler, its cumulative CPU time
(utime + stime) and its title; at the end each process counts under its last title's kind:
Ray's actors and tasks name their processes `ray::<Class>` (`ray::TrainController`,
`ray::RayTrainWorker`, ...), Ray's daemons are `raylet`, `gcs_server`, `dashboard.py`, ...
It also reads the whole machine's busy CPU time (`machine_busy_s`) over the same span, which
counts what the samples miss: processes shorter than one interval, and anything else running.

Each sample also adds a step to a timeline (the CPU seconds each kind, and the machine, used
since the previous sample), so `CpuUsage.within(windows)` can say who used the cores during
chosen spans, e.g. while training epochs ran.

Why: on a machine whose cores are all busy, wall time follows CPU time, so "the search took
twice as long" is explained by which processes burned the extra CPU seconds, and how many of
them each trial started.
"""
from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil

from bench.common import merge_intervals
from vidtune.trainer.training.utilization import machine_busy_s


def kind(title: str) -> str:
    """A process's kind from its title (its command line): `ray::TrainController.run` ->
    `ray::TrainController`; a Python script -> its file name; a program -> its base name."""
    title = title.strip()
    if title.startswith("ray::"):
        return re.split(r"[.\s]", title, maxsplit=1)[0]
    if title.startswith("ray-dashboard-"):
        return "ray-dashboard-" + title[len("ray-dashboard-"):].split()[0].split("-")[0]
    words = title.split()
    if not words:
        return "?"
    program = os.path.basename(words[0])
    if program.startswith("python"):
        args = words[1:]
        if "-m" in args[:-1]:
            return f"python -m {args[args.index('-m') + 1]}"
        if "-c" in args:   # multiprocessing's spawned children run `python -c "from multiprocessing..."`
            return "python (multiprocessing child)" if "multiprocessing" in title else f"{program} -c"
        script = next((w for w in args if not w.startswith("-")), "")
        return os.path.basename(script) or program
    return program


def process_kind(title: str, previous: str | None) -> str:
    """The kind a process counts under, from its title now and the kind it had at the last sample.
    A Ray worker is `ray::IDLE` (or default_worker.py) until it is given an actor or task, and an
    actor's title changes with the method it runs (seen: a Train worker last titled
    `ray::execute`): a process keeps the first actor or task kind it showed."""
    if not title.strip():
        return previous or "?"
    name = kind(title)
    if previous and (name in ("ray::IDLE", "default_worker.py")
                     or (previous.startswith("ray::") and previous != "ray::IDLE")):
        return previous
    return name


@dataclass
class _Seen:
    cpu_s: float
    kind: str


@dataclass
class Step:
    """CPU seconds used between two samples (unix seconds `start`..`end`): the machine's busy
    time and, per process kind, the sampled processes' (a process first seen in this step counts
    all its CPU time so far here)."""

    start: float
    end: float
    machine_busy_s: float
    by_kind: dict[str, float]


@dataclass
class CpuUsage:
    """What a `CpuSampler` saw: wall span, the machine's busy CPU seconds, and per process kind
    how many processes of that kind started and the CPU seconds they used; `timeline`, the same
    split per sampling step."""

    wall_s: float = 0.0
    machine_busy_s: float = 0.0
    by_kind: dict[str, tuple[int, float]] = field(default_factory=dict)   # kind -> (processes, cpu s)
    timeline: list[Step] = field(default_factory=list)

    def within(self, windows: list[tuple[float, float]]) -> tuple[float, float, dict[str, float]]:
        """(seconds covered, machine busy CPU s, kind -> CPU s) during the union of `windows`
        (unix (start, end) pairs). A step partly inside counts in proportion to its overlap,
        so the figures are as fine as the sampling interval."""
        merged = merge_intervals(windows)
        covered, busy, by_kind = 0.0, 0.0, {}
        for step in self.timeline:
            length = step.end - step.start
            inside = sum(max(0.0, min(b, step.end) - max(a, step.start)) for a, b in merged)
            if length <= 0 or inside <= 0:
                continue
            share = inside / length
            covered += inside
            busy += share * step.machine_busy_s
            for k, cpu in step.by_kind.items():
                by_kind[k] = by_kind.get(k, 0.0) + share * cpu
        return covered, busy, by_kind

    @property
    def sampled_s(self) -> float:
        return sum(cpu for _, cpu in self.by_kind.values())

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "machine_busy_s": self.machine_busy_s, "sampled_s": self.sampled_s,
                "by_kind": {k: {"processes": n, "cpu_s": c} for k, (n, c) in self.by_kind.items()}}


class CpuSampler:
    """Context manager: samples the processes that start while it runs (see the module doc).
    `usage` holds the result after exit."""

    def __init__(self, interval_s: float = 0.25):
        self.interval_s = interval_s
        self.usage = CpuUsage()
        self._seen: dict[int, _Seen] = {}
        self._stop = threading.Event()

    def __enter__(self) -> CpuSampler:
        self._existing = dict(self._processes())   # pid -> start time: these are not counted
        self._start_busy, self._start = machine_busy_s(), time.time()
        self._last_busy, self._last = self._start_busy, self._start
        self._timeline: list[Step] = []
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        by_kind: dict[str, tuple[int, float]] = {}
        for seen in self._seen.values():
            n, cpu = by_kind.get(seen.kind, (0, 0.0))
            by_kind[seen.kind] = (n + 1, cpu + seen.cpu_s)
        self.usage = CpuUsage(wall_s=time.time() - self._start,
                              machine_busy_s=machine_busy_s() - self._start_busy,
                              by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1][1])),
                              timeline=self._timeline)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    @staticmethod
    def _processes() -> Iterator[tuple[int, tuple[float, float, str]]]:
        """(pid, (start time, user + system CPU seconds, title)) of each process but this one."""
        me = os.getpid()
        for process in psutil.process_iter(["create_time", "cpu_times", "cmdline"]):
            info = process.info
            if process.pid == me or info["create_time"] is None or info["cpu_times"] is None:
                continue             # it ended between the listing and the read, or is not ours to read
            cpu = info["cpu_times"].user + info["cpu_times"].system
            yield process.pid, (info["create_time"], cpu, " ".join(info["cmdline"] or ()))

    def _sample(self) -> None:
        now, busy = time.time(), machine_busy_s()
        used: dict[str, float] = {}
        for pid, (started, cpu, title) in self._processes():
            if self._existing.get(pid, (None,))[0] == started:    # running before the sampler
                continue
            previous = self._seen.get(pid)
            name = process_kind(title, previous.kind if previous else None)
            self._seen[pid] = _Seen(cpu_s=cpu, kind=name)
            delta = cpu - (previous.cpu_s if previous else 0.0)
            if delta > 0:
                used[name] = used.get(name, 0.0) + delta
        self._timeline.append(Step(self._last, now, busy - self._last_busy, used))
        self._last, self._last_busy = now, busy
