"""docs/troubleshooting.md's table of what a search exposes, checked against `ss -ltnp` for a Ray
that vidtune starts (trainer.ray_setup.launch.init_ray) and a 2-worker Train run on it (gloo, as on CPUs):
every listening socket of that Ray's processes and of the run's workers is in the table with
where it listens, the process group's own (torch's store, gloo) on the node's address only, and
the Prometheus metrics ports the table says answer without the token do. That Ray starts with
the dashboard agent's fixed port held, as a second local search finds it, and says so in one line."""
from __future__ import annotations

import http.client
import json
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
# A Ray started as a search starts it, held until its stdin closes; prints "up" when up. Each line
# on its stdin, a folder, runs a 2-worker Train run as vidtune builds one (build_torch_trainer):
# each worker writes rank<N>.json there (its pid, MASTER_ADDR, MASTER_PORT) once the process
# group is up, and waits for a file "go" there; then it prints "trained".
HOLD = """
import json, os, sys, time
import torch.distributed as dist
import ray.train
from vidtune.trainer.cluster.build_trainer import build_torch_trainer
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.ray_setup.launch import init_ray

def waiting_loop(folder):
    def loop(config):
        dist.barrier()
        rank = ray.train.get_context().get_world_rank()
        record = {"pid": os.getpid(), "addr": os.environ["MASTER_ADDR"],
                  "port": int(os.environ["MASTER_PORT"])}
        with open(os.path.join(folder, f"rank{rank}.json.part"), "w") as f:
            json.dump(record, f)
        os.replace(os.path.join(folder, f"rank{rank}.json.part"), os.path.join(folder, f"rank{rank}.json"))
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(folder, "go")) and time.monotonic() < deadline:
            time.sleep(0.2)
        dist.barrier()
    return loop

init_ray(num_cpus=1, log_to_driver=False)
print("up", flush=True)
for line in sys.stdin:
    folder = line.strip()
    build_torch_trainer(TrainConfig(), num_workers=2, resources_per_worker={"CPU": 0.5},
                        storage_path=os.path.join(folder, "runs"), train_loop=waiting_loop(folder)).fit()
    print("trained", flush=True)
"""
AGENT_HTTP_PORT = 52365     # the dashboard agent's fixed port (Ray 2.60), held by the test
# Each kind of Ray process, as the table names it (in code font), by its command line
KINDS = (("dashboard/dashboard.py", "`dashboard.py`"), ("autoscaler/_private/monitor.py", "`monitor.py`"),
         ("ray::RayTrainWorker", "`ray::RayTrainWorker`"),
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


def hold_port(port: int) -> socket.socket | None:
    """A socket listening on every address at `port`, as another Ray's agent would hold it; None
    when something already does (the test session's own Ray)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
    except OSError:
        s.close()
        return None
    s.listen()
    return s


def read_until(stream, wanted: str) -> list[str]:
    """The lines of `stream` up to `wanted` (a whole line), which is not included."""
    lines = []
    for line in stream:
        if line.strip() == wanted:
            return lines
        lines.append(line.rstrip("\n"))
    raise AssertionError(f"no {wanted!r} line; got {lines}")


def ray_processes(holder_pid: int, temp: str) -> dict[int, str]:
    """pid -> command line of the holder, its descendants and every process naming its Ray folder."""
    procs = [psutil.Process(holder_pid), *psutil.Process(holder_pid).children(recursive=True)]
    procs += [p for p in psutil.process_iter(["cmdline"]) if temp in " ".join(p.info["cmdline"] or [])]
    cmdlines = {}
    for p in procs:
        try:
            cmdlines[p.pid] = " ".join(p.cmdline())
        except psutil.Error:
            continue
    return cmdlines


def assert_in_table(seen: dict[tuple[str, str], list[int]]) -> None:
    rows = table_rows()
    for (kind, scope), ports in sorted(seen.items()):
        assert any(kind in what and SCOPES[scope] in where for what, where in rows), \
            f"{kind} listens on {scope} ports {ports}; docs/troubleshooting.md's table does not say so"


def check_train_workers(holder: subprocess.Popen, folder: Path) -> None:
    """A 2-worker run's workers, while their process group is up: rank 0's store listens on the
    node's address (MASTER_ADDR) only, and every other socket of each worker does too, but for
    Ray's own one on `*`; the table says where each listens."""
    folder.mkdir()
    holder.stdin.write(f"{folder}\n")
    holder.stdin.flush()
    deadline = time.monotonic() + 150
    while len(list(folder.glob("rank*.json"))) < 2:
        assert holder.poll() is None and time.monotonic() < deadline, "the Train run's workers did not start"
        time.sleep(0.5)
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    try:
        found = listeners({r["pid"] for r in ranks})
    finally:
        (folder / "go").touch()
    node = ranks[0]["addr"]
    seen: dict[tuple[str, str], list[int]] = {}
    for address, port, _ in found:
        seen.setdefault(("`ray::RayTrainWorker`", scope_of(address)), []).append(port)
    assert_in_table(seen)
    store = [address for address, port, pid in found if port == ranks[0]["port"]]
    assert store == [f"{node}:{ranks[0]['port']}"], (store, found)       # not `*`: torch's default
    for rank in ranks:
        own = [(address, port) for address, port, pid in found if pid == rank["pid"]]
        elsewhere = [(a, port) for a, port in own if a.rsplit(":", 1)[0].strip("[]") != node]
        assert len(elsewhere) == 1 and scope_of(elsewhere[0][0]) == "all", (rank, own)   # Ray's gRPC port
        assert len(own) - 1 >= (2 if rank is ranks[0] else 1), (rank, own)             # gloo (and the store)
    assert read_until(holder.stdout, "trained") is not None


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list listening sockets")
def test_the_documented_listeners_are_those_of_a_ray_vidtune_starts_and_its_train_workers():
    temp = tempfile.mkdtemp(prefix="vt-ports-", dir="/tmp")   # its own Ray folder, in its processes' names
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": temp,
           # The dashboard's and the monitor's metrics ports are fixed (44227, 44217): with another
           # Ray on this machine (the test session's) holding them, this one's never came up and
           # the wait below ran its full 120 s. Ray's own settings move them to free ports.
           "DASHBOARD_METRIC_PORT": str(free_port()), "AUTOSCALER_METRIC_PORT": str(free_port())}
    held = hold_port(AGENT_HTTP_PORT)     # by this test, or already by another Ray on this machine
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env, start_new_session=True)
    try:
        # The agent's HTTP API cannot bind its fixed port: said in one line once Ray is up.
        before_up = read_until(holder.stdout, "up")
        notes = [ln for ln in before_up if ln.startswith("note: port")]
        assert len(notes) == 1, before_up
        assert f"{AGENT_HTTP_PORT} (the dashboard agent's HTTP API: job submission" in notes[0], notes[0]
        assert "--dashboard-agent-listen-port" in notes[0], notes[0]
        if held is not None:
            assert f"held by pid {os.getpid()}," in notes[0], notes[0]
        seen: dict[tuple[str, str], list[int]] = {}
        deadline = time.monotonic() + 120   # on a loaded 2-core machine they can take over a minute
        while time.monotonic() < deadline:   # the dashboard's and monitor's metrics come up last
            cmdlines = ray_processes(holder.pid, temp)
            seen = {}
            for address, port, pid in listeners(set(cmdlines)):
                kind = kind_of(cmdlines[pid], holder.pid, pid)
                seen.setdefault((kind, scope_of(address)), []).append(port)
            if all((name, "all") in seen for name in METRICS):
                break
            time.sleep(2)
        assert_in_table(seen)
        assert not any(AGENT_HTTP_PORT in ports for ports in seen.values()), seen    # as the note says
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
        check_train_workers(holder, Path(temp) / "pg")
    finally:
        if held is not None:
            held.close()
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
