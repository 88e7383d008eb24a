"""What a search found, as a plain value (`Summary`): made at the search's end by
`tune.summary.summarise`, shown by the console's last block, recorded in MLflow by the tracker
(`tune.tracking.tracker.MLflowTracker.record_summary`) and registered by `tune.best_model`. Here,
in the outputs room, so that MLflow's room reads it without importing the search's hub."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ray import tune

from vidtune.tune.outputs.importance import Importance
from vidtune.tune.outputs.results import TrialResult, ranked
from vidtune.tune.outputs.tables import format_markdown


@dataclass(frozen=True)
class Summary:
    """What a search found, as a plain value: what the console's last block shows and what the
    tracker records in MLflow. The files in `files` are written when it is made."""

    objective: str                 # the search's --objective: ranks the rows, chose `best`
    rows: list[TrialResult]           # one per trial, in the Results' order
    # (row, Tune result, Train run folder) per trial: what MLflow's reconcile writes epochs from
    trials: list[tuple[TrialResult, tune.Result, str]]
    trial_states: list[tuple[str, str]]   # Tune's (trial id, status) of every trial it knows
    interrupted: bool              # Ctrl-C / SIGTERM, or no results at all: continue with --resume
    val_clips: int                 # the validation set's size: the accuracies' 95% intervals (0: none)
    answer: list[str]              # the sentences a person acts on (`tune.outputs.answer.answer_lines`)
    best: TrialResult | None          # by the objective; None without a usable trial
    # The row whose checkpoint is the search's best whole one (`best_whole_checkpoint`): `best`,
    # unless its best epoch's checkpoint is damaged or gone
    checkpoint: TrialResult | None
    importance: Importance         # the searched parameters' shares (fANOVA), or why there are none
    files: dict[str, Path]         # trials_csv, best_config, history, params, scatter, importance

    @property
    def trials_ended(self) -> int:
        """The trials that ran to an end (not UNFINISHED: a --resume continues those)."""
        return sum(r.status != "UNFINISHED" for r in self.rows)

    @property
    def table_markdown(self) -> str:
        """The trials table, ranked by the objective, as MLflow's description shows it."""
        return format_markdown(ranked(self.rows, self.objective), self.val_clips)
