"""Trusted state only: `--resume` loads a search's saved state only if this user's key signed it.

Tune's restore unpickles the experiment's state (`tuner.pkl`, `experiment_state-*.json` with
pickled trials inside, the searcher's `searcher-state-*.pkl`, ...) and each trial's `error.pkl`:
a file someone else put there runs their code. Every such file gets an HMAC-SHA256 tag with a key
that only this user can read (`key_path()`, mode 0600), kept in `TAGS_NAME` next to the state
(or, while the state's disk is full, beside the key: `spare_tags_path`);
the driver re-signs the files Tune rewrites while the search runs (`StateSigner`, a daemon
thread: Tune has no hook after it saves its experiment state) and once more when it ends.
`verify` refuses, before anything is unpickled, a file whose tag is missing or wrong.

The file names are Tune's, kept in tune/running/ray_internals.py with its other uses of Ray internals
(its Ray version check guards against a new kind of state file going unchecked).
"""
from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import os
import secrets
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

import pyarrow.fs
from ray.tune import Callback
from ray.tune.experiment import Trial

from vidtune.flags import ConfigError
from vidtune.tune.running.ray_internals import (
    TUNE_STATE_FILES,
    TUNE_TRIAL_STATE_FILES,
    experiment_staging_path,
)
from vidtune.tune.state import last_good

TAGS_NAME = ".vidtune-state.hmac"
KEPT_TAGS = 4     # tags kept per file: its last versions (a copy to storage may lag the signing)
STATE_PATTERNS, TRIAL_STATE_PATTERNS = TUNE_STATE_FILES, TUNE_TRIAL_STATE_FILES


def key_path() -> Path:
    """`$XDG_CONFIG_HOME/vidtune/state.key`, else `~/.config/vidtune/state.key`."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "vidtune" / "state.key"


def load_key(create: bool = True) -> bytes:
    """This user's signing key (32 random bytes), made with mode 0600 on first use."""
    path = key_path()
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            pass   # made by another process meanwhile
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
    key = path.read_bytes()
    if len(key) < 16:
        raise ConfigError("--resume", f"{path} is not a signing key (cut short?); remove it and pass "
                          "--trust-state once to sign your searches with a new one")
    return key


def _fs(experiment_path: str) -> tuple[pyarrow.fs.FileSystem, str]:
    return pyarrow.fs.FileSystem.from_uri(experiment_path)


def state_files(experiment_path: str) -> list[str]:
    """The state files Tune's restore unpickles, relative to the experiment folder."""
    fs, root = _fs(experiment_path)
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(root, allow_not_found=True, recursive=False))
    except OSError:
        return []
    found = []
    for info in infos:
        name = Path(info.path).name
        if info.type == pyarrow.fs.FileType.File and any(fnmatch.fnmatch(name, p) for p in STATE_PATTERNS):
            found.append(name)
        elif info.type == pyarrow.fs.FileType.Directory and name != "train_runs":
            inner = [f"{info.path}/{p}" for p in TRIAL_STATE_PATTERNS]
            found += [f"{name}/{Path(i.path).name}" for i in fs.get_file_info(inner)
                      if i.type == pyarrow.fs.FileType.File]
    return sorted(found)


def _tag(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def _read(fs, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.readall()


def spare_tags_path(experiment_path: str) -> Path:
    """Where the tags go when they cannot be written next to the state (its disk is full): the
    key's folder, one file per experiment path. Only this user can write there, like the key."""
    where = experiment_path if "://" in experiment_path else os.path.abspath(experiment_path)
    digest = hashlib.sha256(where.rstrip("/").encode()).hexdigest()[:24]
    return key_path().parent / "tags" / f"{digest}.json"


def _parse_tags(data: bytes) -> dict[str, list[str]]:
    try:
        doc = json.loads(data)
    except ValueError:
        return {}
    if not isinstance(doc, dict):
        return {}
    return {str(k): [str(t) for t in (v if isinstance(v, list) else [v])] for k, v in doc.items()}


def read_tags(experiment_path: str) -> dict[str, list[str]]:
    """{file: its accepted tags, newest last}: the last KEPT_TAGS versions this user's driver
    signed (a file Tune saved is signed as it is saved, while its copy in the experiment folder
    may still hold the version before), from the tags file next to the state and the spare one
    (`spare_tags_path`) a full disk left."""
    fs, root = _fs(experiment_path)
    tags: dict[str, list[str]] = {}
    for read in (lambda: _read(fs, f"{root}/{TAGS_NAME}"), spare_tags_path(experiment_path).read_bytes):
        try:
            found = _parse_tags(read())
        except OSError:
            continue
        for name, more in found.items():
            tags[name] = [t for t in tags.get(name, []) if t not in more] + more
    return tags


def sign(experiment_path: str, names: Iterable[str] | None = None, key: bytes | None = None,
         source: str | None = None) -> dict[str, list[str]]:
    """Tag `names` (default: every state file) and write the tags file; returns all tags.
    `source`: read the files there instead (Tune's driver staging folder, which it copies to
    the experiment folder in the background: signed before the copy lands, a hard kill between
    the two leaves nothing unsigned)."""
    fs, root = _fs(experiment_path)
    src_fs, src_root = _fs(source) if source else (fs, root)
    key = load_key() if key is None else key
    tags = read_tags(experiment_path)
    for name in state_files(source or experiment_path) if names is None else names:
        try:
            tag = _tag(key, _read(src_fs, f"{src_root}/{name}"))
        except OSError:   # removed meanwhile (Tune deletes older state files)
            continue
        history = [t for t in tags.get(name, []) if t != tag]
        tags[name] = (history + [tag])[-KEPT_TAGS:]
    present = set(state_files(experiment_path)) | (set(state_files(source)) if source else set())
    tags = {k: v for k, v in tags.items() if k in present}
    data = (json.dumps(tags, indent=1, sort_keys=True) + "\n").encode()
    spare = spare_tags_path(experiment_path)
    try:
        _write_tags(fs, root, experiment_path, data)
    except OSError:
        # A full disk under the state: keep the tags in the key's folder, so that the --resume the
        # disk-full error asks for trusts the state without --trust-state.
        _write_atomically(spare, data)
    else:
        spare.unlink(missing_ok=True)      # its tags are in the file next to the state now
    return tags


def _write_tags(fs: pyarrow.fs.FileSystem, root: str, experiment_path: str, data: bytes) -> None:
    if "://" in experiment_path:
        with fs.open_output_stream(f"{root}/{TAGS_NAME}") as f:
            f.write(data)
    else:
        _write_atomically(Path(root) / TAGS_NAME, data)


def _write_atomically(path: Path, data: bytes) -> None:
    """Through a temporary file and a rename: a driver killed mid-write must not leave every tag
    unreadable. The temporary file is removed when the write fails (a full disk)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def verify(experiment_path: str) -> None:
    """ConfigError (--resume) naming the first state file without a valid tag of this user's key."""
    fs, root = _fs(experiment_path)
    key = load_key() if key_path().exists() else None   # no key yet: nothing of this user's is signed
    tags = read_tags(experiment_path) if key is not None else {}
    for name in state_files(experiment_path):
        expected = tags.get(name)
        actual = _tag(key, _read(fs, f"{root}/{name}")) if expected else ""
        ok = bool(expected) and any(hmac.compare_digest(t, actual) for t in expected)
        if not ok:
            why = "has no tag" if expected is None else "does not match its tag (changed since it was saved)"
            raise ConfigError("--resume", untrusted_message(f"{experiment_path.rstrip('/')}/{name}", why))


def untrusted_message(file: str, why: str) -> str:
    return (f"{file} {why} of your state key ({key_path()}), so it was not written by a search of yours, "
            "or was changed since. Resuming unpickles it, which runs any code inside, so nothing was loaded. "
            "If you made this search yourself (with a vidtune older than these tags, on another machine, or "
            "copied it), pass --trust-state to resume it anyway; it is signed with your key from then on")


class StateSigner:
    """Re-signs the state files Tune rewrites, every `period_s`, from a daemon thread of the
    driver; `stop()` signs a last time. A file changed between a save and the next pass is
    refused on a resume after a hard kill: --trust-state then (docs/troubleshooting.md, "Only state
    you wrote")."""

    def __init__(self, experiment_path: str, period_s: float | None = None):
        self.experiment_path = experiment_path
        self.period_s = period_s if period_s is not None else (10.0 if "://" in experiment_path else 1.0)
        try:
            self._key: bytes | None = load_key()
        except OSError as e:   # a read-only home: the search runs, a later --resume asks for --trust-state
            print(f"note: cannot make the state key {key_path()} ({e.strerror or e}); this search's state is "
                  "not signed", file=sys.stderr, flush=True)
            self._key = None
        self._seen: dict[str, tuple[int, int]] = {}
        self._staged: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()    # the thread and Tune's loop both rewrite the tags file
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vidtune-state-signer", daemon=True)

    def start(self) -> StateSigner:
        global _running
        if self._key is not None:
            self._thread.start()
            _running = self
        return self

    def stop(self) -> None:
        """Sign what Tune saved last (after `Tuner.fit` returns)."""
        global _running
        if self._key is None:
            return
        _running = None
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self.sign_changed()
        except OSError as e:   # the tags could be written neither next to the state nor by the key
            print(f"note: the search's state at {self.experiment_path} could not be signed "
                  f"({e.strerror or e}); a --resume will name the file and ask for --trust-state",
                  file=sys.stderr, flush=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sign_changed()
            except Exception:   # a full disk or a storage hiccup: the next pass tries again
                pass

    def sign_staged(self, staging: str | None) -> None:
        """Sign what Tune has just saved in its driver staging folder (`staging`, local), before
        its background copy reaches the experiment folder; called from Tune's loop right after
        it saves (`callback()`). Only when a file there changed (a stat per file)."""
        if self._key is None or not staging:
            return
        names = state_files(staging)
        stamps = {}
        for name in names:
            try:
                st = os.stat(Path(staging) / name)
            except OSError:
                continue
            stamps[name] = (st.st_mtime_ns, st.st_size)
        if stamps == self._staged:
            return
        with self._lock:
            sign(self.experiment_path, key=self._key, source=staging)
        self._staged = stamps


    def sign_changed(self) -> None:
        with self._lock:
            self._sign_changed()

    def _sign_changed(self) -> None:
        fs, root = _fs(self.experiment_path)
        names = state_files(self.experiment_path)
        stamps = {}
        for name, info in zip(names, fs.get_file_info([f"{root}/{n}" for n in names]), strict=True):
            if info.type == pyarrow.fs.FileType.File:
                stamps[name] = (info.mtime_ns or 0, info.size or 0)
        changed = [n for n, s in stamps.items() if self._seen.get(n) != s]
        if changed or set(self._seen) - set(stamps):
            sign(self.experiment_path, changed, key=self._key)
            last_good.keep(self.experiment_path, self._key)   # a whole copy to resume from (full disk)
        self._seen = stamps


class SignAfterSave(Callback):
    """Tune callback: Tune saves its experiment state in its loop just before the callbacks'
    `on_step_end`; this signs it there (`StateSigner.sign_staged` of the search's running
    signer). It holds no state, so it pickles with Tune's own state and works on a resume."""

    def on_step_end(self, iteration: int, trials: list[Trial], **info: object) -> None:
        signer = _running
        if signer is None:
            return
        try:
            signer.sign_staged(experiment_staging_path(trials))
        except Exception:   # a storage hiccup: the signer's thread signs the experiment folder
            pass


_running: StateSigner | None = None    # the driver's signer while its search runs (SignAfterSave)
