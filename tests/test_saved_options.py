"""A search's settings are its own (tune/state/saved_options.py): saved once when it starts, read back by
--resume, and an option on the resume line that differs from the saved one refused naming both
values. Without Ray: a planted, signed search folder (as tests/test_driver_integrity.py plants); the
printed resume line run verbatim on a real search is tests/test_faults.py's Ctrl-C test."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from vidtune import atomic
from vidtune.flags import ConfigError
from vidtune.tune import search
from vidtune.tune.config.options import SPECS, given_options, parse_options
from vidtune.tune.state import saved_options, trust
from vidtune.tune.state.saved_options import CHANGEABLE, OPTIONS_FILE, RUN_ONLY

# A state key of each test's own (never the user's ~/.config/vidtune/state.key): conftest's own_key
pytestmark = pytest.mark.usefixtures("own_key")



def _started_search(storage: Path, data: Path, *extra: str, name: str = "s") -> Path:
    """A search folder as a search of `--data data --epochs 4 ...extra` leaves it: Tune's state
    (planted, signed) and vidtune's saved options beside it."""
    folder = storage / name
    state = folder / "ray"
    state.mkdir(parents=True)
    (state / "tuner.pkl").write_bytes(pickle.dumps({"ok": 1}))
    (state / "experiment_state-2026-01-01_00-00-00.json").write_text("{}")
    trust.sign(str(state))
    opts = parse_options(["--data", str(data), "--epochs", "4", "--num-samples", "2", "--batch-sizes", "4",
                          "--no-log-model", *extra])
    saved_options.save(opts, str(folder), demo=False)
    return folder


def test_the_options_are_saved_once_as_data_atomically(tmp_path, synthetic_root):
    folder = _started_search(tmp_path, synthetic_root)
    files = sorted(p.name for p in (folder / "ray").iterdir())
    assert OPTIONS_FILE in files and not [f for f in files if f.endswith(".tmp")]
    doc = json.loads((folder / "ray" / OPTIONS_FILE).read_text())
    values = doc["options"]
    assert values["train.data.root"] == str(synthetic_root) and values["train.epochs"] == 4
    assert values["space.batch_sizes"] == [4] and values["tracking.log_model"] is False
    assert not set(values) & RUN_ONLY
    assert saved_options.load(str(folder))["space.batch_sizes"] == (4,)     # back in the fields' types


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    target = tmp_path / OPTIONS_FILE
    target.write_bytes(b"old")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(OSError):
        atomic.write_atomically(target, b"new")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == [OPTIONS_FILE]


def test_a_resume_line_without_options_continues_with_the_saved_ones(tmp_path, synthetic_root, capsys,
                                                                     no_ray):
    """The printed resume line (--resume --name --storage [--mlflow-uri]) gives no --data: the
    resume used to fill it with the demo's data, 6 epochs and 4 trials; now the saved ones."""
    _started_search(tmp_path, synthetic_root)
    argv = ["--resume", "--name", "s", "--storage", str(tmp_path), "--mlflow-uri",
            f"sqlite:///{tmp_path}/other.db", "--dry-run"]
    assert search.main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    doc = json.loads(out.split("resolved configuration:\n", 1)[1].rsplit("\ndry run:", 1)[0])
    assert doc["demo"] is False and doc["train"]["data"]["root"] == str(synthetic_root)
    assert doc["train"]["epochs"] == 4 and doc["num_samples"] == 2 and doc["space"]["batch_sizes"] == [4]
    assert doc["tracking"]["log_model"] is False
    assert doc["tracking"]["mlflow_uri"] == f"sqlite:///{tmp_path}/other.db"    # may change on resume
    assert "demo:" not in out


@pytest.mark.parametrize("extra, flag, here, then", [
    (["--epochs", "6"], "--epochs", "6", "4"),
    (["--num-samples", "4"], "--num-samples", "4", "2"),
    (["--batch-sizes", "4,8"], "--batch-sizes", "4,8", "4"),
])
def test_an_option_that_differs_from_the_saved_one_is_refused_naming_both(tmp_path, synthetic_root, capsys,
                                                                         no_ray, extra, flag, here, then):
    _started_search(tmp_path, synthetic_root)
    argv = ["--resume", "--name", "s", "--storage", str(tmp_path), *extra]
    assert search.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"vidtune search: error: {flag}: {here} on this line, {then} when the search at "
                          f"{tmp_path / 's'} was started") and f"leave {flag} out" in err


def test_another_data_folder_is_refused_the_same_one_by_another_path_is_not(tmp_path, synthetic_root, capsys,
                                                                           no_ray, monkeypatch):
    _started_search(tmp_path, synthetic_root)
    other = tmp_path / "d40"
    other.mkdir()
    base = ["--resume", "--name", "s", "--storage", str(tmp_path), "--dry-run"]
    assert search.main([*base, "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"--data: {other} on this line, {synthetic_root} when the search" in err
    monkeypatch.chdir(synthetic_root.parent)
    assert search.main([*base, "--data", synthetic_root.name, "--epochs", "4"]) == 0   # the same, relative
    assert search.main([*base, "--no-log-model", "--batch-sizes", "4"]) == 0           # as saved


def test_a_bool_option_differing_is_named_as_given_or_not(tmp_path, synthetic_root):
    folder = _started_search(tmp_path, synthetic_root)
    opts = parse_options(["--resume", "--name", "s", "--data", str(synthetic_root)])
    with pytest.raises(ConfigError, match=r"^--no-early-stop: given on this line, not given when the search"):
        saved_options.resumed_options(opts, {"early_stop": False}, str(folder))


def test_a_search_without_saved_options_resumes_as_told_and_says_so(tmp_path, synthetic_root, capsys):
    folder = tmp_path / "old"
    folder.mkdir()
    opts = parse_options(["--resume", "--name", "old", "--data", str(synthetic_root), "--epochs", "3"])
    assert saved_options.resumed_options(opts, {}, str(folder)) is opts
    assert "started by an older vidtune" in capsys.readouterr().out


def test_an_unreadable_options_file_stops_the_resume_naming_it(tmp_path, synthetic_root):
    folder = _started_search(tmp_path, synthetic_root)
    (folder / "ray" / OPTIONS_FILE).write_text('{"format": 1, "options": {"train.nope": 1}}')
    with pytest.raises(ConfigError, match=rf"^--resume: {folder}/ray/{OPTIONS_FILE}, the options .* "
                       r"cannot be read .*unknown options \['train.nope'\]"):
        saved_options.load(str(folder))
    (folder / "ray" / OPTIONS_FILE).write_text('{"format": 1, "opt')
    with pytest.raises(ConfigError, match="JSONDecodeError"):
        saved_options.load(str(folder))


def test_a_demo_search_saves_no_data_folder(tmp_path):
    """The demo's folder is found (or made again) by the resume, as by the search."""
    opts = parse_options([])
    assert opts.demo
    saved_options.save(opts, str(tmp_path / "demo"), demo=True)
    assert saved_options.load(str(tmp_path / "demo"))["train.data.root"] is None


def test_the_options_a_resume_may_change_are_listed_in_the_docs():
    text = (Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md").read_text()
    section = text.split("### What a resume may change", 1)[1].split("\n#", 1)[0]
    flags = {s.path: s.flag for s in SPECS}
    for path in CHANGEABLE | (RUN_ONLY - {"resume"}):
        assert f"`{flags[path]}" in section, flags[path]


def test_given_options_are_the_flags_and_the_config_file_only(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("epochs = 3\n")
    assert given_options(["--resume", "--config", str(config), "--lr-min", "1e-4"]) == {
        "train.epochs": 3, "resume": True, "config": str(config), "space.lr_min": 1e-4}


# The printed resume line, run verbatim on a real search, is checked in tests/test_faults.py's Ctrl-C test
