"""`make wheelhouse`: everything vidtune and `make gpu-check` need on a GPU node without internet,
except the node's own torch and torchvision, as wheels for one Python (3.11 or 3.12) in files of
at most 60 MB.

    python -m deploy.wheelhouse.build --python-version 3.11 --out wheelhouse-py311

Resolves vidtune's runtime dependencies less torch and torchvision with `pip download` for that
CPython on manylinux x86_64 (glibc up to --glibc; torch 2.9+ itself needs 2.28), wheels only,
pinned by constraints.txt; builds vidtune's own wheel; packs the files `make gpu-check` runs
(Makefile, bench/); cuts wheels over 60 MB into parts with their checksums (parts.py); and adds
`install.sh`, the one command to run on the node (docs/gpus.md, "A GPU node without internet").
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path

from deploy.wheelhouse import parts

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SUPPORTED_PYTHONS = ("3.11", "3.12")
# The node brings these: torch, torchvision and the CUDA libraries torch pulls in. nvidia-ml-py
# (NVML bindings) is vidtune's own dependency, not torch's.
NODE_PACKAGES = {"torch", "torchvision", "torchaudio", "triton", "pytorch-triton",
                 "cuda-toolkit", "cuda-bindings", "cuda-pathfinder"}
OWN_NVIDIA = {"nvidia-ml-py"}
# What `make gpu-check` reads on the node beside the installed vidtune (the bench/ modules are not
# in the wheel).
GPU_CHECK_FILES = ("Makefile", "pyproject.toml", "constraints.txt", "bench")
SOURCE_ARCHIVE = "vidtune-src.tar.gz"


class WheelhouseError(Exception):
    """A refused input or a failed step; the message is one line."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def is_node_package(name: str) -> bool:
    """True for torch, torchvision and the CUDA packages they need, which the node has."""
    name = canonical(name)
    return name in NODE_PACKAGES or (name.startswith("nvidia-") and name not in OWN_NVIDIA)


def check_python_version(version: str) -> str:
    if version not in SUPPORTED_PYTHONS:
        raise WheelhouseError(f"--python-version {version}: a wheelhouse is built for "
                              f"{' or '.join(SUPPORTED_PYTHONS)} (vidtune needs 3.11+; torch 2.9+ nodes "
                              "run these): pass one of them")
    return version


def runtime_requirements(pyproject: Path) -> list[str]:
    """vidtune's [project] dependencies, less those the node brings (torch, torchvision)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if not is_node_package(re.split(r"[\s\[<>=!~;]", d, maxsplit=1)[0])]


def manylinux_platforms(glibc: str) -> list[str]:
    """pip's --platform values for a node with this glibc (pip matches each manylinux_2_N exactly)."""
    match = re.fullmatch(r"2\.(\d+)", glibc)
    if not match or not 17 <= int(match[1]) <= 39:
        raise WheelhouseError(f"--glibc {glibc}: give the nodes' glibc as 2.N with N from 17 to 39 "
                              "(`ldd --version` on a node prints it)")
    newest = int(match[1])
    return ([f"manylinux_2_{n}_x86_64" for n in range(newest, 16, -1)]
            + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"])


def missing_wheels(pip_output: str) -> list[str]:
    """The requirements pip found no wheel for, from its error output."""
    found = re.findall(r"No matching distribution found for ([^\s;]+)", pip_output)
    return sorted(set(found))


def download(requirements: Path, dest: Path, python_version: str, glibc: str,
             extra_wheels: list[Path]) -> None:
    """`pip download` the requirements and all they need, wheels only, for the node's Python."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest),
           "--only-binary=:all:", "--implementation", "cp", "--python-version", python_version,
           "--abi", f"cp{python_version.replace('.', '')}", "--abi", "abi3", "--abi", "none",
           "-c", str(REPO_ROOT / "constraints.txt"), "-r", str(requirements)]
    for platform in manylinux_platforms(glibc):
        cmd += ["--platform", platform]
    for folder in extra_wheels:
        cmd += ["--find-links", str(folder)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return
    missing = missing_wheels(proc.stderr)
    if missing:
        raise WheelhouseError(
            f"no wheel for CPython {python_version} on manylinux (glibc {glibc}) of: {', '.join(missing)} "
            "(only a source distribution, or no release for that Python): build it with `pip wheel` on "
            "a machine like the node and pass its folder with --extra-wheels DIR")
    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise WheelhouseError(f"pip download failed (exit {proc.returncode}): {last}")


def checkout_copy(dest: Path) -> Path:
    """A copy of the checkout's files (git's tracked and untracked-not-ignored ones where it is a
    git work tree): setuptools' build/ folder would otherwise keep modules since removed."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO_ROOT, capture_output=True)
    if listed.returncode != 0:
        shutil.copytree(REPO_ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", "wheelhouse*"))
        return dest
    for name in filter(None, listed.stdout.decode().split("\0")):
        src = REPO_ROOT / name
        if src.is_symlink() or src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name, follow_symlinks=False)
    return dest


def build_vidtune_wheel(source: Path, dest: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dest),
                           str(source)], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise WheelhouseError(f"building vidtune's wheel failed (exit {proc.returncode}): {last}")
    (wheel,) = dest.glob("vidtune-*.whl")
    return wheel


def pack_gpu_check_files(source: Path, out: Path) -> None:
    with tarfile.open(out, "w:gz") as tar:
        for name in GPU_CHECK_FILES:
            tar.add(source / name, arcname=f"vidtune-src/{name}",
                    filter=lambda info: None if "__pycache__" in info.name else info)


def wheel_pins(wheels: Path) -> list[str]:
    """`name==version` of each wheel in the folder (a wheel's file name starts NAME-VERSION-)."""
    return sorted(f"{canonical(w.name.split('-')[0])}=={w.name.split('-')[1]}" for w in wheels.glob("*.whl"))


def build(python_version: str, out: Path, glibc: str, extra_wheels: list[Path]) -> dict:
    """Write the wheelhouse into `out` (absent or empty); returns its figures."""
    check_python_version(python_version)
    manylinux_platforms(glibc)
    if out.exists() and any(out.iterdir()):
        raise WheelhouseError(f"--out {out}: not empty: remove it or name another folder")
    started = time.perf_counter()
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="vidtune-wheelhouse-") as tmp:
        requirements = Path(tmp) / "requirements.in"
        requirements.write_text("\n".join(runtime_requirements(REPO_ROOT / "pyproject.toml")) + "\n")
        download(requirements, wheels, python_version, glibc, extra_wheels)
        names = [pin.split("==")[0] for pin in wheel_pins(wheels)]
        brought = sorted(name for name in names if is_node_package(name))
        if brought:
            raise WheelhouseError(f"the resolved set holds packages the node brings: {', '.join(brought)} "
                                  "(a dependency requires them): exclude that dependency or pin it")
        source = checkout_copy(Path(tmp) / "source")
        build_vidtune_wheel(source, wheels)
        pack_gpu_check_files(source, out / SOURCE_ARCHIVE)
    pins = wheel_pins(wheels)
    (out / "requirements.txt").write_text(
        "# installed by install.sh (pip --no-index --no-deps); the node brings torch and torchvision\n"
        + "\n".join(pins) + "\n")
    (out / "wheelhouse.json").write_text(json.dumps(
        {"python_version": python_version, "glibc": glibc, "platforms": manylinux_platforms(glibc),
         "built": time.strftime("%Y-%m-%d %H:%M:%S %z")}, indent=1) + "\n")
    shutil.copy2(HERE / "install.sh", out / "install.sh")
    shutil.copy2(HERE / "parts.py", out / "parts.py")
    manifest = parts.write_manifest(out)
    sizes = [(out / name).stat().st_size for name in manifest["files"]]
    return {"out": str(out), "python_version": python_version, "wheels": len(pins),
            "files": len(sizes), "total_mb": sum(sizes) / 1e6, "largest_mb": max(sizes) / 1e6,
            "split": {name: len(entry["parts"]) for name, entry in manifest["joined"].items()},
            "seconds": time.perf_counter() - started}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-version", default="3.11",
                        help="the node's Python: 3.11 (default) or 3.12")
    parser.add_argument("--out", type=Path, default=None,
                        help="the folder to write, absent or empty (default: wheelhouse-pyXY)")
    parser.add_argument("--glibc", default="2.28",
                        help="the nodes' glibc, `ldd --version` there (default 2.28, what torch 2.9+ needs)")
    parser.add_argument("--extra-wheels", type=Path, action="append", default=[],
                        help="a folder of wheels built by hand, for packages the index has no wheel of")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out or Path(f"wheelhouse-py{args.python_version.replace('.', '')}")
    try:
        figures = build(args.python_version, out.resolve(), args.glibc, args.extra_wheels)
    except WheelhouseError as e:
        print(f"wheelhouse: {e}", file=sys.stderr)
        return 2
    split = ", ".join(f"{Path(name).name} in {n} parts" for name, n in figures["split"].items()) or "none"
    print(f"wheelhouse: {out} for Python {figures['python_version']}: {figures['wheels']} wheels, "
          f"{figures['total_mb']:.0f} MB in {figures['files']} files "
          f"(largest {figures['largest_mb']:.1f} MB; cut: {split}), built in {figures['seconds']:.0f} s")
    print(f"on the node: bash {out}/install.sh DEST   (docs/gpus.md, \"A GPU node without internet\")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
