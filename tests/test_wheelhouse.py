"""The offline wheelhouse end to end: built here for this Python (`make wheelhouse`'s builder),
installed by its own install.sh on an emulated GPU node with the network denied, then used.

The node is emulated honestly: its Python is a venv of this machine's Python 3.11 that sees torch,
torchvision and the packages they require (no extras: the CUDA libraries, sympy, numpy, pillow,
...) and nothing else, through one `.pth` line naming a folder of links to those distributions in
this environment's site-packages. That is what a node's Python with PyTorch installed has; Ray,
MLflow, Optuna and vidtune itself must all come from the wheelhouse. install.sh then runs under
`unshare -n` (a network namespace with no interface up) where this machine allows it, with
pip's configuration and PIP_* variables cleared either way, so nothing can be fetched.

The build needs the package index: the test is skipped, saying so, where it cannot be reached. The
wheelhouse is kept in pytest's cache, keyed by the files it is made from, so reruns skip the build.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import tempfile
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from deploy.wheelhouse import build, parts

REPO = Path(__file__).resolve().parents[1]
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"

pytestmark = pytest.mark.slow   # a build (~15 s, cached), an offline install (~1 min), a search (~1 min)


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what points at it or at pip's settings here."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "RAY_ADDRESS") and not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, **extra}


def run(args: list[str], cwd: Path, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=kwargs.pop("env", clean_env()), **kwargs)


def source_key() -> str:
    """A digest of the files a wheelhouse is made from."""
    digest = hashlib.sha256(PYTHON_VERSION.encode())
    files = [REPO / n for n in ("pyproject.toml", "constraints.txt", "Makefile")]
    for folder in ("deploy/wheelhouse", "vidtune", "datasets", "trainer", "tune", "bench"):
        files += sorted(p for p in (REPO / folder).rglob("*")
                        if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts)
    for path in files:
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def index_unreachable() -> str | None:
    """Why the package index cannot be used here, or None: one pinned wheel fetched as the build
    fetches (this machine's pip settings), bypassing pip's cache."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--quiet",
                     "--only-binary=:all:", "--dest", tmp, "psutil==7.2.2"], cwd=REPO, timeout=120,
                    env={**os.environ})
    if probe.returncode == 0:
        return None
    return (probe.stderr.strip().splitlines() or ["no output"])[-1]


@pytest.fixture(scope="module")
def wheelhouse(request) -> Path:
    cache = Path(request.config.cache.mkdir("wheelhouse"))
    out = cache / f"py{PYTHON_VERSION}-{source_key()}"
    if (out / parts.MANIFEST).exists():
        return out
    reason = index_unreachable()
    if reason:
        pytest.skip(f"building a wheelhouse needs the package index, unreachable here: {reason}")
    for old in cache.iterdir():                 # one wheelhouse kept (~370 MB)
        shutil.rmtree(old)
    partial = cache / "building"
    proc = run([sys.executable, "-m", "deploy.wheelhouse.build", "--python-version", PYTHON_VERSION,
                "--out", str(partial)], cwd=REPO, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    partial.rename(out)
    return out


def torch_distributions() -> set[str]:
    """torch, torchvision and what they require (no extras), as installed in this environment."""
    found, todo = set(), ["torch", "torchvision"]
    while todo:
        name = build.canonical(todo.pop())
        if name in found:
            continue
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        found.add(name)
        todo += [Requirement(r).name for r in requires
                 if not Requirement(r).marker or Requirement(r).marker.evaluate({"extra": ""})]
    return found


def node_python(root: Path) -> Path:
    """A Python like a GPU node's: this machine's Python 3.11 with torch, torchvision and their own
    requirements importable, and no other package (see the module's docstring)."""
    site_here = Path(sysconfig.get_paths()["purelib"])
    torch_site = root / "torch-site"
    torch_site.mkdir(parents=True)
    for name in torch_distributions():
        dist = importlib.metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if not (torch_site / top).exists():
                (torch_site / top).symlink_to(site_here / top)
    venv.create(root / "python", with_pip=False, symlinks=True)
    python = root / "python" / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root)
    (Path(site.stdout.strip()) / "node-torch.pth").write_text(f"{torch_site}\n")
    return python


def offline(args: list[str]) -> list[str]:
    """`args` in a network namespace of its own, only its loopback up, where this machine lets us."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return args
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        return args
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "offline", *args]


def test_a_wheelhouse_installs_offline_on_a_node_with_torch_and_runs_a_search(wheelhouse, tmp_path):
    manifest = json.loads((wheelhouse / parts.MANIFEST).read_text())
    sizes = {name: (wheelhouse / name).stat().st_size for name in manifest["files"]}
    assert max(sizes.values()) <= 60_000_000
    assert any(name.startswith("ray-") for name in map(lambda n: Path(n).name, manifest["joined"]))
    pins = [line.split("==")[0] for line in (wheelhouse / "requirements.txt").read_text().splitlines()
            if "==" in line]
    assert {"ray", "mlflow", "optuna", "decord", "vidtune"} <= set(pins)
    assert not [p for p in pins if build.is_node_package(p)], pins

    python = node_python(tmp_path / "node")
    assert run([str(python), "-c", "import torch, torchvision"], cwd=tmp_path).returncode == 0
    assert run([str(python), "-c", "import ray"], cwd=tmp_path).returncode != 0     # the node has no Ray
    dest = tmp_path / "vidtune"
    install = run(offline(["bash", str(wheelhouse / "install.sh"), str(dest)]), cwd=tmp_path,
                  env=clean_env(PYTHON=str(python)))
    print(install.stdout[-2000:], install.stderr[-2000:])
    # On this CPU machine `make gpu-check` is reached with every module it imports, and refuses.
    assert "installed: vidtune into" in install.stdout, install.stderr
    assert "sees no CUDA device here" in install.stderr, install.stderr
    assert install.returncode != 0
    # Consistent as installed, the node's packages included (its setuptools shows through, not
    # the older one ensurepip puts in a venv, which torch's requirement refuses).
    assert (dest / "pip-check.txt").read_text().strip() == "No broken requirements found."

    venv_python = dest / "venv" / "bin" / "python"
    where = run([str(venv_python), "-c", "import torch, ray, mlflow, vidtune; "
                 "print('\\n'.join(m.__file__ for m in (torch, ray, mlflow, vidtune)))"], cwd=tmp_path)
    torch_file, *ours = where.stdout.split()
    assert Path(torch_file).is_relative_to(tmp_path / "node" / "torch-site"), torch_file
    assert all(Path(f).is_relative_to(dest / "venv") for f in ours), ours

    work = tmp_path / "work"
    work.mkdir()
    vidtune = str(dest / "venv" / "bin" / "vidtune")
    assert "search" in run([vidtune, "--help"], cwd=work).stdout
    assert run([vidtune, "synth", str(work / "data"), "--videos", "16"], cwd=work).returncode == 0
    db = work / "m.db"
    search = run(offline([vidtune, "search", "--smoke-test", "--num-samples", "1", "--no-log-model",
                          "--data", str(work / "data"), "--mlflow-uri", f"sqlite:///{db}",
                          "--storage", str(work / "results")]), cwd=work)
    assert search.returncode == 0, search.stdout[-3000:] + search.stderr[-5000:]
    with sqlite3.connect(db) as con:
        statuses = [s for (s,) in con.execute("SELECT status FROM runs")]
    assert statuses == ["FINISHED", "FINISHED"], statuses      # the search's run and its one trial's
