"""One import name per module: from the installed environment only `vidtune` imports.

The editable install's `.pth` line is `src/`, a folder that holds only a link to `vidtune/`
(setuptools' src layout), not the clone's root: outside the clone `import trainer`, `import tune`
and `import bench` fail, so no module loads twice under two names (two `TrainConfig` classes).
Each case runs this environment's python in a fresh process, without PYTHONPATH, from a
temporary folder or from the clone's root, as a user does.
"""
from __future__ import annotations

import os
import pkgutil
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SITE = Path(sysconfig.get_paths()["purelib"])


def run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_editable_install_puts_on_sys_path_only_a_folder_holding_vidtune():
    pth = list(SITE.glob("__editable__*vidtune*.pth"))
    assert len(pth) == 1, f"{pth}: run `make install`"
    lines = pth[0].read_text().splitlines()
    folders = [Path(line) for line in lines if line and not line.startswith("import")]
    assert folders == [REPO_ROOT / "src"], folders
    assert {m.name for m in pkgutil.iter_modules([str(folders[0])])} == {"vidtune"}
    assert (REPO_ROOT / "src" / "vidtune").resolve() == REPO_ROOT / "vidtune"


@pytest.mark.parametrize("name", ["trainer", "trainer.training.loop", "tune", "tune.search", "bench",
                                  "vidtune.bench"])
def test_outside_the_clone_only_vidtune_imports(tmp_path, name):
    proc = run([sys.executable, "-c", f"import {name}"], cwd=tmp_path)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, (name, proc.stdout, proc.stderr)


def test_outside_the_clone_each_module_has_one_name_and_one_class(tmp_path):
    code = ("import sys, vidtune.trainer.training.config as c, vidtune.trainer.training.loop\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('trainer', 'tune', 'bench')]\n"
            "print(c.TrainConfig.__module__)")
    proc = run([sys.executable, "-c", code], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "vidtune.trainer.training.config", proc.stderr


def test_tune_search_by_path_still_runs_from_anywhere(tmp_path):
    # it re-execs itself as `python -m vidtune.tune.search`
    for cwd in (tmp_path, REPO_ROOT):
        proc = run([sys.executable, str(REPO_ROOT / "tune" / "search.py"), "--help"], cwd=cwd)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (cwd, proc.stderr)


def test_a_bench_script_runs_from_the_clones_root():
    proc = run([sys.executable, "-m", "bench.cpu_noise", "--help"], cwd=REPO_ROOT)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr


def test_the_tests_import_bench_from_the_root():
    # pytest's `pythonpath = ["."]` (pyproject.toml): the clone's root, for bench only
    import bench.common
    import vidtune
    assert Path(bench.common.__file__).resolve().parent == REPO_ROOT / "bench"
    assert Path(vidtune.__file__).resolve().parent == REPO_ROOT / "vidtune"


@pytest.mark.slow   # basedpyright starts Node.js: a few seconds
@pytest.mark.skipif(shutil.which("basedpyright", path=str(Path(sys.executable).parent)) is None,
                    reason="basedpyright not installed (the `test` extra)")
def test_a_static_tool_resolves_vidtune_through_the_venv_and_nothing_else(tmp_path):
    """From a folder outside the clone, pyright finds `vidtune.*` through the `.pth` folder and
    its link (no import hook), and reports a bare `trainer` as missing."""
    (tmp_path / "probe.py").write_text("import vidtune.trainer.training.loop\n"
                                       "import vidtune.tune.config.options\n"
                                       "import trainer.training.loop\n")
    config = '{"typeCheckingMode": "off", "reportMissingImports": "error"}'
    (tmp_path / "pyrightconfig.json").write_text(config)
    tool = Path(sys.executable).with_name("basedpyright")
    proc = run([str(tool), "--pythonpath", sys.executable, "probe.py"], cwd=tmp_path, timeout=300)
    out = proc.stdout + proc.stderr
    assert "probe.py:3" in out and '"trainer.training.loop"' in out, out
    assert "1 error" in out and "probe.py:1" not in out and "probe.py:2" not in out, out
