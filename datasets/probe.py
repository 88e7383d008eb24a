"""Probe one video file, and run such probes in worker processes that can be killed.

decord can hang or crash on a broken file and cannot be interrupted in-process, so every probe
runs in a "spawn" worker process under a timeout; a stuck worker is killed and replaced, a crashed
one is reported, and the other files go on. `datasets.index` drives this for a whole dataset.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection, get_context
from typing import Any

import av
import decord

from vidtune.errors import decoder_reason

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0                 # a worker that has not started by then is broken


def probe_video(path: str) -> dict[str, Any]:
    """Open `path` with decord and find how many frames really decode.

    Returns {"num_frames", "claimed_frames", "fps", "width", "height"} or {"error": reason}.
    A container can claim more frames than decode (decord #373 loops forever seeking past the
    real end), so frame 0 and the last claimed frame are decoded, and when the last one fails
    a bisection finds the last index that decodes.
    """
    size = os.stat(path).st_size
    if size == 0:
        return {"error": "empty file (0 bytes)"}

    def open_reader():
        return decord.VideoReader(path, num_threads=1)

    try:
        reader = open_reader()
        claimed = len(reader)
        fps = float(reader.get_avg_fps())
    except Exception as e:  # decord raises DECORDError, RuntimeError or AssertionError
        return {"error": _no_video_stream(path) or f"cannot be opened as a video ({decoder_reason(e)})"}

    def decodes(i: int) -> tuple[bool, Any]:
        nonlocal reader
        # Two tries: decord reads packets ahead in a thread, so damage *after* frame i can make
        # the read of frame i fail or not depending on timing; a fresh reader per try.
        for _ in range(2):
            try:
                return True, reader.get_batch([i]).shape
            except Exception:
                reader = open_reader()  # a failed seek can leave the decoder in a bad state
        return False, None

    ok, shape = decodes(0)
    if not ok:
        return {"error": _misread_frames(reader)
                or f"the first frame does not decode ({claimed} frames claimed)"}
    last = claimed - 1
    if last > 0 and not decodes(last)[0]:
        good, bad = 0, last
        while bad - good > 1:
            mid = (good + bad) // 2
            if decodes(mid)[0]:
                good = mid
            else:
                bad = mid
        last = good
    _, height, width, _ = shape
    return {"num_frames": last + 1, "claimed_frames": claimed,
            "fps": fps if fps == fps and fps > 0 else 0.0, "width": int(width), "height": int(height)}


def _misread_frames(reader: decord.VideoReader) -> str | None:
    """The reason when decord decodes frame 0 but with other than 3 channels, so that no batch
    of frames can be read (decord 0.6.0 does so at some frame widths: 48 and 72 px seen, 40, 56
    and 64 fine); None when frame 0 does not decode at all."""
    try:
        height, width, channels = reader[0].shape
    except Exception:  # noqa: BLE001 - decord's own failure: the caller's reason stands
        return None
    if channels == 3:
        return None
    return (f"decord returns its {width}x{height} frames with {channels} channels, not 3 (a decord defect "
            f"at some frame widths); re-encode it at another width, e.g. ffmpeg -i IN -vf "
            f"scale={width + 8}:-2 OUT")


def _no_video_stream(path: str) -> str | None:
    """The reason for a media file that has no video stream (decord only says "cannot find video
    stream with wanted index: -1"), e.g. "has no video stream (audio only)"; None when the file
    has a video stream or FFmpeg cannot read it at all (decord's own reason is kept then)."""
    try:
        with av.open(path) as container:
            if container.streams.video:
                return None
            kinds = sorted({s.type for s in container.streams})
    except Exception:  # noqa: BLE001 - not a container FFmpeg reads: decord's reason says more
        return None
    if kinds == ["audio"]:
        return "has no video stream (audio only)"
    return "has no video stream" + (f" (only {', '.join(kinds)})" if kinds else " (no streams)")


# ---------------------------------------------------------------------------------------------
# a process pool whose stuck tasks can be killed

@dataclass
class _Worker:
    proc: Any
    conn: connection.Connection
    task: int | None = None
    deadline: float = 0.0
    stderr: Any = None              # what it printed while starting (a temporary file)


def _worker_main(conn: connection.Connection, fn: Callable) -> None:
    # FFmpeg prints a line per damaged packet to fd 2; the index lists the reason instead.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        i, args = task
        try:
            out = ("ok", fn(*args))
        except Exception as e:
            out = ("error", f"{type(e).__name__}: {e}")
        conn.send((i, out))


def run_pool(fn: Callable, tasks: list[tuple], *, timeout_s: float, workers: int,
             on_done: Callable[[int], None] | None = None) -> list[tuple[str, Any]]:
    """Run `fn(*task)` for every task in `workers` spawned processes, each call under `timeout_s`.

    Returns one outcome per task, in order: ("ok", result), ("error", message) for an exception,
    ("timeout", None) when the call was killed after `timeout_s`, or ("crashed", exit code) when
    the process died (a decoder segfault). Stuck or dead workers are replaced, so one bad file
    never stops the others. `fn` must be importable (a module-level function).
    """
    ctx = get_context("spawn")   # fork would copy Ray's / torch's threads into the child
    pending = deque(range(len(tasks)))
    results: list[tuple[str, Any] | None] = [None] * len(tasks)
    pool: list[_Worker] = []

    def start() -> None:
        # Workers start in parallel (~0.5 s each to spawn); the first message says it is ready.
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child, fn), daemon=True)
        # Born with its stderr in a file, read only if it fails to start: Ctrl-C reaches the whole
        # process group, and a worker still starting would print Python's fatal error or a
        # traceback; this process stops on it and ends the workers (a spawned child's signal mask
        # and handlers are reset at its exec, so stderr is what can be set before it starts).
        log, stderr = tempfile.TemporaryFile(), os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            proc.start()
        finally:
            os.dup2(stderr, 2)
            os.close(stderr)
        child.close()
        pool.append(_Worker(proc, parent, task=-1, deadline=time.monotonic() + _START_TIMEOUT_S, stderr=log))

    def assign(w: _Worker) -> None:
        w.task = pending.popleft() if pending else None
        if w.task is not None:
            w.conn.send((w.task, tasks[w.task]))
            w.deadline = time.monotonic() + timeout_s

    def retire(w: _Worker, outcome: tuple[str, Any]) -> None:
        w.proc.kill()
        w.proc.join()
        w.conn.close()
        pool.remove(w)
        if w.task == -1:
            w.stderr.seek(0)
            said = w.stderr.read().decode(errors="replace").strip().splitlines()[-1:]
            raise RuntimeError(f"a probe worker process did not start ({outcome[0]}, exit code "
                               f"{w.proc.exitcode}{': ' + said[0] if said else ''})")
        w.stderr.close()
        results[w.task] = outcome
        if on_done:
            on_done(w.task)
        if pending:
            start()

    try:
        for _ in range(min(workers, len(tasks))):
            start()
        while any(w.task is not None for w in pool):
            busy = [w for w in pool if w.task is not None]
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = connection.wait([w.conn for w in busy], timeout=wait_s)
            for w in busy:
                if w.conn in ready:
                    try:
                        message = w.conn.recv()
                    except (EOFError, OSError):
                        w.proc.join(5)
                        retire(w, ("crashed", w.proc.exitcode))
                        continue
                    if message == "ready":   # its stderr is /dev/null from here (_worker_main)
                        w.stderr.close()
                    else:
                        results[w.task] = message[1]
                        if on_done:
                            on_done(w.task)
                    assign(w)
                elif time.monotonic() >= w.deadline:
                    log.warning("task %d exceeded %.1fs; killing its worker process", w.task, timeout_s)
                    retire(w, ("timeout", None))
    finally:
        for w in pool:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in pool:
            w.proc.join(2)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
            w.conn.close()
    return results  # type: ignore[return-value]

