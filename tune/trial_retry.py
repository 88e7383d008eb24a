"""Which failed trials Tune may run again.

Tune retries a failed trial (`FailureConfig(max_failures=--max-failures)`) so that a trial whose
node went away (a reclaimed spot instance hosting its driver and, beside it, its Train
controller) continues from its last checkpoint on another node instead of ending in ERROR. The
same retry would also rerun a trial that failed by itself (a bug, a broken video, a worker group
that used up Train's own restarts), which fails again the same way: the driver records such an
error under the trial's Train run folder, and a retry within the same search process that finds
the record fails at once with it. A `--resume` is a new search process: it does retry them.
"""
from __future__ import annotations

import traceback

import pyarrow.fs
import ray.exceptions

OWN_ERROR_FILE = "vidtune_own_error.txt"

# Errors that say a process or node was lost, not that the trial's code failed.
LOST = (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError,
        ray.exceptions.OwnerDiedError, ray.exceptions.WorkerCrashedError)


class TrialFailedBefore(RuntimeError):
    """A retried trial whose earlier attempt in this search process failed by itself."""


def is_lost_process(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, is a lost actor, worker or node."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, LOST):
            return True
        # Train's ControllerError carries the controller's exception as an attribute.
        current = getattr(current, "controller_failure", None) or current.__cause__ or current.__context__
    return False


def _where(run_path: str) -> tuple[pyarrow.fs.FileSystem, str]:
    fs, path = pyarrow.fs.FileSystem.from_uri(run_path)
    return fs, f"{path.rstrip('/')}/{OWN_ERROR_FILE}"


def record_own_error(run_path: str, attempt: str, error: BaseException) -> None:
    """Note that the trial whose Train run lives at `run_path` failed by itself in search
    process `attempt`. Best effort: without the note a retry reruns the trial once more."""
    try:
        fs, path = _where(run_path)
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(path) as out:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            out.write(f"{attempt}\n{text[-20_000:]}".encode())
    except Exception:   # a full disk or lost storage must not hide the trial's own error
        pass


def raise_if_failed_before(run_path: str, attempt: str) -> None:
    """Raise `TrialFailedBefore` where search process `attempt` recorded this trial's own error."""
    try:
        fs, path = _where(run_path)
        with fs.open_input_stream(path) as f:
            text = f.read().decode(errors="replace")
    except (FileNotFoundError, OSError):
        return
    recorded, _, first_error = text.partition("\n")
    if recorded == attempt:
        # The first error's whole text ends this message, so its last line (what the console and
        # MLflow show of a failed trial: tune.faults.exception_line) is the first error's own.
        raise TrialFailedBefore("this trial failed by itself earlier in this search and is not trained "
                                f"again (only a lost node's trials are); its error:\n{first_error}")
