"""The offline wheelhouse's pieces (deploy/wheelhouse/), without the network: files cut into parts
and joined back against their checksums, a damaged or missing part named in one line, the Python
versions refused at build and at install, a node Python without torch refused, the node's packages
(torch, torchvision, their CUDA libraries) kept out of what is resolved, and every module
`make gpu-check` imports covered by vidtune's own dependencies. tests/test_wheelhouse.py builds
and installs a real one."""
from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from deploy.wheelhouse import build, parts

REPO = Path(__file__).resolve().parents[1]
PARTS_PY = REPO / "deploy" / "wheelhouse" / "parts.py"
INSTALL_SH = REPO / "deploy" / "wheelhouse" / "install.sh"


def small_wheelhouse(root: Path) -> dict[str, bytes]:
    """A folder of three files, one of 250 bytes (cut into 3 parts at 100 bytes); returns their bytes."""
    contents = {"wheels/big-1.0-py3-none-any.whl": os.urandom(250),
                "wheels/small-1.0-py3-none-any.whl": b"small",
                "install.sh": b"#!/bin/sh\n"}
    for name, data in contents.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return contents


def join_cli(root: Path, dest: Path) -> subprocess.CompletedProcess:
    """parts.py run as install.sh runs it: a copy of the file, standalone, no project on the path."""
    return subprocess.run([sys.executable, str(root / "parts.py"), "join", str(root), str(dest)],
                          capture_output=True, text=True, cwd=root, env={"PATH": os.environ["PATH"]})


def test_big_file_is_cut_into_parts_and_joined_back_whole(tmp_path):
    root = tmp_path / "wh"
    contents = small_wheelhouse(root)
    manifest = parts.write_manifest(root, part_bytes=100)

    big = "wheels/big-1.0-py3-none-any.whl"
    assert not (root / big).exists()
    assert manifest["joined"][big]["parts"] == [f"{big}.part00", f"{big}.part01", f"{big}.part02"]
    assert [(root / p).stat().st_size for p in manifest["joined"][big]["parts"]] == [100, 100, 50]
    assert all((root / name).stat().st_size <= 100 for name in manifest["files"])
    assert json.loads((root / parts.MANIFEST).read_text()) == manifest

    shutil.copy2(PARTS_PY, root / "parts.py")     # as the builder ships it (not in the manifest here)
    proc = join_cli(root, tmp_path / "joined")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "joined" / "big-1.0-py3-none-any.whl").read_bytes() == contents[big]
    assert "1 wheel(s) joined" in proc.stdout


@pytest.mark.parametrize("damage", ["flip a byte", "remove"])
def test_a_damaged_or_missing_part_is_named_in_one_line(tmp_path, damage):
    root = tmp_path / "wh"
    small_wheelhouse(root)
    parts.write_manifest(root, part_bytes=100)
    shutil.copy2(PARTS_PY, root / "parts.py")
    part = root / "wheels" / "big-1.0-py3-none-any.whl.part01"
    if damage == "remove":
        part.unlink()
    else:
        data = bytearray(part.read_bytes())
        data[7] ^= 0xFF
        part.write_bytes(bytes(data))

    proc = join_cli(root, tmp_path / "joined")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(part) in lines[0]
    assert ("missing" if damage == "remove" else "damaged") in lines[0]
    assert not (tmp_path / "joined" / "big-1.0-py3-none-any.whl").exists()


def test_joined_parts_that_give_another_whole_are_refused(tmp_path):
    """Parts each matching the manifest, but joined in a wrong order (a manifest edited by hand)."""
    root = tmp_path / "wh"
    small_wheelhouse(root)
    manifest = parts.write_manifest(root, part_bytes=100)
    entry = manifest["joined"]["wheels/big-1.0-py3-none-any.whl"]
    entry["parts"].reverse()
    (root / parts.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(parts.PartsError, match="joined give a sha256 other than"):
        parts.join(root, tmp_path / "joined")


@pytest.mark.parametrize("version", ["3.10", "3.13", "3"])
def test_the_builder_refuses_other_pythons_in_one_line(tmp_path, version):
    out = tmp_path / "wh"
    proc = subprocess.run([sys.executable, "-m", "deploy.wheelhouse.build", "--python-version", version,
                           "--out", str(out)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert f"--python-version {version}:" in proc.stderr and "3.11 or 3.12" in proc.stderr
    assert not out.exists()


def test_the_builder_refuses_a_bad_glibc_and_a_folder_in_use(tmp_path):
    with pytest.raises(build.WheelhouseError, match="--glibc 2.x"):
        build.manylinux_platforms("2.x")
    assert build.manylinux_platforms("2.28")[:2] == ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64"]
    assert "manylinux_2_17_x86_64" in build.manylinux_platforms("2.28")
    assert "manylinux_2_29_x86_64" not in build.manylinux_platforms("2.28")
    (tmp_path / "old").write_text("")
    with pytest.raises(build.WheelhouseError, match="not empty"):
        build.build("3.11", tmp_path, "2.28", [])


def test_torch_and_its_cuda_packages_are_left_to_the_node():
    requirements = build.runtime_requirements(REPO / "pyproject.toml")
    names = {build.canonical(Requirement(r).name) for r in requirements}
    assert not names & {"torch", "torchvision"}
    assert {"ray", "mlflow", "optuna", "decord", "nvidia-ml-py"} <= names
    for name in ("torch", "TorchVision", "triton", "nvidia-cudnn-cu13", "nvidia_nccl_cu13", "cuda-toolkit",
                 "cuda-bindings"):
        assert build.is_node_package(name), name
    for name in ("nvidia-ml-py", "ray", "numpy", "pillow"):
        assert not build.is_node_package(name), name


def test_a_requirement_with_no_wheel_is_named(tmp_path):
    """pip's own words for a package with only a source distribution, read by the builder."""
    links = tmp_path / "links"
    links.mkdir()
    (links / "onlysource-1.0.tar.gz").write_bytes(b"")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--isolated", "--no-index",
                           "--find-links", str(links), "--only-binary=:all:", "--python-version", "3.12",
                           "--platform", "manylinux_2_28_x86_64", "-d", str(tmp_path), "onlysource==1.0"],
                          capture_output=True, text=True, env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    assert proc.returncode != 0
    assert build.missing_wheels(proc.stderr) == ["onlysource==1.0"]


def fake_wheelhouse(root: Path, python_version: str) -> Path:
    root.mkdir()
    shutil.copy2(INSTALL_SH, root / "install.sh")
    shutil.copy2(PARTS_PY, root / "parts.py")
    (root / "wheelhouse.json").write_text(json.dumps({"python_version": python_version}))
    return root / "install.sh"


def run_install(script: Path, python: str, dest: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(["bash", str(script), str(dest)], capture_output=True, text=True,
                          env={**env, "PYTHON": python}, timeout=120)


def test_install_refuses_a_python_of_another_version_in_one_line(tmp_path):
    script = fake_wheelhouse(tmp_path / "wh", "3.12")
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert have != "3.12"
    proc = run_install(script, sys.executable, tmp_path / "node")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"install.sh: {sys.executable} is Python {have}, this wheelhouse is for Python 3.12: set PYTHON to "
        f"the node's Python 3.12 that has torch, or build one with make wheelhouse PYTHON_VERSION={have}"]
    assert not (tmp_path / "node").exists()


def test_install_refuses_a_python_without_torch_in_one_line(tmp_path):
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False, symlinks=True)       # this Python, without its packages
    script = fake_wheelhouse(tmp_path / "wh", f"{sys.version_info.major}.{sys.version_info.minor}")
    proc = run_install(script, str(bare / "bin" / "python"), tmp_path / "node")
    assert proc.returncode == 1
    line, = proc.stderr.strip().splitlines()
    assert line.startswith(f"install.sh: {bare / 'bin' / 'python'} cannot import torch and torchvision: "
                           "load the node's PyTorch first")
    assert not (tmp_path / "node").exists()


def test_install_refuses_a_torch_older_than_vidtune_needs_in_one_line(tmp_path):
    """A node Python whose torch is 2.5 (packages standing in for torch and torchvision, that
    import and say their version, as an old node's would)."""
    old = tmp_path / "old"
    venv.create(old, with_pip=False, symlinks=True)
    site = next((old / "lib").glob("python3*/site-packages"))
    for name, version in (("torch", "2.5.1+cu121"), ("torchvision", "0.20.1")):
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f"__version__ = {version!r}\n")
    script = fake_wheelhouse(tmp_path / "wh", f"{sys.version_info.major}.{sys.version_info.minor}")
    proc = run_install(script, str(old / "bin" / "python"), tmp_path / "node")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"install.sh: {old / 'bin' / 'python'} has torch 2.5.1+cu121; vidtune needs torch 2.9 or newer: "
        "load a newer PyTorch on the node"]
    assert not (tmp_path / "node").exists()


def third_party_imports(module: Path, seen: set[Path]) -> set[str]:
    """Top-level names a bench module imports, following the bench modules it imports."""
    seen.add(module)
    names: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        found = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        for name in found:
            if name.startswith("bench."):
                path = REPO / (name.replace(".", "/") + ".py")
                if path.exists() and path not in seen:
                    names |= third_party_imports(path, seen)
            else:
                names.add(name.split(".")[0])
    return names


def test_gpu_check_imports_nothing_beyond_vidtunes_dependencies():
    """The wheelhouse holds vidtune's dependencies: bench/gpu_check.py must need no other."""
    closure, todo = set(), [Requirement(r).name for r in build.runtime_requirements(REPO / "pyproject.toml")]
    while todo:
        name = build.canonical(todo.pop())
        if name in closure:
            continue
        closure.add(name)
        for req in importlib.metadata.requires(name) or []:
            parsed = Requirement(req)
            if not parsed.marker or parsed.marker.evaluate({"extra": ""}):
                todo.append(parsed.name)
    owners = importlib.metadata.packages_distributions()
    imported = third_party_imports(REPO / "bench" / "gpu_check.py", set())
    assert {"mlflow", "torch", "vidtune"} <= imported
    for name in sorted(imported - set(sys.stdlib_module_names) - {"bench", "vidtune", "__future__"}):
        dists = {build.canonical(d) for d in owners.get(name, [])}
        assert dists, f"bench imports {name}, which no installed distribution provides"
        assert dists & closure or all(build.is_node_package(d) for d in dists), (name, dists)
