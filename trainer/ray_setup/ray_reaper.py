"""What is left of a local Ray when the command that started it is killed.

Ray ties its GCS and raylet to the process that started them: they die with it. The raylet's
agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) notice later and then wait on the dead
GCS: after a SIGKILLed search (the OOM killer, `kill -9`, a scheduler's hard stop) they stayed
50-80 s, holding memory and ports. So a Ray that vidtune starts gets a reaper
(`start_reaper`): a small process in a session of its own (a signal to the command's process
group does not end it first) that notes the Ray processes under the command every second while
the command runs and, once it has ended however it ended, kills those still running. After a
clean exit `ray.shutdown()` has stopped them already, and it kills nothing.

    python -m vidtune.trainer.ray_setup.ray_reaper PID      # what start_reaper runs
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable

import psutil

# A Ray process, by its command line (its binaries live under .../ray/; workers and agents are
# titled ray::NAME) or its name (raylet, gcs_server, ray-dashboard-*).
RAY_PROCESS = re.compile(r"/ray/|ray::|\braylet\b|gcs_server")
POLL_S = 1.0


def is_ray_process(process: psutil.Process) -> bool:
    """Whether `process` is one of Ray's (psutil.Error when it is gone or unreadable)."""
    return bool(RAY_PROCESS.search(" ".join(process.cmdline()))) or process.name().startswith(("ray", "gcs"))


def ray_processes_under(process: psutil.Process) -> list[psutil.Process]:
    """The Ray processes among `process`'s descendants."""
    found = []
    for child in process.children(recursive=True):
        try:
            if is_ray_process(child):
                found.append(child)
        except psutil.Error:      # gone already
            continue
    return found


def start_reaper(pid: int | None = None) -> subprocess.Popen:
    """Start the reaper of the Ray processes under `pid` (default: this process)."""
    return subprocess.Popen(
        [sys.executable, "-m", "vidtune.trainer.ray_setup.ray_reaper", str(pid or os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True)


def _running(process: psutil.Process) -> bool:
    """Alive and not a zombie (a killed child its parent has not waited for yet)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def reap(pid: int, poll_s: float = POLL_S, first_ray_within_s: float = 30.0) -> list[int]:
    """Wait for process `pid` to end, noting the Ray processes under it every `poll_s`; then kill
    (SIGKILL) those still running, and return their pids. psutil tells a process from a later
    one with the same pid by its start time, so nothing else is killed.

    Returns [] at once when that Ray is stopped while `pid` goes on (`ray.shutdown()`: every
    process noted has ended and none is under `pid`; a later Ray there gets its own reaper), or
    when no Ray process shows up under `pid` within `first_ray_within_s`."""
    try:
        command = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    seen: dict[int, psutil.Process] = {}
    started = time.monotonic()
    while _running(command):
        try:
            current = ray_processes_under(command)
        except psutil.Error:      # it ended while being read
            break
        seen.update((p.pid, p) for p in current)
        if not current and (seen and not any(map(_running, seen.values()))
                            or not seen and time.monotonic() - started > first_ray_within_s):
            return []
        time.sleep(poll_s)
    return kill_all(p for p in seen.values() if _running(p))


def kill_all(processes: Iterable[psutil.Process]) -> list[int]:
    """SIGKILL each of `processes` and wait (10 s at most) for them to end; returns the pids the
    signal reached (one already gone is skipped)."""
    killed = []
    for process in processes:
        try:
            process.kill()
            killed.append(process)
        except psutil.Error:      # gone already
            continue
    psutil.wait_procs(killed, timeout=10)
    return [p.pid for p in killed]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m vidtune.trainer.ray_setup.ray_reaper PID", file=sys.stderr)
        return 2
    reap(int(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
