"""Which failed trials Tune may run again.

Tune retries a failed trial (`FailureConfig(max_failures=--max-failures)`) so that a trial whose
node went away (a reclaimed spot instance hosting its driver and, beside it, its Train
controller) continues from its last checkpoint on another node instead of ending in ERROR. The
same retry would also rerun a trial that failed by itself (a bug, a broken video, a full disk, a
worker group that used up Train's own restarts), which fails again the same way. So the driver
notes such an error with the search's registry actor (`tune.running.cleanup`, on the search's own node,
gone with the search process), and a retry that finds the note fails at once with that error's
text. A `--resume` is a new search process with a new registry: it does retry them.
"""
from __future__ import annotations

import re
import traceback

import ray
import ray.exceptions

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


def _lost_names() -> set[str]:
    names, todo = set(), list(LOST)
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def names_lost_process(text: str) -> bool:
    """Whether a trial's error text (Tune's error.txt) names a lost actor, worker or node (one of
    LOST, or a subclass such as ActorDiedError): the error a --resume runs the trial again for."""
    return any(re.search(rf"\b{name}\b", text) for name in _lost_names())


def note_own_error(registry_name: str, trial_id: str, error: BaseException) -> None:
    """Tell the search's registry that trial `trial_id` failed by itself with `error`. Best
    effort: without the note, a retry trains the trial once more."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-20_000:]
    try:
        ray.get(ray.get_actor(registry_name).note_own_error.remote(trial_id, text), timeout=30)
    except Exception:   # the registry's trouble must not hide the trial's own error
        pass


def raise_if_failed_before(registry_name: str, trial_id: str) -> None:
    """Raise `TrialFailedBefore` where the registry holds an error of this trial's own."""
    try:
        first_error = ray.get(ray.get_actor(registry_name).own_error.remote(trial_id), timeout=30)
    except Exception:
        return
    if first_error:
        # The first error's whole text ends this message, so its last line (what the console and
        # MLflow show of a failed trial: tune.running.faults.exception_line) is the first error's own.
        raise TrialFailedBefore("this trial failed by itself earlier in this search and is not trained "
                                f"again (only a lost node's trials are); its error:\n{first_error}")
