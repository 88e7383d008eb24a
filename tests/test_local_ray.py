"""A local search starts a Ray of its own: never the machine's last `ray start` (someone else's,
or one long gone), whatever /tmp/ray/ray_current_cluster says; RAY_ADDRESS=local is local too
(and so gets the memory check a Ray started here needs)."""
from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray

from vidtune.trainer.ray_setup import launch, ray_start
from vidtune.trainer.ray_setup.ray_start import RayStart, RayStartError, start_local_ray
from vidtune.tune.outputs.search_log import LOG_FILE

REPO = Path(__file__).resolve().parents[1]
RAY_CLI = str(Path(sys.executable).parent / "ray")


@pytest.mark.parametrize("address, env, joins", [
    (None, None, False), (None, "", False), (None, "local", False), (None, " LOCAL ", False),
    ("local", "10.0.0.1:6379", False), (None, "10.0.0.1:6379", True), ("auto", None, True),
    ("ray://head:10001", "local", True),
])
def test_only_an_address_other_than_local_joins_a_cluster(monkeypatch, address, env, joins):
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    assert launch.joins_cluster(address) is joins


def test_a_local_ray_is_started_as_local_with_its_processes_told_its_address(monkeypatch):
    """ray.init gets address="local" (never the machine's last `ray start`); the processes it
    spawns get RAY_ADDRESS naming the new Ray's own GCS port; the driver's environment is as it
    was afterwards."""
    monkeypatch.setattr(ray_start, "address_space_limit", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(ray_start.GCS_PORT_ENV, raising=False)
    seen = []

    def init(**kw):
        seen.append((kw, os.environ.get("RAY_ADDRESS"), os.environ.get(ray_start.GCS_PORT_ENV)))

    start_local_ray(init, RayStart(), num_cpus=1)
    (kw, address, port), = seen
    assert kw["address"] == "local" and kw["num_cpus"] == 1
    assert port and address == f"127.0.0.1:{port}"
    assert "RAY_ADDRESS" not in os.environ and ray_start.GCS_PORT_ENV not in os.environ


def test_ray_address_local_gets_the_memory_check_of_a_ray_started_here(monkeypatch):
    """RAY_ADDRESS=local starts a Ray here, so a memory limit too small for it is refused with one
    line before ray.init (it used to count as joining a cluster and skip the check)."""
    monkeypatch.setenv("RAY_ADDRESS", "local")
    monkeypatch.setattr(ray_start, "address_space_limit", lambda: 3_000_000_000)
    monkeypatch.setattr(ray_start, "training_footprint_bytes", lambda: 5_200_000_000)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    called = []
    monkeypatch.setattr(ray, "init", lambda **kw: called.append(kw))
    with pytest.raises(RayStartError, match=r"limited to 3\.0 GB \(ulimit -v\)"):
        launch.init_ray(num_cpus=1)
    assert not called


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _foreign_env(temp_root: str) -> dict[str, str]:
    # Its own RAY_TMPDIR: the `ray start` below records itself there, not in the /tmp/ray other
    # Rays on this machine read. Token authentication off for that Ray only (no token written).
    env = {**os.environ, "RAY_TMPDIR": temp_root, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_local_search_beside_another_ray_runs_on_its_own(synthetic_root, tmp_path):
    """Another user's `ray start --head` runs on this machine (recorded as its latest cluster):
    a search without --address starts its own Ray, its trial trains there (the other Ray has no
    actor of it), and Train's own helpers find the right cluster. Then the other Ray is killed,
    its record left behind (stale): a local Ray still starts at once rather than waiting for a
    GCS that is gone. The other Ray runs in a process group of its own and is ended by killing
    that group (never `ray stop`, which stops every Ray on the machine)."""
    temp_root = tempfile.mkdtemp(prefix="vt-lr-", dir="/tmp")   # short: Ray's socket paths fit 107 bytes
    try:
        _search_and_stale_record(synthetic_root, tmp_path, temp_root)
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)


def _search_and_stale_record(synthetic_root: Path, tmp_path: Path, temp_root: str) -> None:
    port = _free_port()
    foreign = subprocess.Popen([RAY_CLI, "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
                                f"--dashboard-port={_free_port()}", "--disable-usage-stats"],
                               env=_foreign_env(temp_root), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    record = Path(temp_root) / "ray" / "ray_current_cluster"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = temp_root
    try:
        deadline = time.monotonic() + 90
        while not record.exists() and time.monotonic() < deadline and foreign.poll() is None:
            time.sleep(0.5)
        assert record.exists(), f"the other Ray did not start (exit {foreign.poll()})"
        time.sleep(2)
        out = subprocess.run([sys.executable, str(REPO / "tune" / "search.py"), "--data", str(synthetic_root),
                              "--num-samples", "1", "--epochs", "1", "--batch-sizes", "4",
                              "--loader-workers", "0", "--no-log-model", "--name", "own",
                              "--storage", str(tmp_path / "results"),
                              "--mlflow-uri", f"sqlite:///{tmp_path / 'mlruns.db'}"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        listed = subprocess.run([RAY_CLI, "list", "actors", "--address", f"127.0.0.1:{port}", "--format",
                                 "json", "--limit", "1000"], env=_foreign_env(temp_root), capture_output=True,
                                text=True, check=True, timeout=60).stdout
        actors = [] if listed.strip() == "No resource in the cluster" else json.loads(listed)
    finally:
        os.killpg(foreign.pid, signal.SIGKILL)
        foreign.wait(timeout=30)
    log = (tmp_path / "results" / "own" / LOG_FILE).read_text(errors="replace")
    assert "Connecting to existing Ray cluster" not in log + out.stdout + out.stderr
    assert "Started a local Ray instance" in log, log[-3000:]
    assert actors == [], actors                     # nothing of the search on the other Ray
    rows = list(csv.DictReader(open(tmp_path / "results" / "own" / "trials.csv")))
    assert [r["status"] for r in rows] == ["DONE"], rows

    # The record now names a Ray that is gone: a local Ray starts anyway, in seconds.
    assert record.exists()
    started = time.monotonic()
    probe = subprocess.run([sys.executable, "-c", (
        "import ray\nfrom vidtune.trainer.ray_setup.launch import init_ray\n"
        "init_ray(num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
        "print('own', ray.get_runtime_context().gcs_address)\nray.shutdown()\n")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    assert probe.returncode == 0, probe.stdout[-2000:] + probe.stderr[-2000:]
    own = probe.stdout.split("own ", 1)[1].split()[0]
    assert not own.endswith(f":{port}") and time.monotonic() - started < 60, (own, port)
