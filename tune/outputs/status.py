"""A trial's outcome, declared once: its name (the table, `trials.csv`, Tune's status column),
its word (the console's end count, MLflow's `vidtune.outcome` tag, the Optuna study's user
attribute) and what it means (the legend under the trials table)."""
from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    """`Status.DONE == "DONE"`: a plain string wherever one is read or written."""

    word: str
    meaning: str

    def __new__(cls, name: str, word: str, meaning: str) -> Status:
        member = str.__new__(cls, name)
        member._value_ = name
        member.word = word
        member.meaning = meaning
        return member

    DONE = "DONE", "done", "all epochs"
    STOPPED = "STOPPED", "stopped early", "stopped early by ASHA"
    OOM = "OOM", "out of memory", "out of memory"
    DIVERGED = "DIVERGED", "diverged", "loss inf/NaN (lr too high)"
    ERROR = "ERROR", "failed", "raised an error"
    UNFINISHED = "UNFINISHED", "interrupted", "interrupted (--resume continues it)"


# The statuses whose trials have a value of their own (warm start, parameter importance).
WITH_RESULT = (Status.DONE, Status.STOPPED)


def word_of(status: str) -> str:
    """The outcome word of `status` (a Status or its name); an unknown name, lower-cased."""
    return Status(status).word if status in Status.__members__ else status.lower()
