"""The errors vidtune raises to a person, the one way a decoder's exception is shortened for the
data layer, and how a full disk is told from an exception, wherever it was raised.

Every error a user can act on derives from `VidtuneError`: `ConfigError` (an option: a flag, a
config file's key, a keyword of `vidtune.search`), `DataError` (the videos), and, where they are
raised, `RayStartError` (Ray cannot start here) and `DiskFullError` (the search's storage is full).
`SearchInterrupted` is a KeyboardInterrupt: Ctrl-C (or a notebook kernel's interrupt) stopped a
search from Python, which keeps what it had and continues with `resume=True`.
"""
from __future__ import annotations

import errno
from typing import Any


class VidtuneError(Exception):
    """An error whose message names what is at fault (a flag, option, file or folder) and says what
    to do. The `vidtune` command prints it in one line; the Python API raises it."""


class ConfigError(VidtuneError, ValueError):
    """An option cannot be used. `flag` names it as the user gave it: a CLI flag, a config file's
    key and file, or a keyword of the Python API; the message says what to do."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


class DataError(VidtuneError, ValueError):
    """Input data cannot be used. The message names the file or folder at fault and says what to do."""


class SearchInterrupted(KeyboardInterrupt):
    """A search run from Python was interrupted (Ctrl-C, a notebook kernel's interrupt, SIGTERM)
    and stopped as the command does: its trials' checkpoints, trials.csv and MLflow runs are kept.
    `result`: the search as it stood (`vidtune.SearchResult`, or None when it had written
    nothing yet); `vidtune.search(..., resume=True)` with the same name and storage continues it."""

    def __init__(self, message: str, result: Any = None):
        super().__init__(message)
        self.result = result


def decoder_reason(e: BaseException) -> str:
    """The useful last line of a decord (FFmpeg) error, without its C++ source location."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    if lines[-1].startswith("Error reading "):   # decord's whole message when FFmpeg rejects the file
        return "not a video format FFmpeg recognises, or the file is damaged"
    text = lines[-1].split("] ", 1)[-1]
    text = text.split(": ", 1)[-1] if ".cc:" in text else text
    return text[:160]


def no_space_left(error: BaseException | None) -> str | None:
    """The message that says `error` is a full disk (errno 28, ENOSPC), or None: an OSError with
    that errno along its cause/context chain, or that error's text in its message (an error raised
    in a Ray worker reaches the driver and Train's controller as text)."""
    e, seen = error, 0
    while e is not None and seen < 20:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return str(e)
        e = e.__cause__ or e.__context__
        seen += 1
    text = str(error or "")
    if "No space left on device" in text or "[Errno 28]" in text or "errno 28" in text:
        return "No space left on device"
    return None
