"""Where a search's log lines go: the libraries' log records and warnings to the search's log
file (`quiet_libraries`, in the experiment folder: `log_file_for`), and the lines Ray prints on the
driver's own streams too (`keep_ray_lines_off_the_console`), so that the console keeps only
vidtune's lines (`tune.outputs.console`). `--verbose` skips all of it.
"""
from __future__ import annotations

import io
import logging
import re
import sys
import warnings
from pathlib import Path
from typing import TextIO

# Each library configures its loggers when imported: `quiet_libraries` redirects them after.
import mlflow  # noqa: F401
import optuna

# Loggers whose records go to the log file, not the console.
LIBRARY_LOGGERS = ("ray", "mlflow", "optuna", "alembic", "urllib3", "filelock", "py.warnings", "matplotlib")
LOG_FILE = "search.log"


def log_file_for(experiment_path: str, name: str) -> Path:
    """The search's log file: in its experiment folder, or ./vidtune-logs/NAME.log when the
    experiment is on remote storage (s3://)."""
    if "://" in experiment_path:
        return Path("vidtune-logs") / f"{name}.log"
    return Path(experiment_path) / LOG_FILE


def quiet_libraries(log_path: Path) -> Path:
    """Send the libraries' log records (INFO and up) and Python warnings to `log_path`, none to
    the console. Call before `ray.init` (with `configure_logging=False`, `log_to_driver=False`)."""
    optuna.logging.disable_default_handler()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # On the root logger: `ray.init` empties the "ray" logger's handlers, and its records then
    # reach the root (a handler on "ray" itself would be gone, and Python's last-resort handler
    # would print its warnings on the console).
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.setLevel(logging.INFO)
        logger.propagate = True
    # The log may sit on a disk that fills up (--storage): a record that cannot be written is
    # dropped, not reported with a traceback on the console.
    logging.raiseExceptions = False
    logging.captureWarnings(True)
    warnings.simplefilter("default")
    return log_path


# What Ray prints on the driver's own streams, bypassing logging: the raylet's warnings and the
# workers' lines, prefixed `(raylet)` or `(Name pid=123)` (with colour codes on a terminal).
RAY_PREFIX = re.compile(r"^(\x1b\[[0-9;]*m)*\((raylet|[\w.]*\s*pid=\d+[^)]*)\)")


class RayLinesToLog(io.TextIOBase):
    """A stdout/stderr stand-in that sends Ray's prefixed lines (see RAY_PREFIX) to the log file
    and everything else to the console."""

    def __init__(self, console: TextIO, log: TextIO):
        self.console, self.log, self._partial = console, log, ""

    def write(self, text: str) -> int:
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            if RAY_PREFIX.match(line):
                self._to_log(line + "\n")
            else:
                self.console.write(line + "\n")
        return len(text)

    def _to_log(self, text: str) -> None:
        try:
            self.log.write(text)
        except (OSError, ValueError):   # a full disk (or a closed log) must not stop the search
            pass

    def flush(self) -> None:
        if self._partial and not RAY_PREFIX.match(self._partial):
            self.console.write(self._partial)
            self._partial = ""
        self.console.flush()
        try:
            self.log.flush()
        except (OSError, ValueError):
            pass

    def isatty(self) -> bool:
        return self.console.isatty()

    def fileno(self) -> int:
        return self.console.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.console, "encoding", "utf-8")


def keep_ray_lines_off_the_console(log_path: Path) -> TextIO:
    """Replace sys.stdout/sys.stderr by `RayLinesToLog` filters writing Ray's lines to `log_path`.
    Returns that file, for the caller to close once it has put the streams back."""
    log = open(log_path, "a", encoding="utf-8", buffering=1)
    sys.stdout = RayLinesToLog(sys.stdout, log)
    sys.stderr = RayLinesToLog(sys.stderr, log)
    return log
