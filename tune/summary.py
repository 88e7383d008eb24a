"""The end of a search, computed from its results alone: `summarise` turns Tune's results into a
`Summary` (one row per trial, the answer, the best trial, the parameter importances) and writes
trials.csv, best_config.json and the plots; no MLflow. `tune.runner.run_search` calls it when the
Tuner returns, raises or is interrupted, hands the value to the MLflow tracker to record
(`tune.tracking.tracker.MLflowTracker.record_summary`), then `print_summary` prints the last
block, the answer first: the sentences a person acts on (`tune.answer.answer_lines`) and the
MLflow link to compare the trials; the trials by outcome and the total time; the trials table and
what its columns mean; the Pareto front; the best checkpoint; and how to train it again, resume
or flush."""
from __future__ import annotations

import functools
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ray import tune

from vidtune.atomic import atomic_path, write_atomically
from vidtune.servers import vidtune_line
from vidtune.tune import faults, searched
from vidtune.tune.answer import answer_lines
from vidtune.tune.budget import TimeBudget
from vidtune.tune.console import outcome_line
from vidtune.tune.importance import MIN_TRIALS, Importance, param_importances
from vidtune.tune.options import SearchOptions
from vidtune.tune.plots import plot_history, plot_objective_vs_params, plot_scatter
from vidtune.tune.preflight import Plan
from vidtune.tune.ray_internals import FINISHED_STATES, trial_states
from vidtune.tune.results import (
    TrialResult,
    best_trial,
    best_whole_checkpoint,
    named_record,
    objective_key,
    pareto_front,
    ranked,
    row_from_result,
)
from vidtune.tune.tables import column_notes, format_markdown, format_table, write_csv
from vidtune.tune.tracking.study import dashboard_line, save_study_note


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
    answer: list[str]              # the sentences a person acts on (`tune.answer.answer_lines`)
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


def summarise(plan: Plan, opts: SearchOptions, results: tune.ResultGrid | None) -> Summary:
    """The search's `Summary` from Tune's `results` (None: the Tuner raised or never returned),
    with its files written (`write_results`). Touches no MLflow store."""
    rows, trials, states = collect_rows(plan, opts, results)
    interrupted = results is None or faults.STATE.interrupted or any(r.status == "UNFINISHED" for r in rows)
    val_clips = len(plan.index.val) if plan.index is not None else 0
    answer = answer_lines(rows, objective=opts.objective, val_clips=val_clips,
                          domains=searched.domains(opts.space))
    best = best_trial(rows, opts.objective)
    checkpoint = best_whole_checkpoint(rows, best) if best else None
    importance = param_importances(rows, objective=opts.objective, space=opts.space)
    files = write_results(plan, opts, rows, best, results_folder(plan), val_clips=val_clips,
                          importance=importance, checkpoint=checkpoint)
    return Summary(objective=opts.objective, rows=rows, trials=trials, trial_states=states,
                   interrupted=interrupted, val_clips=val_clips, answer=answer, best=best,
                   checkpoint=checkpoint, importance=importance, files=files)


def print_summary(plan: Plan, opts: SearchOptions, summary: Summary, *, mlflow_links: str,
                  pending: str | None, failed: bool = False, budget: TimeBudget | None = None,
                  model: Sequence[str] = ()) -> int:
    """Print the last block (see the module docstring). Exit code: 0 with a best trial, 1
    without, 130 when interrupted. `mlflow_links`: the lines that follow the answer (the
    tracker's `summary_links`); `pending`: why MLflow is not up to date, None when it is (the
    tracker's `record_summary`). `failed`: the search ended in an exception, which the caller
    reports (no resume hint here). `budget`: the searcher's --time-budget wrapper, which says
    whether the budget ended the search. `model`: the lines saying where the best model is in
    MLflow and how to load and serve it, or why it is not there (`tune.best_model.log_best_model`)."""
    # --quiet sends everything before the summary away (tune.search.run); the summary still shows.
    say = functools.partial(print, file=sys.__stdout__ if opts.quiet else sys.stdout, flush=True)
    rows, best, files, val_clips = summary.rows, summary.best, summary.files, summary.val_clips
    interrupted, importance = summary.interrupted, summary.importance
    resume = resume_line(plan, opts)

    say("")   # the last block: the answer first
    for line in summary.answer:
        say(line)
    say(mlflow_links)
    study_name = opts.study_name or plan.name
    if study_line := dashboard_line(opts.optuna_storage, study_name):
        # the study's note in optuna-dashboard: this answer, these links, Optuna's trial numbers named
        save_study_note(opts.optuna_storage, study_name, answer=summary.answer, links=mlflow_links)
        say(study_line)
    say("\n" + outcome_line(rows, time.time() - plan.started_at))
    if importance.shares or opts.num_samples >= MIN_TRIALS:   # a short search was never going to have it
        say(importance.sentence())
    ended_by_budget = budget.summary_line(opts.num_samples) if budget is not None else None
    if ended_by_budget:
        say(ended_by_budget)
    elif not interrupted and len(rows) < opts.num_samples:   # not interrupted: Tune returned results
        # Tune ended with nothing left to run: a resume would not add the missing trials.
        say(f"note: the search ended with {len(rows)} of {opts.num_samples} trials; its saved state had "
            "lost the others (e.g. cut short by a full disk). Start a new search to run more.")
    if rows:
        say("\ntrials:\n" + format_table(ranked(rows, opts.objective), val_clips=val_clips))
        say("\n".join(column_notes(rows, val_clips=val_clips)))
    if opts.objective == "pareto" and rows:
        say("\nPareto front (val_acc vs clips/s):\n" +
            format_table(pareto_front(rows), val_clips=val_clips))
    say("")
    if best:
        say(checkpoint_line(best, summary.checkpoint))
        if "best_config" in files:
            say(f"train it again: {vidtune_line('train', '--config', str(files['best_config']))}")
    for line in model:
        say(line)
    if files:
        say(f"results: {files['trials_csv'].parent} (trials.csv, best_config.json, plots)")
    if pending:
        say(f"MLflow is not up to date: {pending}. Nothing is lost: every epoch of every trial is kept in "
            f"{plan.experiment_path}. Once the store answers, write it with:\n  {resume}")
    if interrupted and not failed:
        say(f"search interrupted; continue it with:\n  {resume}")
        return 130
    if not best and rows:
        say(no_usable_trial(opts, rows))
    return 0 if best else 1


def resume_line(plan: Plan, opts: SearchOptions) -> str:
    """The command that continues this search; it runs as printed in a shell without the venv
    (`vidtune.servers`)."""
    uri = opts.tracking.mlflow_uri
    return vidtune_line("search", "--resume", "--name", plan.name, "--storage", str(plan.storage),
                        *(() if uri == "sqlite:///mlruns.db" else ("--mlflow-uri", uri)))


def checkpoint_line(best: TrialResult, checkpoint: TrialResult | None) -> str:
    """The summary's line naming the search's best whole checkpoint with its own trial, epoch and
    val_acc (and, when it is not the best trial's best epoch, why)."""
    if checkpoint is None:
        return "best checkpoint: none kept (no trial has a whole checkpoint)"
    own = (f"best checkpoint ({checkpoint.label}, epoch {checkpoint.checkpoint_epoch}, val_acc "
           f"{checkpoint.checkpoint_val_acc:.3f}): {checkpoint.checkpoint}")
    if checkpoint is best and checkpoint.checkpoint_epoch == best.best_epoch:
        return own
    return (f"{best.label}'s epoch {best.best_epoch} has no whole checkpoint; "
            f"the best whole one of the search: {own}")


def collect_rows(plan: Plan, opts: SearchOptions, results: tune.ResultGrid | None) -> tuple[
        list[TrialResult], list[tuple[TrialResult, tune.Result, str]], list[tuple[str, str]]]:
    """One TrialResult per trial of `results`, with its (row, Tune result, Train run folder) for
    MLflow and Tune's (trial id, status) pairs, in the Results' order."""
    rows: list[TrialResult] = []
    pairs: list[tuple[TrialResult, tune.Result, str]] = []
    states: list[tuple[str, str]] = []
    if results is None:
        return rows, pairs, states
    states = trial_states(results)
    for (trial_id, status), result in zip(states, results, strict=True):
        # Tune marks the trials it stops on Ctrl-C TERMINATED, like finished ones (tune/faults.py)
        finished = status in FINISHED_STATES and not faults.trial_unfinished(trial_id)
        name = Path(result.path).name if result.path else trial_id   # the trial's folder: short_name
        train_run = f"{plan.experiment_path}/train_runs/{name}"
        row = row_from_result(result, trial_id=trial_id, epochs=opts.train.epochs, finished=finished,
                              train_run=train_run, name=name, metric=objective_key(opts.objective))
        rows.append(row)
        pairs.append((row, result, train_run))
    return rows, pairs, states


# What to change when every trial ended one way (no_usable_trial).
NEXT_STEP = {"DIVERGED": "lower --lr-max (the loss became inf or NaN)",
             "OOM": "lower --batch-sizes, or pass --probe-batch-size on a GPU",
             "ERROR": "see each run's vidtune.failure_reason tag in MLflow and the search's log"}


def no_usable_trial(opts: SearchOptions, rows: list[TrialResult]) -> str:
    """Why a search ended without a best trial, and what to change: one line."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    ended = ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    steps = "; ".join(NEXT_STEP[status] for status in counts if status in NEXT_STEP)
    return f"no trial produced a usable result ({ended}){': ' + steps if steps else ''}"


# On remote storage (s3://, gs://) the results files are written here, under the search's name, as
# well as into its MLflow run: a local copy that `vidtune.load` (and the Python API) reads.
REMOTE_COPIES = Path(tempfile.gettempdir()) / "vidtune-results"


def results_folder(plan: Plan) -> Path | None:
    """Where trials.csv, best_config.json, the plots and search.json are written: the top of the
    search's folder (`tune.layout`); on remote storage a local copy, REMOTE_COPIES/<name> (the
    files are in MLflow too). None when that folder is not there (nor can be made)."""
    if "://" in plan.search_path:
        try:
            (REMOTE_COPIES / plan.name).mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        return REMOTE_COPIES / plan.name
    folder = Path(plan.search_path)
    return folder if folder.is_dir() else None


def write_results(plan: Plan, opts: SearchOptions, rows: list[TrialResult], best: TrialResult | None,
                  folder: Path | None, *, val_clips: int = 0, importance: Importance | None = None,
                  checkpoint: TrialResult | None = None) -> dict[str, Path]:
    """The search's results as files: trials.csv (ranked by the objective), best_config.json
    (the best trial's row and its whole TrainConfig, which `trainer.train --config` reads) and
    the three plots. In `folder`, or a temporary folder when None or when `folder` cannot take
    them (a full disk): MLflow gets them either way. `val_clips`: the validation set's size (the
    CSV's intervals); `importance`: its bar chart joins the plots when it was computed;
    `checkpoint`: the row of the search's best whole checkpoint, which best_config.json names."""
    if folder is not None:
        try:
            return _write_results(plan, opts, rows, best, folder, val_clips, importance, checkpoint)
        except OSError as e:
            print(f"note: the results could not be written to {folder} ({e.strerror or e}); "
                  "they go to MLflow only")
    temporary = Path(tempfile.mkdtemp(prefix="vidtune-results-"))
    return _write_results(plan, opts, rows, best, temporary, val_clips, importance, checkpoint)


def _write_results(plan: Plan, opts: SearchOptions, rows: list[TrialResult], best: TrialResult | None,
                   target: Path, val_clips: int, importance: Importance | None,
                   checkpoint: TrialResult | None) -> dict[str, Path]:
    with atomic_path(target / "trials.csv") as csv_tmp:   # a full disk leaves the old file, not a cut one
        write_csv(rows, csv_tmp, objective=opts.objective, val_clips=val_clips,
                  fixed={p.name: getattr(opts.train, p.name) for p in searched.PARAMS})
    files = {"trials_csv": target / "trials.csv",
             "history": plot_history(rows, target / "objective_history.png", objective=opts.objective,
                                     title=plan.name, val_clips=val_clips),
             "params": plot_objective_vs_params(rows, target / "objective_vs_params.png",
                                                objective=opts.objective, title=plan.name,
                                                val_clips=val_clips, domains=searched.domains(opts.space)),
             "scatter": plot_scatter(rows, target / "accuracy_vs_speed.png", title=plan.name,
                                     val_clips=val_clips),
             "importance": importance.plot(target / "param_importance.png", title=plan.name)
             if importance is not None else None}
    if best:
        doc = {**named_record(best), "objective": opts.objective, "search": plan.name,
               "train_config": plan.base.with_overrides(**{"batch_size": best.batch_size, "lr": best.lr,
                                                           **best.params}).to_dict(),
               # the search's best whole checkpoint, with its own trial, epoch and val_acc
               "checkpoint": checkpoint.checkpoint if checkpoint else None,
               "checkpoint_trial": checkpoint.name if checkpoint else None,
               "checkpoint_epoch": checkpoint.checkpoint_epoch if checkpoint else 0,
               "checkpoint_val_acc": checkpoint.checkpoint_val_acc if checkpoint else None}
        files["best_config"] = write_atomically(target / "best_config.json",
                                                json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")
    return {k: v for k, v in files.items() if v}
