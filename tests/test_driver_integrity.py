"""One driver per search (tune/state/lock.py) and trusted state only (tune/state/trust.py), without Ray:
a second driver stops before Ray starts, a stale lock is taken over, and a planted state file
is refused before anything unpickles it."""
from __future__ import annotations

import errno
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from vidtune.flags import ConfigError
from vidtune.tune import preflight, runner, search
from vidtune.tune.state import lock, trust
from vidtune.tune.state.lock import LOCK_NAME, SearchLock

# A state key of each test's own (never the user's ~/.config/vidtune/state.key): conftest's own_key
pytestmark = pytest.mark.usefixtures("own_key")



def _plant_lock(folder, *, pid, host=None, started=None, heartbeat=None):
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    doc = {"host": host or socket.gethostname(), "pid": pid, "started": started or now - 3600,
           "heartbeat": heartbeat or now, "token": "planted", "pid_start": None}
    (folder / LOCK_NAME).write_text(json.dumps(doc))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _plant_state(folder, payload=None):
    """A restorable-looking experiment: tuner.pkl (holding `payload`) and an experiment state."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tuner.pkl").write_bytes(pickle.dumps(payload if payload is not None else {"ok": 1}))
    (folder / "experiment_state-2026-01-01_00-00-00.json").write_text("{}")


def test_a_second_driver_stops_before_ray_naming_the_running_one(tmp_path, capsys, synthetic_root, no_ray):
    exp = tmp_path / "s"
    _plant_state(exp)
    trust.sign(str(exp))
    _plant_lock(exp, pid=os.getpid())     # this very process: alive
    t0 = time.monotonic()
    for extra in (["--resume"], []):      # with --resume, and the same command without it
        argv = ["--data", str(synthetic_root), "--storage", str(tmp_path), "--name", "s", *extra]
        assert search.main(argv) == 2
        err = capsys.readouterr().err
        running = f"the search at {exp} is running: driver PID {os.getpid()} on host {socket.gethostname()}"
        assert running in err
        assert f"kill {os.getpid()}" in err and "Ctrl-C" in err
        assert "already exists" not in err    # not told to --resume a search that is still running
    assert time.monotonic() - t0 < 30
    assert json.loads((exp / LOCK_NAME).read_text())["token"] == "planted"   # the first driver's lock stays


def test_a_stale_lock_is_taken_over_with_one_line_and_released(tmp_path, capsys):
    exp = tmp_path / "s"
    _plant_lock(exp, pid=_dead_pid())
    with SearchLock(str(exp)) as held:
        mine = json.loads((exp / LOCK_NAME).read_text())
        assert mine["pid"] == os.getpid() and mine["token"] == held.holder.token
        # while held, another driver is refused
        running = f"--resume: the search at {exp} is running: driver PID {os.getpid()}"
        with pytest.raises(ConfigError, match=running):
            SearchLock(str(exp), flag="--resume").acquire()
    err = capsys.readouterr().err
    assert err.count("taking over the lock") == 1 and "is gone" in err
    assert not (exp / LOCK_NAME).exists()


def test_another_hosts_lock_is_stale_only_when_its_heartbeat_is_old(tmp_path, capsys):
    exp = tmp_path / "s"
    _plant_lock(exp, pid=1, host="elsewhere", heartbeat=time.time() - 60)
    with pytest.raises(ConfigError, match="on host elsewhere.*`kill 1` on elsewhere"):
        SearchLock(str(exp)).acquire()
    _plant_lock(exp, pid=1, host="elsewhere", heartbeat=time.time() - lock.STALE_AFTER_S - 60)
    taken = SearchLock(str(exp))
    taken.acquire()
    assert "elsewhere last wrote its heartbeat" in capsys.readouterr().err
    taken.release()


def test_the_lock_is_released_when_the_search_raises(tmp_path, monkeypatch):
    plan = preflight.Plan(opts=search.parse_options(["--storage", str(tmp_path), "--name", "x"]), base=None,
                          storage=str(tmp_path), name="x", demo=True)

    def boom(plan):
        assert (tmp_path / "x" / LOCK_NAME).exists()
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_execute", boom)
    with pytest.raises(KeyboardInterrupt):
        runner.execute(plan)
    assert not (tmp_path / "x" / LOCK_NAME).exists()


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').close()",)


def test_a_planted_tuner_pkl_is_refused_and_its_payload_never_runs(tmp_path, capsys, synthetic_root, no_ray):
    marker = tmp_path / "marker"
    exp = tmp_path / "planted"
    _plant_state(exp, _Payload(str(marker)))
    args = ["--data", str(synthetic_root), "--storage", str(tmp_path), "--name", "planted", "--resume"]
    assert search.main(args) == 2
    err = capsys.readouterr().err
    assert f"--resume: {exp}/" in err and "has no tag of your state key" in err and "--trust-state" in err
    assert not marker.exists()
    assert not trust.key_path().exists()       # checking made no key
    # Tags of another key do not help: still refused
    trust.load_key()
    trust.sign(str(exp), key=b"k" * 32)
    assert search.main(args) == 2
    assert "does not match its tag" in capsys.readouterr().err and not marker.exists()
    # The payload was live: unpickling runs it.
    pickle.loads((exp / "tuner.pkl").read_bytes())
    assert marker.exists()


def test_signed_state_is_trusted_until_a_file_changes(tmp_path):
    exp = tmp_path / "s"
    _plant_state(exp)
    (exp / "t01").mkdir()
    (exp / "t01" / "error.pkl").write_bytes(pickle.dumps(ValueError("x")))
    signer = trust.StateSigner(str(exp), period_s=0.05).start()
    time.sleep(0.3)
    signer.stop()
    assert set(trust.read_tags(str(exp))) == {"tuner.pkl", "experiment_state-2026-01-01_00-00-00.json",
                                              "t01/error.pkl"}
    trust.verify(str(exp))
    assert oct(trust.key_path().stat().st_mode & 0o777) == "0o600"
    (exp / "t01" / "error.pkl").write_bytes(pickle.dumps(ValueError("y")))
    with pytest.raises(ConfigError, match=r"t01/error.pkl does not match its tag"):
        trust.verify(str(exp))


def test_state_saved_on_a_full_disk_is_signed_beside_the_key_and_trusted(tmp_path, monkeypatch):
    """The disk under the state fills up: its tags cannot be written next to it, so they go to
    the key's folder and the --resume the disk-full error asks for trusts the state as it is.
    Once the folder takes writes again the tags move back next to the state."""
    exp = tmp_path / "s"
    _plant_state(exp)
    trust.sign(str(exp))
    written = trust._write_tags

    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trust, "_write_tags", disk_full)
    (exp / "tuner.pkl").write_bytes(pickle.dumps({"saved": "after the disk filled"}))
    trust.StateSigner(str(exp), period_s=3600).start().stop()   # the last signing, as the search ends
    spare = trust.spare_tags_path(str(exp))
    assert spare.is_file() and spare.parent.parent == trust.key_path().parent
    assert not list(exp.glob(".vidtune-state.hmac.*.tmp"))  # no half-written temporary file left
    trust.verify(str(exp))                                  # the new tuner.pkl is trusted

    monkeypatch.setattr(trust, "_write_tags", written)      # space was freed
    trust.sign(str(exp))
    assert not spare.exists()
    trust.verify(str(exp))
    (exp / "tuner.pkl").write_bytes(pickle.dumps({"planted": True}))
    with pytest.raises(ConfigError, match=r"tuner.pkl does not match its tag"):
        trust.verify(str(exp))


def test_state_signed_in_tunes_staging_folder_is_trusted_before_and_after_its_copy(tmp_path):
    """Tune saves its state in a staging folder and copies it to the experiment folder in the
    background; a driver killed between the two must leave a state that --resume trusts, the
    old version and the new one alike (the signer signs the staged files at Tune's save)."""
    exp, staging = tmp_path / "s", tmp_path / "staging"
    _plant_state(exp)
    trust.sign(str(exp))
    name = "experiment_state-2026-01-01_00-00-00.json"
    staging.mkdir()
    (staging / name).write_text('{"newer": true}')
    trust.StateSigner(str(exp), period_s=3600).start()   # SignAfterSave signs through the running one
    try:
        trust.SignAfterSave().on_step_end(1, [SimpleNamespace(storage=SimpleNamespace(
            experiment_driver_staging_path=str(staging)))])
    finally:
        trust._running = None          # the thread is left to its 3600-s sleep (a daemon)
    trust.verify(str(exp))                                 # killed before the copy: the old version
    (exp / name).write_bytes((staging / name).read_bytes())
    trust.verify(str(exp))                                 # after the copy: the new one
    (exp / name).write_text('{"planted": true}')
    with pytest.raises(ConfigError, match="does not match its tag"):
        trust.verify(str(exp))


def test_the_heartbeat_is_rewritten_while_the_lock_is_held(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    held = SearchLock(str(tmp_path / "s"))
    held.acquire()
    try:
        first = json.loads((tmp_path / "s" / LOCK_NAME).read_text())
        time.sleep(0.3)
        later = json.loads((tmp_path / "s" / LOCK_NAME).read_text())
        assert later["heartbeat"] > first["heartbeat"] and later["token"] == first["token"]
    finally:
        held.release()
    assert not (tmp_path / "s" / LOCK_NAME).exists()
