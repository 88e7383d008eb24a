"""A finished search is left as it is: `--resume` of one changes nothing.

Tune would restore a finished experiment and end it again at once, but not without writing: new
state files, trials.csv, best_config.json and the plots rewritten, the device lease's record
emptied, the best checkpoint registered again as a new MLflow model version (moving `@best`). So
`tune.preflight.prepare` asks `finished_search` first, before Ray starts, the dataset is indexed
or any file is written, and a finished search's resume prints `finished_line` and exits with the
search's own code (`tune.search.run_search`); `vidtune.search(..., resume=True)` returns its
`SearchResult`.

Finished means both records agree:
- vidtune's, `search.json` (`tune.state.search_record`), written when the search ended: not
  interrupted (Ctrl-C, SIGTERM, a trial cut off, a failure such as a full disk) and MLflow up to
  date (else a resume is what writes it);
- Tune's, its newest saved experiment state (`tune.running.ray_internals.saved_trials`): every trial
  ended (TERMINATED or ERROR; a driver killed with -9 leaves them PENDING) and no errored trial
  that a resume would run again for a reason of its own (a lost node: `tune.running.trial_retry`).
A search that ended by its --time-budget is finished: its trials all ended, fewer than
--num-samples. Local storage only: on remote storage there is no search.json and a resume runs.
"""
from __future__ import annotations

from pathlib import Path

from vidtune.tune.config import layout
from vidtune.tune.running.faults import read_error_file
from vidtune.tune.running.ray_internals import ERROR, FINISHED_STATES, saved_trials
from vidtune.tune.running.trial_retry import names_lost_process
from vidtune.tune.state import search_record
from vidtune.tune.state.search_record import SearchRecord


def finished_search(search_path: str) -> SearchRecord | None:
    """The record of the search at `search_path` (its folder) when it is finished (see the module
    docstring), else None: a resume has something to do."""
    if "://" in search_path:
        return None
    try:
        record = search_record.read(search_path)
        trials = saved_trials(layout.state_path(search_path))
    except ValueError:     # a record or state this vidtune cannot read: the resume decides, as before
        return None
    if record is None or record.interrupted or record.exit_code == 130 or record.mlflow_pending:
        return None
    experiment = Path(layout.state_path(search_path))
    for trial in trials:
        if trial.status not in FINISHED_STATES:
            return None
        if trial.status == ERROR and trial.folder and trial.error_file and names_lost_process(
                read_error_file(str(experiment / trial.folder / trial.error_file))):
            return None
    return record


def finished_line(record: SearchRecord, search_path: str) -> str:
    """What a resume of a finished search prints: one line, the search, where its results are
    (`search_path`: its folder now, which a copied or moved search's record does not know)."""
    model = f"; its best model: {record.model_uri}" if record.model_uri else ""
    return (f"search {record.name} is finished (exit {record.exit_code}): nothing to resume, nothing was "
            f"changed. Its results: {search_path} (trials.csv, best_config.json, the plots){model}")
