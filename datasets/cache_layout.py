"""The clip cache on disk (`datasets.cache`): entry keys, entry files, publication, usage.

``ROOT/<key>/`` is one entry: ``meta.json`` and the frames, ``frames.jpg`` (format jpeg: each
frame a JPEG file, back to back; byte offsets in meta.json) or ``frames.npy`` (format raw: uint8
N x H x W x 3, read through a memory map so only the asked frames are read). meta.json holds
format_version, format, num_frames, height, width, bytes (of the frames file), source (resolved
path), source_size, source_mtime_ns, crc32 (zlib.crc32 of the whole frames file, written at fill,
checked by `check_crc32` on a process's first read of the entry) and, for jpeg, offsets (N + 1
integers). Entries from before crc32 existed have the same format_version and key, so an older
vidtune still reads new entries; this one decodes and writes such an entry again once (its body
cannot be trusted) instead of leaving it on disk unread, taking budget.
``ROOT/.tmp-*`` are entries being written, ``ROOT/.trash-*`` entries being removed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
import zlib
from pathlib import Path

import numpy as np
import torch

from vidtune.datasets.decode import encode_jpeg_frames, read_frames
from vidtune.datasets.records import VideoInfo
from vidtune.errors import DataError

FORMAT_VERSION = 1                 # bump when the entry layout changes: old entries are no longer read
FORMATS = ("jpeg", "raw")
JPEG_QUALITY = 90                  # mean abs error vs the decoded frames ~1-2 levels of 255
META_FILE = "meta.json"
FRAMES_FILE = {"jpeg": "frames.jpg", "raw": "frames.npy"}
_DECODE_CHUNK = 256                # frames per decord call when filling: bounds memory (38 MB at 224 px)
_STALE_S = 3600.0                  # a .tmp-/.trash- folder this old was left by a process that died
_KEY_RE = re.compile(r"[0-9a-f]{32}")
_CRC_CHUNK = 4 << 20               # bytes per read when checksumming; zlib.crc32 runs ~3.8 GB/s per core here


def entry_key(path: str | Path, fmt: str, height: int, width: int) -> str:
    """32 hex digits naming the entry of `path`'s current version (resolved path, size,
    mtime_ns) at `height` x `width` in format `fmt`. DataError when the file cannot be stat'ed."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"Failed to read video {path}: file not found (moved or deleted after "
                        "indexing?)") from None
    except OSError as e:
        raise DataError(f"Failed to read video {path}: cannot stat it ({e.strerror})") from e
    parts = [FORMAT_VERSION, fmt, str(Path(path).resolve()), st.st_size, st.st_mtime_ns, int(height),
             int(width)]
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:32]


def publish(folder: Path, entry: Path) -> bool:
    """Rename the written `folder` to `entry`: True if ours is now the entry, False when another
    process published it first (ours is then removed). Renaming a folder is atomic on one file
    system and fails when the target exists, so a reader sees no entry or a whole one."""
    try:
        os.rename(folder, entry)
        return True
    except OSError:
        if not (entry / META_FILE).exists():
            raise
        discard(folder, entry.parent)
        return False


def update_sizes(root: Path, sizes: dict[str, int]) -> None:
    """Bring `sizes` (entry name -> bytes) up to the published entries under `root`: names are
    listed every call, an entry's size is read only when it is new. The first call of a process
    (empty `sizes`) also removes temporary folders left by processes that died."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        names = []
    if not sizes:
        sweep_stale(root, names)
    present = {n for n in names if _KEY_RE.fullmatch(n)}
    for name in present - sizes.keys():
        sizes[name] = folder_bytes(root / name)
    for name in sizes.keys() - present:
        del sizes[name]


def load_meta(entry: Path, fmt: str) -> dict | None:
    """meta.json of a published entry, checked against its frames file; None when not published.
    Raises OSError / ValueError / KeyError / TypeError when the entry is damaged."""
    try:
        meta = json.loads((entry / META_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None          # not published: a reader never looks inside .tmp- folders
    if (not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION
            or meta.get("format") != fmt):
        raise ValueError(f"meta.json is not a {fmt} entry of format version {FORMAT_VERSION}")
    size = os.stat(entry / FRAMES_FILE[fmt]).st_size
    if size != meta["bytes"] or meta["num_frames"] < 1:
        raise ValueError(f"{FRAMES_FILE[fmt]} has {size} bytes, meta.json says {meta['bytes']}")
    return meta


def write_entry(folder: Path, info: VideoInfo, height: int, width: int, fmt: str,
                 want: list[int]) -> np.ndarray:
    """Decode every frame of `info` into `folder` (frames file + meta.json), `_DECODE_CHUNK`
    frames per decord call; returns the decoded frames `want` (uint8 len(want) x H x W x 3)."""
    n = int(info.num_frames)
    want_arr = np.asarray(want, dtype=np.int64)
    picked = np.empty((len(want), height, width, 3), np.uint8)
    target = folder / FRAMES_FILE[fmt]
    offsets = [0]
    if fmt == "raw":
        out = np.lib.format.open_memmap(target, mode="w+", dtype=np.uint8, shape=(n, height, width, 3))
    else:
        out = open(target, "wb")
    try:
        for start in range(0, n, _DECODE_CHUNK):
            stop = min(n, start + _DECODE_CHUNK)
            frames = read_frames(info.path, range(start, stop), height=height, width=width)
            sel = (want_arr >= start) & (want_arr < stop)
            picked[sel] = frames[want_arr[sel] - start]
            if fmt == "raw":
                out[start:stop] = frames
                continue
            for data in encode_jpeg_frames(frames, quality=JPEG_QUALITY):
                out.write(data.numpy().tobytes())
                offsets.append(offsets[-1] + data.numel())
    finally:
        if fmt == "raw":
            out.flush()
            del out
        else:
            out.close()
    st = os.stat(info.path)
    meta = {"format_version": FORMAT_VERSION, "format": fmt, "num_frames": n, "height": height,
            "width": width, "bytes": target.stat().st_size, "source": str(Path(info.path).resolve()),
            "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}
    meta["crc32"] = file_crc32(target)   # re-read from the page cache: ~2 ms for a 7 MB raw entry
    if fmt == "jpeg":
        meta["offsets"] = offsets
    (folder / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
    return picked


def file_crc32(path: Path) -> int:
    """zlib.crc32 of the whole file (an int in 0 .. 2**32 - 1)."""
    crc, buf = 0, bytearray(_CRC_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def check_crc32(entry: Path, meta: dict, fmt: str) -> None:
    """Raise ValueError when the frames file does not match meta.json's crc32 (body overwritten:
    random bytes, zeros), which size, shape and header checks let through. Reads the whole file."""
    crc = file_crc32(entry / FRAMES_FILE[fmt])
    if crc != meta["crc32"]:
        raise ValueError(f"{FRAMES_FILE[fmt]} does not match its checksum (crc32 {crc:08x}, "
                         f"meta.json says {meta['crc32']:08x})")


def read_raw(entry: Path, meta: dict, indices: list[int]) -> np.ndarray:
    """uint8 T x H x W x 3 from frames.npy (memory-mapped: only the asked frames are read)."""
    frames = np.load(entry / FRAMES_FILE["raw"], mmap_mode="r")
    expected = (meta["num_frames"], meta["height"], meta["width"], 3)
    if frames.shape != expected or frames.dtype != np.uint8:
        raise ValueError(f"frames.npy holds {frames.shape} {frames.dtype}, meta.json says {expected} uint8")
    return np.ascontiguousarray(frames[indices])


def read_jpeg(entry: Path, meta: dict, indices: list[int]) -> list[torch.Tensor]:
    """T 1-D uint8 tensors, each a whole JPEG file (start and end markers checked, not decoded).

    The T tensors are views of one buffer: a DataLoader worker sends a tensor's storage to the
    training process once per storage, so one storage per clip moves ~15x more clips/s than T."""
    offsets = meta["offsets"]
    if len(offsets) != meta["num_frames"] + 1:
        raise ValueError(f"meta.json has {len(offsets)} offsets for {meta['num_frames']} frames")
    lengths = [offsets[i + 1] - offsets[i] for i in indices]
    buf = np.empty(sum(lengths), np.uint8)
    pos = 0
    with open(entry / FRAMES_FILE["jpeg"], "rb") as f:
        for i, n in zip(indices, lengths, strict=True):
            part = buf[pos:pos + n]
            f.seek(offsets[i])
            if (f.readinto(part) != n or part[:2].tobytes() != b"\xff\xd8"
                    or part[-2:].tobytes() != b"\xff\xd9"):
                raise ValueError(f"frame {i} is not a whole JPEG file")
            pos += n
    return list(torch.from_numpy(buf).split(lengths))


def folder_bytes(folder: Path) -> int:
    try:
        return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())
    except FileNotFoundError:
        return 0


def discard(folder: Path, root: Path) -> None:
    """Remove a folder; renamed away first, so its name is free at once even if removal is slow."""
    trash = root / f".trash-{uuid.uuid4().hex}"
    try:
        os.rename(folder, trash)
    except OSError:
        return       # already gone (another process discarded it)
    shutil.rmtree(trash, ignore_errors=True)


def sweep_stale(root: Path, names: list[str]) -> None:
    now = time.time()
    for name in names:
        if name.startswith((".tmp-", ".trash-")):
            try:
                if now - os.stat(root / name).st_mtime > _STALE_S:
                    shutil.rmtree(root / name, ignore_errors=True)
            except OSError:
                pass
