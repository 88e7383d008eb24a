"""This project's `datasets` package must win over Hugging Face's `datasets`, installed in the same venv.

Each case runs a fresh interpreter the way users and Ray workers do, and checks which file
`datasets` was imported from.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SEARCH = REPO / "tune" / "search.py"
OURS = REPO / "datasets"
SHOW = "import sys, datasets, datasets.index; print('DATASETS=' + datasets.index.__file__)"


def run(args: list[str], cwd: Path, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def imported_from(proc: subprocess.CompletedProcess) -> Path:
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("DATASETS="))
    return Path(line.removeprefix("DATASETS="))


def test_hugging_face_datasets_is_installed_so_these_tests_mean_something(tmp_path):
    proc = run(["-c", "import importlib.util as u; print(u.find_spec('datasets').origin)"], cwd=tmp_path)
    origin = Path(proc.stdout.strip())
    assert proc.returncode == 0 and "site-packages" in origin.parts and origin.parent != OURS


def test_module_entry_point_from_the_repository_root():
    proc = run(["-m", "datasets.index", "--help"], cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "--positive-class" in proc.stdout and "--min-frames" in proc.stdout
    assert imported_from(run(["-c", SHOW], cwd=REPO)).parent == OURS


def test_ray_worker_route_cwd_elsewhere_with_the_repository_on_pythonpath(tmp_path):
    # How trainer.launch.init_ray ships the code: runtime_env PYTHONPATH=<repo root>, another cwd.
    assert imported_from(run(["-c", SHOW], cwd=tmp_path, pythonpath=str(REPO))).parent == OURS
    # The probe pool's spawned workers inherit that sys.path: they must import our module too.
    proc = run(["-c", "from datasets.index import run_pool; "
                      "print(run_pool(len, [('abc',)], timeout_s=60, workers=1))"],
               cwd=tmp_path, pythonpath=str(REPO))
    assert proc.returncode == 0 and "[('ok', 3)]" in proc.stdout, proc.stderr


@pytest.mark.skipif(not SEARCH.exists(), reason="tune/search.py is not written yet")
def test_search_script_by_path_from_another_cwd(tmp_path):
    proc = run([str(SEARCH), "--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # Run the script's top level as `python tune/search.py` would (its folder first on sys.path),
    # then see which `datasets` it left.
    code = (f"import runpy, sys; sys.path[0] = {str(SEARCH.parent)!r}; "
            f"sys.argv = [{str(SEARCH)!r}, '--help']\n"
            f"try:\n    runpy.run_path({str(SEARCH)!r}, run_name='__main__')\n"
            "except SystemExit:\n    pass\n" + SHOW)
    assert imported_from(run(["-c", code], cwd=tmp_path)).parent == OURS
