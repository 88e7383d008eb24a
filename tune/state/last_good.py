"""The last whole copy of Tune's saved state, for a --resume after a full disk cut the state short.

Tune rewrites its `experiment_state-*.json` in place: a disk that fills while it does leaves it
cut (8,192 bytes, seen), and the search could not be resumed at all. While a search runs, the
state signer (`tune.state.trust.StateSigner`, after each pass) calls `keep`: when the newest experiment
state parses, Tune's state files at the top of the experiment folder (`TUNE_STATE_FILES`: the
experiment, searcher and callback state saved together) are copied into `GOOD_FOLDER`, each
written whole (`vidtune.atomic`), the manifest last, with an HMAC under this user's state key:
a resume unpickles these files, so a copy is used only when that tag is the user's own. On
`--resume` (`tune.preflight.check_resumable`), `restore` puts the copy back when the newest
experiment state does not parse, moving the damaged file aside, and says so in one line.
Local storage only (on s3:// objects are written whole).
"""
from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
from pathlib import Path

from vidtune.atomic import write_atomically
from vidtune.tune.running.ray_internals import TUNE_STATE_FILES

GOOD_FOLDER = ".vidtune-last-good"
MANIFEST = "manifest.json"
EXPERIMENT_STATE = "experiment_state-*.json"


def _state_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*")
                  if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in TUNE_STATE_FILES))


def _parses(path: Path) -> bool:
    try:
        return _parses_bytes(path.read_bytes())
    except OSError:
        return False


def _newest_state(folder: Path) -> Path | None:
    states = sorted(folder.glob(EXPERIMENT_STATE))
    return states[-1] if states else None


def _tag(key: bytes, files: dict[str, str]) -> str:
    return hmac.new(key, json.dumps(files, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def _manifest(folder: Path) -> dict:
    try:
        doc = json.loads((folder / GOOD_FOLDER / MANIFEST).read_text())
        return doc if isinstance(doc, dict) and isinstance(doc.get("files"), dict) else {}
    except (OSError, ValueError):
        return {}


def keep(experiment_path: str, key: bytes) -> bool:
    """Copy Tune's state files into GOOD_FOLDER when the newest experiment state parses and they
    changed since the last copy; True when a copy was made. OSError (a full disk) leaves the last
    copy whole."""
    if "://" in experiment_path:
        return False
    folder = Path(experiment_path)
    newest = _newest_state(folder)
    if newest is None:
        return False
    data = {name: (folder / name).read_bytes() for name in _state_names(folder)}
    files = {name: hashlib.sha256(body).hexdigest() for name, body in data.items()}
    if not _parses_bytes(data.get(newest.name, b"")) or _manifest(folder).get("files") == files:
        return False
    good = folder / GOOD_FOLDER
    for name, body in data.items():
        write_atomically(good / name, body)
    write_atomically(good / MANIFEST, json.dumps({"files": files, "tag": _tag(key, files)}, indent=1))
    for stale in set(_state_names(good)) - set(files):
        (good / stale).unlink(missing_ok=True)
    return True


def _parses_bytes(body: bytes) -> bool:
    try:
        json.loads(body)
        return True
    except ValueError:
        return False


def restore(experiment_path: str, key: bytes | None) -> str | None:
    """When the newest experiment state of the local experiment does not parse and GOOD_FOLDER
    holds a whole copy tagged with `key`: put the copy back (the damaged file renamed
    `<name>.damaged`) and return the line that says so; else None (nothing to do, or nothing
    usable: the caller reports the damage as before)."""
    if "://" in experiment_path or key is None:
        return None
    folder = Path(experiment_path)
    newest = _newest_state(folder)
    if newest is None or _parses(newest):
        return None
    doc = _manifest(folder)
    files = doc.get("files") or {}
    if not files or not hmac.compare_digest(str(doc.get("tag", "")), _tag(key, files)):
        return None
    good = folder / GOOD_FOLDER
    try:
        data = {name: (good / name).read_bytes() for name in files}
    except OSError:
        return None
    if any(hashlib.sha256(body).hexdigest() != files[name] for name, body in data.items()):
        return None
    states = [n for n in files if fnmatch.fnmatch(n, EXPERIMENT_STATE)]
    if not states:
        return None
    newest.rename(newest.with_name(newest.name + ".damaged"))
    for name, body in data.items():
        write_atomically(folder / name, body)
    return (f"resume: {newest.name} was cut short (a full disk?); continuing from the last whole copy of the "
            f"search's state ({good}), the damaged file kept as {newest.name}.damaged; what Tune recorded "
            "after that copy (a trial's end, a new trial) may be done again")


def has_copy(experiment_path: str) -> bool:
    """Whether the local experiment folder holds a copy `restore` may use."""
    return "://" not in experiment_path and bool(_manifest(Path(experiment_path)).get("files"))


def restored_names(experiment_path: str) -> list[str]:
    """The state files a `restore` wrote (to be signed again)."""
    return sorted(_manifest(Path(experiment_path)).get("files") or {})
