"""One driver per search: a lock file in the experiment folder, taken before Ray starts.

Two drivers on one search train the same trial into the same folders and delete checkpoints the
other still needs. The lock file (`LOCK_NAME`, JSON: host, PID, start time, heartbeat) is created
with O_CREAT|O_EXCL, atomic on a local disk and on NFS (v3 and later). A daemon thread rewrites
its heartbeat every `HEARTBEAT_S`. A lock is stale, and taken over with one line saying so, when
its driver ran on this host and that process is gone, or when its heartbeat is older than
`STALE_AFTER_S` (a driver on another host, which this one cannot ask).

Remote storage (s3://, gs://): Ray writes it through pyarrow.fs, which has no create-if-absent,
so no lock is taken there (one line says so; docs/troubleshooting.md, "One driver per search").
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vidtune.flags import ConfigError

LOCK_NAME = ".vidtune-driver.lock"
HEARTBEAT_S = 30.0     # how often the driver rewrites the heartbeat
STALE_AFTER_S = 300.0  # a lock from another host whose heartbeat is this old is taken over


@dataclass(frozen=True)
class Holder:
    """Who holds a search's lock, as read from its lock file."""

    host: str
    pid: int
    started: float              # epoch seconds
    heartbeat: float            # epoch seconds of the last heartbeat
    token: str                  # this lock's own id: a takeover or a restart makes a new one
    pid_start: str | None = None  # the process's start tick (/proc/PID/stat): tells a reused PID

    @property
    def since(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started))

    def describe(self) -> str:
        return f"driver PID {self.pid} on host {self.host}, running since {self.since}"

    def stale_reason(self, now: float | None = None) -> str | None:
        """Why this lock no longer stands for a live driver, or None while it may."""
        now = time.time() if now is None else now
        if self.host == socket.gethostname():
            if not _pid_alive(self.pid):
                return f"its driver (PID {self.pid} on this host) is gone"
            if self.pid_start is not None and _pid_start(self.pid) not in (None, self.pid_start):
                return (f"its driver (PID {self.pid} on this host) is gone; "
                        "the PID now belongs to another process")
            return None
        if now - self.heartbeat > STALE_AFTER_S:
            minutes = (now - self.heartbeat) / 60
            return f"its driver on {self.host} last wrote its heartbeat {minutes:.0f} minutes ago"
        return None


def lock_path(experiment_path: str) -> Path | None:
    """The lock file of a search, None on remote storage (no lock there)."""
    return None if "://" in experiment_path else Path(experiment_path) / LOCK_NAME


def running_message(experiment_path: str, holder: Holder) -> str:
    stop = "Ctrl-C in its terminal"
    elsewhere = "" if holder.host == socket.gethostname() else f" on {holder.host}"
    stop += f", or `kill {holder.pid}`{elsewhere}"
    return (f"the search at {experiment_path} is running: {holder.describe()}. Two drivers on one search "
            "overwrite each other's trials and checkpoints, so this one stops. Wait for it to end, or stop "
            f"it ({stop}) and then continue it with --resume")


def read_holder(path: Path) -> Holder | None:
    """The lock's holder, None when there is no lock file or it cannot be parsed (left empty by
    a driver killed while writing it: treated as stale)."""
    try:
        doc = json.loads(path.read_text())
        return Holder(host=str(doc["host"]), pid=int(doc["pid"]), started=float(doc["started"]),
                      heartbeat=float(doc.get("heartbeat", doc["started"])), token=str(doc["token"]),
                      pid_start=doc.get("pid_start"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return Holder(host="?", pid=0, started=0.0, heartbeat=0.0, token="unreadable")


def check_not_running(experiment_path: str, flag: str) -> None:
    """ConfigError naming `flag` when a live driver holds the search's lock (checked before
    anything is read or written, so a second driver stops in seconds)."""
    path = lock_path(experiment_path)
    holder = read_holder(path) if path is not None else None
    if holder is not None and holder.token != "unreadable" and holder.stale_reason() is None:
        raise ConfigError(flag, running_message(experiment_path, holder))


class SearchLock:
    """The lock of one search, held from `acquire` to `release` (a context manager too).
    `flag`: the flag a refusal names (--resume or --name)."""

    def __init__(self, experiment_path: str, *, flag: str = "--name"):
        self.experiment_path = experiment_path
        self.flag = flag
        self.path = lock_path(experiment_path)
        self.holder: Holder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SearchLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock (ConfigError naming `self.flag` when a live driver holds it), taking a
        stale one over with one line on stderr; start the heartbeat."""
        if self.path is None:
            print(f"note: no driver lock on remote storage ({self.experiment_path}): start one driver per "
                  "search there (docs/troubleshooting.md: One driver per search)", flush=True)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()
        mine = Holder(host=socket.gethostname(), pid=os.getpid(), started=now, heartbeat=now,
                      token=uuid.uuid4().hex, pid_start=_pid_start(os.getpid()))
        for _ in range(3):
            if self._create(mine):
                self.holder = mine
                self._start_heartbeat()
                return
            self._take_over_if_stale()
        raise ConfigError(self.flag, f"could not take the lock {self.path}: another driver keeps taking it")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still this driver's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.holder is not None and self.path is not None:
            current = read_holder(self.path)
            if current is not None and current.token == self.holder.token:
                self.path.unlink(missing_ok=True)
        self.holder = None

    def _create(self, holder: Holder) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(_dump(holder))
        return True

    def _take_over_if_stale(self) -> None:
        holder = read_holder(self.path)
        if holder is None:
            return   # released meanwhile: try again
        reason = "its lock file cannot be read" if holder.token == "unreadable" else holder.stale_reason()
        if reason is None:
            raise ConfigError(self.flag, running_message(self.experiment_path, holder))
        # Move the stale file aside, then check it is the one judged stale: a third driver may
        # have taken over in between, and its fresh lock must go back.
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return
        moved = read_holder(aside)
        if moved is not None and moved.token not in (holder.token, "unreadable"):
            try:
                os.link(aside, self.path)   # put it back, unless a lock is there again already
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            raise ConfigError(self.flag, running_message(self.experiment_path, moved))
        aside.unlink(missing_ok=True)
        print(f"taking over the lock of the search at {self.experiment_path}: {reason}", file=sys.stderr,
              flush=True)

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="vidtune-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            holder = self.holder
            if holder is None:
                return
            current = read_holder(self.path)
            if current is None or current.token != holder.token:
                print(f"warning: the lock of the search at {self.experiment_path} was taken by another "
                      f"driver ({current.describe() if current else 'removed'}); stop one of them",
                      file=sys.stderr, flush=True)
                return
            beat = Holder(**{**holder.__dict__, "heartbeat": time.time()})
            tmp = self.path.with_name(f"{LOCK_NAME}.{os.getpid()}.tmp")
            try:
                tmp.write_text(_dump(beat))
                os.replace(tmp, self.path)
            except OSError:   # a full disk: the next beat tries again; the lock file stays
                tmp.unlink(missing_ok=True)


def _dump(holder: Holder) -> str:
    return json.dumps(holder.__dict__, sort_keys=True) + "\n"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, another user's
        return True
    return True


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]
