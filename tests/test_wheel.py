"""The wheel, installed as a user installs it: into an environment that already has Hugging
Face's `datasets`, then used from a folder that is not the clone, then uninstalled.

The fresh environment is a venv whose own site-packages holds a copy of Hugging Face's
`datasets` (as in most ML images) and sees this environment's other packages (torch, Ray, ...)
through a `.pth` line, so nothing is downloaded. This environment's editable vidtune is not
visible there: a `.pth` line adds a folder to sys.path without running the `.pth` files in it,
and the editable install is one of those.
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow   # builds a wheel, makes a venv, trains once: about a minute


def run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS", "VIRTUAL_ENV")}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def build_wheel(out: Path) -> Path:
    """`pip wheel .` without build isolation (setuptools is installed here; no download), from a
    copy of the clone: setuptools' build/ folder would otherwise keep modules since removed."""
    source = out / "source"
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".ruff_cache"))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(out), str(source)], cwd=out)
    (wheel,) = out.glob("vidtune-*.whl")
    return wheel


def env_with_hugging_face_datasets(root: Path) -> tuple[Path, Path]:
    """A venv with Hugging Face's `datasets` copied into its own site-packages; returns
    (its python, its site-packages)."""
    venv.create(root, with_pip=False, symlinks=True)
    python = root / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=root).stdout.strip())
    here = Path(sysconfig.get_paths()["purelib"])
    dist = importlib.metadata.distribution("datasets")
    dist_info = Path(dist._path)                                   # datasets-X.Y.Z.dist-info
    shutil.copytree(here / "datasets", site / "datasets")
    shutil.copytree(dist_info, site / dist_info.name)
    (site / "outer.pth").write_text(f"{here}\n")                   # torch, Ray, MLflow, ...: reused
    return python, site


def test_the_wheel_installs_beside_hugging_face_datasets_and_leaves_it_whole(tmp_path):
    wheel = build_wheel(tmp_path / "dist")
    python, site = env_with_hugging_face_datasets(tmp_path / "env")
    hf_files = sorted(p.relative_to(site) for p in (site / "datasets").rglob("*") if p.is_file())

    # The wheel holds one top-level package: vidtune, with the three layers inside it.
    listing = run([sys.executable, "-m", "zipfile", "-l", str(wheel)], cwd=tmp_path).stdout
    tops = {line.split("/", 1)[0] for line in listing.splitlines()[1:] if "/" in line}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"vidtune"}, listing
    for module in ("vidtune/datasets/index.py", "vidtune/trainer/cluster/worker.py", "vidtune/tune/search.py",
                   "vidtune/flags.py", "vidtune/cli.py"):
        assert module in listing

    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
         str(wheel)], cwd=tmp_path)
    vidtune = python.with_name("vidtune")
    work = tmp_path / "work"                                       # not the clone: no folder beside it
    work.mkdir()

    assert "search" in run([str(vidtune), "--help"], cwd=work).stdout
    both = run([str(python), "-c", "import datasets, vidtune.datasets.index as ours, datasets.config; "
                "print(datasets.__file__); print(ours.__file__)"], cwd=work).stdout.splitlines()
    assert Path(both[0]).parent == site / "datasets"                # Hugging Face's, whole
    assert Path(both[1]).parent == site / "vidtune" / "datasets"    # ours, from the wheel

    # The installed code trains through Ray (a search from an installed wheel, offline, is
    # tests/test_wheelhouse.py's): one training run, no search, from the same folder.
    run([str(vidtune), "synth", str(work / "data"), "--videos", "16"], cwd=work)
    train = run([str(vidtune), "train", "--data", str(work / "data"), "--model", "tiny", "--epochs", "1",
                 "--batch-size", "4",
                 "--storage", str(work / "train")], cwd=work, timeout=600)
    assert "val_acc" in train.stdout + train.stderr

    # Uninstalling vidtune leaves Hugging Face's package file for file.
    run([sys.executable, "-m", "pip", "--python", str(python), "uninstall", "-y", "vidtune"], cwd=tmp_path)
    assert not (site / "vidtune").exists() and not vidtune.exists()
    assert sorted(p.relative_to(site) for p in (site / "datasets").rglob("*") if p.is_file()) == hf_files
    run([str(python), "-c", "import datasets, datasets.config"], cwd=work)
