"""Starting a local Ray on a machine short of memory: a sized object store, a bounded wait, one
line (exit 1) and no Ray process left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from vidtune.trainer.ray_setup import ray_start
from vidtune.trainer.ray_setup.ray_start import RayStart, RayStartError, object_store_bytes, start_local_ray


def test_the_object_store_is_sized_to_an_address_space_limit(monkeypatch):
    monkeypatch.setattr(ray_start, "address_space_limit", lambda: None)
    assert object_store_bytes(None) is None                       # no limit: Ray's own default
    assert object_store_bytes(2.5) == 2_500_000_000                # --object-store-gb wins
    monkeypatch.setattr(ray_start, "address_space_limit", lambda: 8_000_000_000)
    available = psutil.virtual_memory().available
    assert object_store_bytes(None) == int(min(available, 2_000_000_000) * 0.3)
    monkeypatch.setattr(ray_start, "address_space_limit", lambda: 100_000_000)
    assert object_store_bytes(None) == ray_start.MIN_OBJECT_STORE_BYTES   # never below Ray's minimum


def test_a_limit_too_small_for_a_training_process_is_refused_before_ray_starts(monkeypatch):
    monkeypatch.setattr(ray_start, "training_footprint_bytes", lambda: 5_200_000_000)
    monkeypatch.setattr(ray_start, "address_space_limit", lambda: None)
    ray_start.check_address_space(None)                          # no limit: nothing to check
    monkeypatch.setattr(ray_start, "address_space_limit", lambda: 8_000_000_000)
    ray_start.check_address_space(600_000_000)                   # 5.2 + 0.6 + 2 GB threads fit in 8
    started = []
    monkeypatch.setattr(ray_start, "address_space_limit", lambda: 6_000_000_000)
    with pytest.raises(RayStartError) as e:
        start_local_ray(lambda **kw: started.append(kw), RayStart(), num_cpus=2)
    assert not started                                           # ray.init never called
    message = str(e.value)
    assert "limited to 6.0 GB (ulimit -v)" in message and "needs about 7.7 GB" in message
    assert "5.2 GB of libraries, a 0.45 GB object store" in message
    assert "at least 8 GB (ulimit -v 7812500)" in message and "--object-store-gb" in message


def test_a_start_that_fails_is_one_error_naming_the_cause_and_the_flags(monkeypatch):
    monkeypatch.setattr(ray_start, "check_address_space", lambda store: None)
    killed = []
    monkeypatch.setattr(ray_start, "kill_started_ray", lambda: killed.append(True) or [])
    monkeypatch.setattr(ray_start, "address_space_limit", lambda: 8_000_000_000)
    asked = {}

    def failing_init(**kw):
        asked.update(kw)
        raise RuntimeError("Failed to start the raylet.\nraylet died: mmap of the object store failed")

    with pytest.raises(RayStartError) as e:
        start_local_ray(failing_init, RayStart(start_timeout_s=30), num_cpus=2)
    message = str(e.value)
    assert "RuntimeError: raylet died: mmap of the object store failed" in message
    assert "--object-store-gb" in message and "--ray-start-timeout-s (now 30 s)" in message
    assert "address space limited to 8.0 GB" in message and "\n" not in message
    assert asked["object_store_memory"] == object_store_bytes(None) and asked["num_cpus"] == 2
    assert killed == [True]


HANGING_START = textwrap.dedent("""
    import subprocess, sys, time
    from vidtune.trainer.ray_setup.ray_start import RayStart, start_local_ray

    def hanging_init(**kw):
        # stands in for a Ray whose raylet died: a process ('raylet' in its command), then silence
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "raylet"])
        print(child.pid, flush=True)
        time.sleep(60)

    start_local_ray(hanging_init, RayStart(start_timeout_s=2))
""")


def test_a_start_that_hangs_ends_the_command_with_one_line_and_no_ray_process(tmp_path):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HANGING_START], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 1 and time.monotonic() - started < 30
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vidtune: error: Ray could not start on this machine "
                                                   "(not up after 2 s;")
    child = int(proc.stdout.split()[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    try:
        os.kill(child, signal.SIGKILL)     # in case the test fails above: leave nothing running
    except ProcessLookupError:
        pass


@pytest.mark.slow   # starts (and fails to start) a real Ray: about 10 s, bounded at 120 s
def test_vidtune_train_whose_ray_cannot_start_says_so_and_leaves_no_ray(synthetic_root, tmp_path):
    """A Ray that cannot start (here: an object store larger than the machine, which Ray refuses
    at start): exit 1, the last line one error naming the cause, the memory seen and the flags,
    no Python traceback, and no Ray process left (Ray's temporary folder is this test's own, so
    its processes can be told from any other Ray on the machine)."""
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "ray")}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "vidtune.trainer.commands.train",
                           "--data", str(synthetic_root),
                           "--epochs", "1", "--object-store-gb", "100000",
                           "--storage", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith("vidtune train: error: Ray could not start on this machine (")
    assert "object store 100000.00 GB" in last
    assert "--object-store-gb" in last and "--ray-start-timeout-s (now 120 s)" in last
    time.sleep(2)
    left = [p.pid for p in psutil.process_iter(["cmdline"])
            if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"Ray processes left behind: {left}"


def test_a_library_that_cannot_load_is_one_line_naming_the_memory_limit(monkeypatch):
    monkeypatch.setattr(ray_start, "address_space_limit", lambda: 3 * 1024 ** 3)
    error = ImportError("libtorch_cpu.so: failed to map segment from shared object", name="_C",
                        path="/venv/lib/python3.11/site-packages/torch/_C.cpython-311-x86_64-linux-gnu.so")
    message = ray_start.import_failure_message(error)
    assert message.startswith("could not load torch (ImportError: libtorch_cpu.so: failed to map segment")
    assert "address space limited to 3.2 GB (ulimit -v)" in message and "raise ulimit -v" in message
    assert "\n" not in message


@pytest.mark.slow   # two real commands under prlimit: about 10 s, bounded at 2 x 120 s
@pytest.mark.parametrize("limit_gb, expected", [
    (6, "vidtune train: error: Ray could not start on this machine: the address space is limited to 6.0 GB "
        "(ulimit -v)"),
    (2.5, "vidtune train: error: could not load torch (ImportError: "),
])
def test_vidtune_train_under_a_memory_limit_is_one_line_and_leaves_no_ray(synthetic_root, tmp_path, limit_gb,
                                                                       expected):
    """`vidtune train` under a real address-space limit (prlimit --as): at 6 GB torch loads but a
    Ray process that trains would not fit, so Ray is not started; at 2.5 GB torch cannot load.
    Either way: exit 1, one line naming the limit and what to do, no traceback, no Ray process."""
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "ray")}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "vidtune.trainer.commands.train", "--data", str(synthetic_root),
               "--epochs", "1",
               "--storage", str(tmp_path / "runs")]
    proc = subprocess.run(["prlimit", f"--as={int(limit_gb * 1e9)}", *command], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-3000:]
    assert proc.stderr.startswith(expected) and "raise" in proc.stderr and "ulimit -v" in proc.stderr
    assert not (tmp_path / "ray").exists() or not any(
        str(tmp_path) in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
