"""A full disk that cuts Tune's experiment state short no longer makes a search unresumable
(tune/state/last_good.py): the state signer keeps a whole, signed copy of Tune's state files, and
--resume puts it back when the newest experiment state does not parse. Without Ray: a planted
experiment folder, as tests/test_driver_integrity.py plants one."""
from __future__ import annotations

import errno
import json
import pickle

import pytest

from vidtune import atomic
from vidtune.flags import ConfigError
from vidtune.tune import preflight
from vidtune.tune.state import last_good, trust

STATE = "experiment_state-2026-12-04_10-00-00.json"


# A state key of each test's own (never the user's ~/.config/vidtune/state.key): conftest's own_key
pytestmark = pytest.mark.usefixtures("own_key")


def _state(folder, trials: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tuner.pkl").write_bytes(pickle.dumps({"ok": 1}))
    (folder / STATE).write_text(json.dumps({"trial_data": ["t"] * trials, "pad": "x" * 20_000}))
    (folder / "search_gen_state-2026-12-04_10-00-00.json").write_text(json.dumps({"counter": trials}))


def _signer_pass(folder) -> None:
    signer = trust.StateSigner(str(folder), period_s=3600)
    signer.sign_changed()


def test_a_state_cut_short_is_resumed_from_its_last_whole_copy(tmp_path, capsys):
    search = tmp_path / "s"
    folder = search / "ray"
    _state(folder, trials=2)
    _signer_pass(folder)                                       # signed, and a copy kept
    good = (folder / STATE).read_bytes()
    assert (folder / last_good.GOOD_FOLDER / STATE).read_bytes() == good
    (folder / STATE).write_bytes(good[:8192])                  # what a full disk left (seen: 8,192 bytes)
    with pytest.raises(ValueError):
        json.loads((folder / STATE).read_bytes())
    preflight.check_resumable(str(search), trust_state=False)   # restored, signed: no error
    out = capsys.readouterr().out
    assert f"resume: {STATE} was cut short (a full disk?); continuing from the last whole copy" in out
    assert (folder / STATE).read_bytes() == good
    assert (folder / f"{STATE}.damaged").stat().st_size == 8192


def test_a_copy_not_tagged_with_the_users_key_is_never_put_back(tmp_path, capsys):
    """The copy is unpickled like the state itself: a planted or changed one is refused."""
    search = tmp_path / "s"
    folder = search / "ray"
    _state(folder, trials=2)
    _signer_pass(folder)
    manifest = folder / last_good.GOOD_FOLDER / last_good.MANIFEST
    doc = json.loads(manifest.read_text())
    (folder / last_good.GOOD_FOLDER / "tuner.pkl").write_bytes(pickle.dumps({"planted": 1}))
    doc["files"]["tuner.pkl"] = "0" * 64
    manifest.write_text(json.dumps(doc))
    (folder / STATE).write_bytes(b'{"trial_da')
    with pytest.raises(ConfigError, match=rf"--resume: the saved state of the search at {folder} cannot be "):
        preflight.check_resumable(str(search), trust_state=False)
    assert "continuing from the last whole copy" not in capsys.readouterr().out
    assert (folder / STATE).read_bytes() == b'{"trial_da'          # left as it was


def test_a_full_disk_while_copying_keeps_the_previous_copy(tmp_path, monkeypatch):
    folder = tmp_path / "s" / "ray"
    _state(folder, trials=1)
    _signer_pass(folder)
    first = (folder / last_good.GOOD_FOLDER / STATE).read_bytes()
    _state(folder, trials=3)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(OSError):
        last_good.keep(str(folder), trust.load_key())
    good = folder / last_good.GOOD_FOLDER
    assert (good / STATE).read_bytes() == first and not [p for p in good.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert last_good.keep(str(folder), trust.load_key())
    assert json.loads((good / STATE).read_text())["trial_data"] == ["t"] * 3
    assert not last_good.keep(str(folder), trust.load_key())      # unchanged: not copied again


def test_a_state_that_parses_is_left_alone(tmp_path):
    folder = tmp_path / "s" / "ray"
    _state(folder, trials=1)
    _signer_pass(folder)
    assert last_good.restore(str(folder), trust.load_key()) is None
    assert last_good.restore("s3://bucket/s/ray", trust.load_key()) is None
    assert last_good.has_copy(str(folder)) and not last_good.has_copy(str(tmp_path / "other"))
