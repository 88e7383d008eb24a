"""A local storage folder where Ray writes every file whole or not at all (a full disk).

Ray Tune and Ray Train copy a search's state (`experiment_state-*.json`, the searcher's pickle,
each trial's `params.pkl`, `result.json`, `error.txt`) and each checkpoint (`checkpoint.pt`,
`checksums.json`, `epochs.json`) into `--storage` with pyarrow's `copy_files`, which opens each
target file in place: a disk that fills mid-copy leaves it zero bytes or cut short, and a
`--resume` then reads that. Given as the `storage_filesystem` of Tune's and Train's `RunConfig`,
`atomic_local_fs()` makes pyarrow write each file under a temporary name beside it
(`.NAME.PID.tmp`) and rename it over the target when it is closed whole (`os.replace`, atomic on
POSIX and on NFS); a failed write removes the temporary file and leaves the old file (or none).
Reading, listing and deleting are pyarrow's `LocalFileSystem`'s own.

Only for a local `--storage` (or a mounted network folder); an object store (s3://, gs://)
writes whole objects already and keeps pyarrow's own filesystem.
"""
from __future__ import annotations

import os
from typing import Any

import pyarrow
import pyarrow.fs as pafs


class _WholeFile:
    """A binary file written to a temporary name and renamed to `path` when closed after no
    failed write; removed instead when a write failed or it was never closed (garbage)."""

    def __init__(self, path: str):
        self.path = path
        self.tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
        self._file = open(self.tmp, "wb")   # noqa: SIM115 (closed by close(), below)
        self._failed = False
        self.closed = False

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except BaseException:
            self._fail()
            raise

    def flush(self) -> None:
        try:
            self._file.flush()
        except BaseException:
            self._fail()
            raise

    def _fail(self) -> None:
        # at once: the process may end before pyarrow drops the stream (a worker that failed)
        self._failed = True
        self._discard()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._failed:
                raise OSError("a write failed")
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self._discard()
            if not self._failed:
                raise

    def _discard(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        try:
            os.unlink(self.tmp)
        except OSError:
            pass

    def __del__(self) -> None:   # pyarrow dropped the stream after a failed copy, unclosed
        if not getattr(self, "closed", True):
            self.closed = True
            self._discard()

    # what pyarrow's PythonFile asks of a writable file
    @property
    def mode(self) -> str:
        return "wb"

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._file.tell()


class AtomicLocalHandler(pafs.FileSystemHandler):
    """pyarrow's `LocalFileSystem`, except that every file opened for writing is `_WholeFile`."""

    def __init__(self) -> None:
        self.local = pafs.LocalFileSystem()

    def __reduce__(self):   # shipped to Ray's workers and pickled into Tune's state
        return AtomicLocalHandler, ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AtomicLocalHandler)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(AtomicLocalHandler)

    def get_type_name(self) -> str:
        return "vidtune-atomic-local"

    def normalize_path(self, path: str) -> str:
        return self.local.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.local.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.local.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.local.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self.local.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.local.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        with self.local.open_input_stream(src) as source:
            out = self.open_output_stream(dest, None)
            try:
                while chunk := source.read(1 << 20):
                    out.write(chunk)
            finally:
                out.close()

    def open_input_stream(self, path: str) -> pyarrow.NativeFile:
        return self.local.open_input_stream(path)

    def open_input_file(self, path: str) -> pyarrow.NativeFile:
        return self.local.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> pyarrow.NativeFile:
        return pyarrow.PythonFile(_WholeFile(path), mode="w")

    def open_append_stream(self, path: str, metadata: Any) -> pyarrow.NativeFile:
        return self.local.open_append_stream(path)


def atomic_local_fs() -> pafs.FileSystem:
    """The storage filesystem for a local `--storage` (module docstring)."""
    return pafs.PyFileSystem(AtomicLocalHandler())


def storage_filesystem(storage: str | None) -> pafs.FileSystem | None:
    """`atomic_local_fs()` for a local storage path (or None: Ray's default folder); None for a
    URI (s3://, gs://, ...), which Ray's own filesystem serves."""
    if storage is not None and "://" in storage:
        return None
    return atomic_local_fs()


def is_local(filesystem: pafs.FileSystem | None) -> bool:
    """Whether `filesystem` is this machine's own: pyarrow's local one or `atomic_local_fs()`
    (a path on it is read in place)."""
    return isinstance(filesystem, pafs.LocalFileSystem) or (
        isinstance(filesystem, pafs.PyFileSystem) and isinstance(filesystem.handler, AtomicLocalHandler))
