"""Files written whole or not at all: a full disk or a kill mid-write leaves the old file (or none),
never a zero-byte or cut one.

The new content goes to a temporary file in the same folder (so the rename stays on one file
system), is flushed and fsync'ed, then renamed over the target (`os.replace`, atomic on POSIX).
A write that fails (ENOSPC) removes its temporary file and raises.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that takes a path (csv, savefig); when the
    block ends without an error it is fsync'ed and renamed to `path`, else removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomically(path: str | Path, data: bytes | str) -> Path:
    """`data` (text as UTF-8) to `path`, whole or not at all; returns the path."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
    return Path(path)
