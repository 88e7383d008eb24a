"""A wheelhouse's files in parts of at most 60 MB, and their checksums (the standard library only:
this file is copied into every wheelhouse, where `install.sh` runs it with the node's Python).

A wheel bigger than the limit (Ray's is about 70 MB) is cut into `NAME.whl.part00`, `.part01`,
... and removed; `MANIFEST.json` records the sha256 of every file shipped and, for each cut wheel,
its parts in order and the sha256 of the whole. On the node, `python parts.py join WHEELHOUSE DEST`
checks every file against the manifest and writes each cut wheel back whole into DEST; a missing
or damaged file ends it with one line naming the file.

    python parts.py join WHEELHOUSE DEST      # exit 1 and one line on the first bad file
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

PART_BYTES = 60_000_000       # "at most 60 MB": decimal megabytes, under 60 MiB too
MANIFEST = "MANIFEST.json"
CHUNK = 1 << 20


class PartsError(Exception):
    """A wheelhouse file missing, damaged or not in the manifest; the message is one line."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def split_file(path: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """Cut `path` into `path.partNN` files of at most `part_bytes` bytes each and remove it;
    returns the parts in order. A file within the limit is left as it is: returns []."""
    if path.stat().st_size <= part_bytes:
        return []
    parts = []
    with path.open("rb") as f:
        while block := f.read(part_bytes):
            part = path.with_name(f"{path.name}.part{len(parts):02d}")
            part.write_bytes(block)
            parts.append(part)
    path.unlink()
    return parts


def write_manifest(root: Path, part_bytes: int = PART_BYTES) -> dict:
    """Cut every file under `root` bigger than `part_bytes`, then write `root/MANIFEST.json`:
    {"files": {relative path: sha256}, "joined": {relative path of a cut file: {"sha256": of the
    whole, "parts": [relative paths in order]}}}. Returns the manifest."""
    joined = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        if path.stat().st_size > part_bytes:
            whole = sha256_of(path)
            parts = split_file(path, part_bytes)
            joined[path.relative_to(root).as_posix()] = {
                "sha256": whole, "parts": [p.relative_to(root).as_posix() for p in parts]}
    files = {p.relative_to(root).as_posix(): sha256_of(p)
             for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}
    manifest = {"part_bytes": part_bytes, "files": files, "joined": joined}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PartsError(f"{path}: cannot read the wheelhouse's manifest ({e}): "
                         "copy the whole wheelhouse folder again") from e


def verify(root: Path, manifest: dict) -> None:
    """Every file the manifest lists is present with its sha256; raises PartsError on the first
    that is not."""
    for name, expected in manifest["files"].items():
        path = root / name
        if not path.is_file():
            raise PartsError(f"{path}: missing (listed in {MANIFEST}): copy it again from the build machine")
        if sha256_of(path) != expected:
            raise PartsError(f"{path}: damaged (its sha256 differs from {MANIFEST}): "
                             "copy it again from the build machine")


def join(root: Path, dest: Path) -> list[Path]:
    """Verify the wheelhouse at `root`, then write each cut file whole into `dest` (its parts
    concatenated, checked against the whole's sha256). Returns the files written."""
    manifest = read_manifest(root)
    verify(root, manifest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name, entry in manifest["joined"].items():
        out = dest / Path(name).name
        with out.open("wb") as f:
            for part in entry["parts"]:
                with (root / part).open("rb") as src:
                    while block := src.read(CHUNK):
                        f.write(block)
        if sha256_of(out) != entry["sha256"]:
            out.unlink()
            raise PartsError(f"{root / name}: its parts joined give a sha256 other than {MANIFEST}'s: "
                             "copy the parts again from the build machine")
        written.append(out)
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "join":
        print("usage: python parts.py join WHEELHOUSE DEST", file=sys.stderr)
        return 2
    root, dest = Path(argv[1]), Path(argv[2])
    try:
        written = join(root, dest)
    except PartsError as e:
        print(f"wheelhouse: {e}", file=sys.stderr)
        return 1
    manifest = read_manifest(root)
    print(f"wheelhouse: {len(manifest['files'])} files match {MANIFEST}; "
          f"{len(written)} wheel(s) joined from their parts into {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
