"""Ctrl-C before a search's first trial: while the dataset is indexed, while Ray starts, while the
clip cache is filled. Each stops the search at once with one line saying what was kept and what to
run (exit 130), no traceback, no Ray process left behind, and no half-made search folder that
would make the same command refuse its --name ("already exists") while --resume finds nothing.

A real `vidtune search` subprocess in its own process group, sent SIGINT as a terminal's Ctrl-C
is (the whole group), when its console or its child processes show the phase. Slow and bounded.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from vidtune.trainer.ray_setup.ray_reaper import is_ray_process

REPO = Path(__file__).resolve().parents[1]
SEARCH = [sys.executable, str(REPO / "tune" / "search.py")]
SMALL = ["--num-samples", "1", "--epochs", "1", "--batch-sizes", "4", "--loader-workers", "0",
         "--no-log-model"]
MARK = "VIDTUNE_TEST_INTERRUPT_MARK"    # in the environment of every process the search starts


def _interrupt(args: list[str], cwd: Path, when: Callable[[str, psutil.Process], bool],
               delay_s: float = 0.0, deadline_s: float = 120.0) -> tuple[int, str, str]:
    """Run the search with `args`; SIGINT its process group `delay_s` after `when(console so far,
    the search's process)` first holds. Returns (exit code, console, the mark its processes carry)."""
    mark = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {MARK: mark}
    proc = subprocess.Popen(SEARCH + args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)   # type: ignore[arg-type]
    reader.start()
    me, start = psutil.Process(proc.pid), time.monotonic()
    try:
        while not when("".join(lines), me):
            assert proc.poll() is None, f"ended ({proc.returncode}) first:\n{''.join(lines)[-3000:]}"
            assert time.monotonic() - start < deadline_s, f"phase not reached:\n{''.join(lines)[-3000:]}"
            time.sleep(0.05)
        time.sleep(delay_s)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    return code, "".join(lines), mark


def _spawned_children(search: psutil.Process) -> bool:
    """The search's probe pool (indexing) or clip cache fill pool is up: its spawned workers (not
    multiprocessing's resource tracker, which outlives the index's pool)."""
    try:
        return any("multiprocessing.spawn" in " ".join(c.cmdline()) for c in search.children(recursive=True))
    except psutil.Error:
        return False


def _left_behind(mark: str, wait_s: float = 15.0) -> list[str]:
    """Ray processes started by the search (they carry its mark) still running after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for p in psutil.process_iter():
            try:
                if p.environ().get(MARK) == mark and is_ray_process(p) and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            except psutil.Error:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _said_once(out: str, says: str) -> None:
    assert "Traceback" not in out, out[-3000:]
    assert out.count("vidtune search: interrupted") == 1 and says in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ctrl_c_while_indexing_stops_before_anything_is_written(synthetic_root, tmp_path):
    """The probe workers are up (a fresh index cache): exit 130, one line, nothing written, and
    the probe workers print no traceback of their own."""
    storage = tmp_path / "results"
    args = ["--data", str(synthetic_root), "--index-cache-dir", str(tmp_path / "index"), *SMALL,
            "--storage", str(storage), "--name", "s", "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"]
    code, out, _ = _interrupt(args, tmp_path, lambda _, search: _spawned_children(search))
    assert code == 130, out[-3000:]
    _said_once(out, "interrupted before the search started; nothing was written: run the same command again")
    assert not (storage / "s").exists()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ctrl_c_while_the_clip_cache_fills_leaves_no_folder_in_the_way(shared_ray, synthetic_root, tmp_path):
    """Joined to the session's Ray, a fresh clip cache: SIGINT once the fill's workers are up (after
    the log line, so not the index's). The search folder it had made (its log, its saved options)
    is gone, so the same command starts it again."""
    storage = tmp_path / "results"
    args = ["--data", str(synthetic_root), *SMALL, "--cache-dir", str(tmp_path / "clips"),
            "--address", shared_ray, "--storage", str(storage), "--name", "s",
            "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"]
    code, out, _ = _interrupt(args, tmp_path,
                              lambda console, search: "logs: " in console and _spawned_children(search))
    assert code == 130, out[-3000:]
    assert "Clip cache" in out and "wrote" not in out, out[-3000:]      # inside the fill, not after it
    _said_once(out, "interrupted before the search's first trial; nothing was kept")
    assert not (storage / "s").exists(), sorted(p.name for p in (storage / "s").rglob("*"))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ctrl_c_while_ray_starts_leaves_no_ray_process(synthetic_root, tmp_path):
    """A Ray of the search's own, interrupted while it starts (just after the log line that comes
    before it): no Ray process of it is left, and the folder is gone."""
    storage = tmp_path / "results"
    args = ["--data", str(synthetic_root), *SMALL, "--cache-dir", str(tmp_path / "clips"),
            "--storage", str(storage), "--name", "s", "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"]
    code, out, mark = _interrupt(args, tmp_path, lambda console, _: "logs: " in console, delay_s=1.5)
    assert code == 130, out[-3000:]
    assert "Clip cache" not in out, out[-3000:]        # Ray's start, not later
    _said_once(out, "interrupted before the search's first trial; nothing was kept")
    assert not (storage / "s").exists()
    assert not _left_behind(mark)


# -- the signal handler's phases, in this process (no search) ----------------------------------

@pytest.fixture
def tune_listening():
    """`faults.install()` as before `Tuner.fit()`, then a stand-in for Tune's SIGUSR1 handler
    (its graceful stop) once Tune listens; what it received, in a list. Handlers put back after."""
    from vidtune.tune.running import faults

    asked: list[int] = []
    faults.install()
    try:
        yield faults, lambda: signal.signal(signal.SIGUSR1, lambda signum, _: asked.append(signum)), asked
    finally:
        faults.uninstall()


def test_ctrl_c_in_tunes_setup_is_one_before_the_first_trial(tune_listening):
    faults, _, _ = tune_listening
    with pytest.raises(KeyboardInterrupt):     # Tune not listening yet: no graceful stop to ask for
        faults._on_signal(signal.SIGINT, None)
    assert not faults.STATE.tuner_started and not faults.STATE.interrupted
    with pytest.raises(KeyboardInterrupt):     # and no summary of a Tuner that never ran
        faults.tune_ended()


def test_a_trial_tune_adds_while_it_stops_is_unfinished(tune_listening):
    faults, listen, asked = tune_listening
    listen()
    done = type("T", (), {"trial_id": "a", "status": "TERMINATED"})()
    faults.InterruptWatch().on_step_begin(0, [done])
    faults._on_signal(signal.SIGINT, None)
    assert asked == [signal.SIGUSR1]
    assert not faults.trial_unfinished("a") and faults.trial_unfinished("b")


def test_ctrl_c_after_the_last_trial_finishes_the_summary_then_exits_130(tune_listening, capsys):
    faults, listen, asked = tune_listening
    listen()
    faults.InterruptWatch().on_step_begin(0, [])
    faults.tune_ended()
    faults._on_signal(signal.SIGINT, None)     # remembered; the summary goes on
    assert not asked and not faults.STATE.interrupted and faults.late_exit_code(0) == 130
    assert "finishing the summary" in capsys.readouterr().out
    with pytest.raises(KeyboardInterrupt):     # a second one stops at once
        faults._on_signal(signal.SIGINT, None)


def test_before_trials_frees_a_new_searchs_name_and_keeps_a_resumed_one(tmp_path):
    from vidtune.tune.running import faults

    new, resumed = tmp_path / "new", tmp_path / "resumed"
    for folder in (new, resumed):
        (folder / "ray").mkdir(parents=True)
    assert "run the same command again" in str(faults.before_trials(str(new), resume=False))
    assert "--resume" in str(faults.before_trials(str(resumed), resume=True))
    assert not new.exists() and (resumed / "ray").is_dir()
