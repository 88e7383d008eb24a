"""vidtune.trainer.ray_setup.ray_reaper: the Ray processes of a killed command end with it, and nothing else.

A stand-in command starts two children, one titled like a Ray agent (`ray::DashboardAgent`) and
one that is not Ray's, then is SIGKILLed: the reaper kills the first, leaves the second. A slow
test does the same to a real search's driver.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from vidtune.trainer.ray_setup import ray_reaper

REPO = Path(__file__).resolve().parents[1]

# Prints the pids of its two children as one JSON line, then sleeps until killed. The "agent"
# carries `ray::DashboardAgent` in its command line, as Ray's agents do in their process title.
COMMAND = r"""
import json, subprocess, sys, time
sleep = "import time; time.sleep(120)"
agent = subprocess.Popen([sys.executable, "-c", sleep, "ray::DashboardAgent"])
other = subprocess.Popen([sys.executable, "-c", sleep, "not-a-ray-process"])
print(json.dumps({"agent": agent.pid, "other": other.pid}), flush=True)
time.sleep(120)
"""


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


def test_a_killed_commands_ray_processes_are_killed_and_nothing_else():
    command = subprocess.Popen([sys.executable, "-c", COMMAND], stdout=subprocess.PIPE, text=True)
    children = json.loads(command.stdout.readline())
    reaper = ray_reaper.start_reaper(command.pid)
    try:
        time.sleep(2 * ray_reaper.POLL_S)              # the reaper notes the agent
        command.kill()
        command.wait()
        assert reaper.wait(timeout=30) == 0
        assert _gone_within(children["agent"], 5), "the Ray-titled child outlived its killed command"
        assert psutil.pid_exists(children["other"]), "the reaper killed a process that is not Ray's"
    finally:
        for pid in children.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reaper.kill()


def test_a_ray_stopped_while_its_command_goes_on_ends_the_reaper_at_once():
    """ray.shutdown() in a command that goes on: the reaper leaves, killing nothing."""
    command = subprocess.Popen([sys.executable, "-c", COMMAND], stdout=subprocess.PIPE, text=True)
    children = json.loads(command.stdout.readline())
    try:
        reaper = ray_reaper.start_reaper(command.pid)
        time.sleep(2 * ray_reaper.POLL_S)
        os.kill(children["agent"], signal.SIGKILL)     # the Ray stopped; the command runs on
        assert reaper.wait(timeout=10) == 0
        assert command.poll() is None and psutil.pid_exists(children["other"])
    finally:
        command.kill()
        for pid in children.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_reaper_refuses_a_bad_argument(capsys):
    assert ray_reaper.main(["not-a-pid"]) == 2
    assert "usage: python -m vidtune.trainer.ray_setup.ray_reaper PID" in capsys.readouterr().err


@pytest.mark.slow   # a real search, killed once its trial trains (about a minute)
@pytest.mark.timeout(300)
def test_no_ray_process_outlives_a_killed_search_by_more_than_seconds(synthetic_root, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    search = subprocess.Popen(
        [sys.executable, "-m", "vidtune.tune.search", "--data", str(synthetic_root), "--smoke-test",
         "--storage", str(tmp_path / "results"), "--mlflow-uri", f"sqlite:///{tmp_path / 'mlruns.db'}",
         "--num-samples", "1", "--epochs", "4"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        for line in search.stdout:                      # until its trial has started training
            if "started" in line:
                break
        ray = ray_reaper.ray_processes_under(psutil.Process(search.pid))
        agents = [p for p in ray if "Agent" in " ".join(p.cmdline())]
        assert agents, [p.name() for p in ray]
        os.kill(search.pid, signal.SIGKILL)             # the driver only, not its process group
        search.wait()
        # Without the reaper, Ray's agents stayed 50-80 s here (they wait on the dead GCS).
        left = [p for p in psutil.wait_procs(ray, timeout=20)[1]]
        assert not left, f"Ray processes outlived the killed search by 20 s: {[p.name() for p in left]}"
    finally:
        try:
            os.killpg(search.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
