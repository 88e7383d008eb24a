#!/usr/bin/env bash
# Install vidtune from this wheelhouse on a GPU node without internet, then run `make gpu-check`.
#
#   bash WHEELHOUSE/install.sh DEST [--no-gpu-check] [-- GPU_CHECK_ARGS...]
#
# PYTHON (default: python3) is the node's Python that imports torch and torchvision, of the version
# this wheelhouse was built for (wheelhouse.json). DEST gets:
#   DEST/venv    a venv made by that Python; one .pth line per folder of that Python's own
#                sys.path (site-packages, PYTHONPATH) lets it import the node's torch, as
#                --system-site-packages would, also where the node's torch is in a venv or conda
#                env; the wheelhouse's packages are installed in the venv itself and come first
#   DEST/src     Makefile and bench/, which `make gpu-check` runs (VENV=DEST/venv)
#   DEST/joined  the wheels that were cut into parts, joined and checked
# Nothing is fetched: pip runs with --no-index and reads only this folder.
set -euo pipefail
shopt -s nullglob

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
die() { echo "install.sh: $*" >&2; exit 1; }

dest=""
gpu_check=1
gpu_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --no-gpu-check) gpu_check=0 ;;
        --) shift; gpu_args=("$@"); break ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        -*) die "unknown option $1: usage: bash install.sh DEST [--no-gpu-check] [-- GPU_CHECK_ARGS...]" ;;
        *) [ -z "$dest" ] || die "one DEST only (got $dest and $1)"; dest="$1" ;;
    esac
    shift
done
[ -n "$dest" ] || die "usage: bash install.sh DEST [--no-gpu-check] [-- GPU_CHECK_ARGS...]"

py="${PYTHON:-python3}"
command -v "$py" >/dev/null || die "PYTHON=$py: not found: load the node's Python that has torch (module load, conda activate) or set PYTHON=/path/to/it"
want="$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["python_version"])' "$here/wheelhouse.json")" \
    || die "$here/wheelhouse.json: unreadable: copy the whole wheelhouse folder again"
have="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$have" = "$want" ] || die "$py is Python $have, this wheelhouse is for Python $want: set PYTHON to the node's Python $want that has torch, or build one with make wheelhouse PYTHON_VERSION=$have"
"$py" -c 'import torch, torchvision' 2>/dev/null \
    || die "$py cannot import torch and torchvision: load the node's PyTorch first (module load, conda activate) or set PYTHON=/path/to/the/python that has it"
torch_version="$("$py" -c 'import torch; print(torch.__version__)')"
"$py" -c 'import sys; sys.exit(tuple(map(int, sys.argv[1].split("+")[0].split(".")[:2])) < (2, 9))' "$torch_version" \
    || die "$py has torch $torch_version; vidtune needs torch 2.9 or newer: load a newer PyTorch on the node"

mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"
[ ! -e "$dest/venv" ] || die "$dest/venv exists: remove it, or name another DEST"

"$py" "$here/parts.py" join "$here" "$dest/joined" || exit 1

"$py" -m venv "$dest/venv" || die "$py -m venv $dest/venv failed: this Python lacks venv/ensurepip (Debian: python3-venv); use another Python that has torch"
venv_py="$dest/venv/bin/python"
site="$("$venv_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# The node Python's own package folders, less its standard library, in its order.
"$py" - >"$site/node-python.pth" <<'EOF'
import os, sys, sysconfig
std = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
for entry in sys.path:
    real = os.path.realpath(entry) if entry else ""
    if not real or not os.path.isdir(real) or real in std or real.endswith("lib-dynload"):
        continue
    print(real)
EOF
"$venv_py" -c 'import torch, torchvision' \
    || die "$dest/venv cannot import the node's torch through $site/node-python.pth: check that $py imports it outside this script"
# The venv's setuptools from ensurepip (65.5 on Python 3.11) would hide the node's, which torch
# requires (>=77: torch.utils.cpp_extension); the node's shows through once it is gone.
if "$py" -c 'import setuptools' 2>/dev/null && [ -d "$site/setuptools" ]; then
    PIP_CONFIG_FILE=/dev/null "$venv_py" -m pip --isolated uninstall --quiet --yes setuptools >/dev/null
fi

wheels=("$here"/wheels/*.whl "$dest"/joined/*.whl)
PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null "$venv_py" -m pip --isolated install --quiet --no-index --no-deps \
    --no-cache-dir --no-compile --disable-pip-version-check "${wheels[@]}" \
    || die "pip could not install the wheelhouse into $dest/venv (above); is it for this machine (x86_64 Linux, glibc of wheelhouse.json)?"

# pip check, less what concerns torch and torchvision (the node's) and packages of the node's
# own folders: one line on the first problem of a package this wheelhouse installed.
PIP_CONFIG_FILE=/dev/null "$venv_py" -m pip --isolated check --disable-pip-version-check >"$dest/pip-check.txt" 2>&1 || true
"$venv_py" - "$here/requirements.txt" "$dest/pip-check.txt" <<'EOF' || exit 1
import re, sys
canon = lambda name: re.sub(r"[-_.]+", "-", name).lower()
ours = {canon(line.split("==")[0]) for line in open(sys.argv[1]) if "==" in line}
bad = [line.strip() for line in open(sys.argv[2])
       if line.split() and canon(line.split()[0]) in ours
       and not re.search(r"(requires|has requirement) (torch|torchvision)\b", line)]
if bad:
    sys.exit(f"install.sh: pip check: {bad[0]} ({len(bad)} problem(s), all in {sys.argv[2]})")
EOF

{ tar -xzf "$here/vidtune-src.tar.gz" -C "$dest" && rm -rf "$dest/src" && mv "$dest/vidtune-src" "$dest/src"; } \
    || die "could not unpack $here/vidtune-src.tar.gz into $dest/src (above)"
touch "$dest/venv/.installed"      # the Makefile's install stamp: `make gpu-check` installs nothing
torch_line="$("$venv_py" -c 'import torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) from {torch.__file__}")')"
echo "installed: vidtune into $dest/venv (Python $have), with the node's $torch_line"
echo "use it: $dest/venv/bin/vidtune --help; gpu check: make -C $dest/src gpu-check VENV=$dest/venv"

[ "$gpu_check" = 1 ] || exit 0
cd "$dest/src"
if command -v make >/dev/null; then
    exec make gpu-check VENV="$dest/venv" GPU_CHECK_ARGS="${gpu_args[*]}"
fi
exec "$venv_py" -m bench.gpu_check "${gpu_args[@]}"
