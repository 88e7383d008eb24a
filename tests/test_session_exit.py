"""The test process ends with pytest's own exit status and output, without the interpreter's
teardown (tests/conftest.py `pytest_unconfigure`): a crash there once failed a green CI run."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.slow      # two pytest processes (~13 s): kept out of the 2-minute fast tier

# pytest run as `python -m pytest` is, plus an exit handler that prints if the interpreter's
# teardown runs (it must not: the conftest ends the process before it).
RUN_PYTEST = ("import atexit, sys, pytest; atexit.register(print, 'INTERPRETER TEARDOWN'); "
              "sys.exit(pytest.main(sys.argv[1:]))")


def run_pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN_PYTEST, "-p", "no:cacheprovider", "-q", *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_a_passing_run_exits_0_with_its_summary_and_no_teardown():
    out = run_pytest("tests/test_settings.py::test_a_cpu_worker_says_what_it_trains_with")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout                      # flushed before the process ended
    assert "INTERPRETER TEARDOWN" not in out.stdout


def test_a_run_that_is_not_green_keeps_its_exit_status():
    out = run_pytest("tests/test_settings.py", "-k", "no_test_has_this_name")
    assert out.returncode == 5, out.stdout + out.stderr  # pytest's "no tests ran"
    assert "deselected" in out.stdout
    assert "INTERPRETER TEARDOWN" not in out.stdout
