"""deploy/Dockerfile, read as a file (no Docker here; `make image` builds it where there is):
its CUDA base is the one the pinned torch was built for, every install is pinned by
constraints.txt, it holds every package folder pyproject.toml maps, and it runs as a non-root
user, the one the Kubernetes manifests name."""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in DOCKERFILE.read_text().splitlines()
                                           if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _args() -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in _instructions() if word == "ARG" and "=" in rest)


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def _pip_installs() -> list[list[str]]:
    installs = []
    for word, rest in _instructions():
        if word == "RUN":
            for part in re.split(r"&&|;", rest):
                tokens = shlex.split(part)
                if tokens[:2] == ["pip", "install"]:
                    installs.append(tokens)
    return installs


def test_the_base_is_the_cuda_runtime_torch_was_built_for():
    (base,) = [rest for word, rest in _instructions() if word == "FROM"]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:cudnn-)?runtime-ubuntu[\d.]+", base)
    assert match, f"not an NVIDIA CUDA runtime image: {base}"
    if torch.version.cuda is None:
        pytest.skip("this torch is a CPU build: no CUDA version to compare the base with")
    major, minor = torch.version.cuda.split(".")[:2]
    assert match.groups() == (major, minor), f"base {base}, torch built for CUDA {torch.version.cuda}"
    # and torch comes from PyTorch's index of that same CUDA build
    assert _args()["TORCH_INDEX"].rstrip("/").endswith(f"/cu{major}{minor}")


def test_every_pip_install_is_constrained_by_the_copied_constraints_txt():
    copied = [rest.split()[-2:] for word, rest in _instructions()
              if word == "COPY" and "constraints.txt" in rest]
    assert copied and copied[0][0] == "constraints.txt"
    target = copied[0][1]
    installs = [t for t in _pip_installs() if t[-2:] != ["--upgrade", "pip"]]
    assert len(installs) >= 2          # torch's layer, then vidtune's
    for tokens in installs:
        assert tokens[tokens.index("-c") + 1] == target, tokens


def test_versions_named_in_the_file_equal_constraints_txt():
    pins = _pins()
    named = re.findall(r"([A-Za-z0-9_.\-\[\]]+)==([0-9][^\s\"']*)", DOCKERFILE.read_text())
    for name, version in named:
        name = name.split("[", 1)[0].lower()
        assert pins.get(name) == version, \
            f"{name}=={version} in the Dockerfile, constraints.txt: {pins.get(name)}"


def test_python_is_cis_minor_version():
    wanted = f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert re.search(rf"\b{re.escape(wanted)}\b", DOCKERFILE.read_text()), wanted


def test_the_image_holds_every_folder_of_the_package():
    # src/ (pyproject.toml's package-dir: a link to vidtune/), vidtune/ and the layer folders its
    # links point to (vidtune/datasets -> ../datasets, ...)
    links = [p for p in (REPO / "vidtune").iterdir() if p.is_symlink()]
    folders = {"src", "vidtune"} | {p.resolve().relative_to(REPO).as_posix() for p in links}
    assert {"datasets", "trainer", "tune"} <= folders
    copied = {shlex.split(rest)[-2] for word, rest in _instructions() if word == "COPY"}
    assert folders <= copied, folders - copied
    assert {"pyproject.toml"} <= {w for rest in [r for w, r in _instructions() if w == "COPY"]
                                  for w in shlex.split(rest)}
    ignored = (REPO / "deploy" / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_it_runs_as_the_non_root_user_the_manifests_name():
    steps = _instructions()
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    # the installs run as that user (a root-owned venv would be the user's to fix)
    last_user = max(i for i, (word, _) in enumerate(steps) if word == "USER")
    first_install = min(i for i, (word, rest) in enumerate(steps) if word == "RUN" and "pip install" in rest)
    assert last_user < first_install
    uid = re.search(r"useradd\b.*--uid (\d+).*\b" + re.escape(users[-1]) + r"\b", DOCKERFILE.read_text())
    assert uid, "the USER is made with a fixed --uid"
    for path in sorted((REPO / "deploy" / "kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            text = yaml.safe_dump(doc)
            for found in re.findall(r"runAsUser: (\d+)", text):
                assert found == uid.group(1), path.name


def _apt_installs() -> set[str]:
    """The packages every `apt-get install` of the file names (options dropped)."""
    packages: set[str] = set()
    for word, rest in _instructions():
        if word == "RUN":
            for part in re.split(r"&&|;", rest):
                tokens = shlex.split(part)
                if tokens[:2] == ["apt-get", "install"]:
                    packages |= {t for t in tokens[2:] if not t.startswith("-")}
    return packages


def test_the_image_can_build_tritons_launcher_for_compile():
    """--compile on CUDA: Triton compiles a small C launcher (driver.c, which includes Python.h)
    the first time a process runs a compiled step, so the image needs a C compiler, the C library's
    headers and the headers of the image's own Python (python3.11-dev for python3.11), or every
    compiled trial fails at its first step."""
    wanted = f"python{sys.version_info.major}.{sys.version_info.minor}"
    packages = _apt_installs()
    assert wanted in packages                           # the image's Python, whose headers are needed
    assert {"gcc", "libc6-dev", f"{wanted}-dev"} <= packages, packages
