"""docs/troubleshooting.md's table of what a search exposes, checked against `ss -ltnp` for a Ray
that vidtune starts (trainer.cluster.launch.init_ray): every listening socket of that Ray's processes is
in the table with where it listens, and the Prometheus metrics ports the table says answer
without the token do."""
from __future__ import annotations

import http.client
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"
# A Ray started as a search starts it, held until its stdin closes; prints its pid when up.
HOLD = ("import sys\nfrom vidtune.trainer.cluster.launch import init_ray\n"
        "init_ray(num_cpus=1, log_to_driver=False)\nprint('up', flush=True)\nsys.stdin.read()\n")
# Each kind of Ray process, as the table names it (in code font), by its command line
KINDS = (("dashboard/dashboard.py", "`dashboard.py`"), ("autoscaler/_private/monitor.py", "`monitor.py`"),
         ("ray::DashboardAgent", "`ray::DashboardAgent`"), ("ray::RuntimeEnvAgent", "`ray::RuntimeEnvAgent`"),
         ("gcs_server", "`gcs_server`"), ("raylet", "`raylet`"), ("ray::", "`ray::IDLE`"))
METRICS = ("`dashboard.py`", "`monitor.py`", "`ray::DashboardAgent`")
SCOPES = {"loopback": "127.0.0.1", "all": "0.0.0.0", "node": "the machine's address"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def table_rows() -> list[tuple[str, str]]:
    section = DOC.read_text().split("## What a search exposes", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return [(what.strip(), where.strip()) for what, where in rows[1:]]


def kind_of(cmdline: str, driver: int, pid: int) -> str:
    if pid == driver:
        return "the driver"
    return next((name for marker, name in KINDS if marker in cmdline), cmdline[:80])


def scope_of(address: str) -> str:
    host = address.rsplit(":", 1)[0].strip("[]")
    return "loopback" if host in ("127.0.0.1", "::1") else "all" if host in ("*", "0.0.0.0", "::") else "node"


def listeners(pids: set[int]) -> list[tuple[str, int, int]]:
    """(local address, port, pid) of every listening TCP socket of `pids`, from `ss -ltnpH`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)} & pids
        if len(fields) >= 4 and owners:
            found.append((fields[3], int(fields[3].rsplit(":", 1)[1]), min(owners)))
    return found


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list listening sockets")
def test_the_documented_listeners_are_those_of_a_ray_vidtune_starts():
    temp = tempfile.mkdtemp(prefix="vt-ports-", dir="/tmp")   # its own Ray folder, in its processes' names
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": temp,
           # The dashboard's and the monitor's metrics ports are fixed (44227, 44217): with another
           # Ray on this machine (the test session's) holding them, this one's never came up and
           # the wait below ran its full 120 s. Ray's own settings move them to free ports.
           "DASHBOARD_METRIC_PORT": str(free_port()), "AUTOSCALER_METRIC_PORT": str(free_port())}
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        seen: dict[tuple[str, str], list[int]] = {}
        deadline = time.monotonic() + 120   # on a loaded 2-core machine they can take over a minute
        while time.monotonic() < deadline:   # the dashboard's and monitor's metrics come up last
            procs = [psutil.Process(holder.pid), *psutil.Process(holder.pid).children(recursive=True)]
            procs += [p for p in psutil.process_iter(["cmdline"])
                      if temp in " ".join(p.info["cmdline"] or [])]
            cmdlines = {}
            for p in procs:
                try:
                    cmdlines[p.pid] = " ".join(p.cmdline())
                except psutil.Error:
                    continue
            seen = {}
            for address, port, pid in listeners(set(cmdlines)):
                kind = kind_of(cmdlines[pid], holder.pid, pid)
                seen.setdefault((kind, scope_of(address)), []).append(port)
            if all((name, "all") in seen for name in METRICS):
                break
            time.sleep(2)
        rows = table_rows()
        for (kind, scope), ports in sorted(seen.items()):
            assert any(kind in what and SCOPES[scope] in where for what, where in rows), \
                f"{kind} listens on {scope} ports {ports}; docs/troubleshooting.md's table does not say so"
        # The three metrics ports are up (on ports of their own, free: they came up within
        # seconds) and each answers without the token, as the table says.
        assert all((name, "all") in seen for name in METRICS), sorted(seen)
        for name in METRICS:
            answers = []
            for port in seen[(name, "all")]:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                        answers.append(r.status)
                except (OSError, http.client.HTTPException) as e:    # a gRPC port beside it
                    answers.append(type(e).__name__)
            assert 200 in answers, (name, seen[(name, "all")], answers)
    finally:
        holder.stdin.close()
        try:
            holder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(holder.pid, signal.SIGKILL)
        left = [p for p in psutil.process_iter(["cmdline"]) if temp in " ".join(p.info["cmdline"] or [])]
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(temp, ignore_errors=True)
