"""The end of a search: what it tells the user and MLflow. `summarise` writes trials.csv,
best_config.json and the plots, brings MLflow up to date (every epoch, final statuses, the
parent's artifacts), then prints the last block, the answer first: the sentences a person acts
on (`tune.answer.answer_lines`) and the MLflow link to compare the trials; the trials by outcome
and the total time; the trials table and what its columns mean; the Pareto front; the best
checkpoint; and how to train it again, resume or flush. `tune.runner.run_search` calls it when
the Tuner returns, raises or is interrupted."""
from __future__ import annotations

import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil
from ray import tune

from vidtune.tune import faults
from vidtune.tune.answer import SearchedRange, answer_lines
from vidtune.tune.budget import TimeBudget
from vidtune.tune.console import outcome_line
from vidtune.tune.importance import MIN_TRIALS, Importance, param_importances
from vidtune.tune.mlflow_store import sqlite_path
from vidtune.tune.options import SearchOptions
from vidtune.tune.plots import plot_history, plot_objective_vs_params, plot_scatter
from vidtune.tune.preflight import Plan
from vidtune.tune.ray_internals import FINISHED_STATES, trial_states
from vidtune.tune.results import TrialRow, best_trial, pareto_front, ranked, row_from_result
from vidtune.tune.tables import column_notes, format_markdown, format_table, write_csv
from vidtune.tune.tracking import MLflowTracker


def summarise(plan: Plan, opts: SearchOptions, results: tune.ResultGrid | None, tracker: MLflowTracker, *,
              failed: bool = False, budget: TimeBudget | None = None) -> int:
    """Write the result files, bring MLflow up to date (KILLED when the search did not finish; or
    say what is pending when the store cannot be reached), then print the last block (see the
    module docstring). Exit code: 0 with a best trial, 1 without, 130 when interrupted. `failed`:
    the search ended in an exception, which the caller reports (no resume hint here). `budget`:
    the searcher's --time-budget wrapper, which says whether the budget ended the search."""
    # --quiet sends everything before the summary away (tune.search.run); the summary still shows.
    say = functools.partial(print, file=sys.__stdout__ if opts.quiet else sys.stdout, flush=True)
    rows, pairs, states = collect_rows(plan, opts, results)
    interrupted = results is None or faults.STATE.interrupted or any(r.status == "UNFINISHED" for r in rows)
    val_clips = len(plan.index.val) if plan.index is not None else 0
    searched = SearchedRange(lr_min=opts.space.lr_min, lr_max=opts.space.lr_max,
                             batch_sizes=tuple(opts.space.batch_sizes or ()))
    answer = answer_lines(rows, objective=opts.objective, val_clips=val_clips, searched=searched)
    best = best_trial(rows, opts.objective)
    importance = param_importances(rows, objective=opts.objective, space=opts.space)
    files = write_results(plan, opts, rows, best, results_folder(plan), val_clips=val_clips,
                          importance=importance)
    pending = record_in_mlflow(plan, opts, tracker, rows, pairs, states, best, files, interrupted=interrupted,
                               val_clips=val_clips, answer=answer, importance=importance)
    uri = opts.tracking.mlflow_uri
    resume = (f"vidtune search --resume --name {plan.name} --storage {plan.storage}"
              f"{'' if uri == 'sqlite:///mlruns.db' else ' --mlflow-uri ' + uri}")

    say("")   # the last block: the answer first
    for line in answer:
        say(line)
    say(mlflow_lines(opts, tracker, pending))
    say("\n" + outcome_line(rows, time.time() - psutil.Process().create_time()))
    if importance.shares or opts.num_samples >= MIN_TRIALS:   # a short search was never going to have it
        say(importance.sentence())
    ended_by_budget = budget.summary_line(opts.num_samples) if budget is not None else None
    if ended_by_budget:
        say(ended_by_budget)
    elif results is not None and not interrupted and len(rows) < opts.num_samples:
        # Tune ended with nothing left to run: a resume would not add the missing trials.
        say(f"note: the search ended with {len(rows)} of {opts.num_samples} trials; its saved state had "
            "lost the others (e.g. cut short by a full disk). Start a new search to run more.")
    if rows:
        say("\ntrials:\n" + format_table(
            ranked(rows, opts.objective), show_wd=opts.space.search_weight_decay, val_clips=val_clips))
        say("\n".join(column_notes(rows, val_clips=val_clips)))
    if opts.objective == "pareto" and rows:
        say("\nPareto front (val_acc vs clips/s):\n" +
            format_table(pareto_front(rows), show_wd=opts.space.search_weight_decay, val_clips=val_clips))
    say("")
    if best:
        say(f"best checkpoint ({best.label}, epoch {best.best_epoch}): {best.checkpoint or 'none kept'}")
        if "best_config" in files:
            say(f"train it again: vidtune train --config {files['best_config']}")
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


def collect_rows(plan: Plan, opts: SearchOptions, results: tune.ResultGrid | None
                 ) -> tuple[list[TrialRow], list[tuple[TrialRow, tune.Result, str]], list[tuple[str, str]]]:
    """One TrialRow per trial of `results`, with its (row, Tune result, Train run folder) for
    MLflow and Tune's (trial id, status) pairs, in the Results' order."""
    rows: list[TrialRow] = []
    pairs: list[tuple[TrialRow, tune.Result, str]] = []
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
                              train_run=train_run, name=name)
        rows.append(row)
        pairs.append((row, result, train_run))
    return rows, pairs, states


# What to change when every trial ended one way (no_usable_trial).
NEXT_STEP = {"DIVERGED": "lower --lr-max (the loss became inf or NaN)",
             "OOM": "lower --batch-sizes, or pass --probe-batch-size on a GPU",
             "ERROR": "see each run's vidtune.failure_reason tag in MLflow and the search's log"}


def no_usable_trial(opts: SearchOptions, rows: list[TrialRow]) -> str:
    """Why a search ended without a best trial, and what to change: one line."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    ended = ", ".join(f"{n} {status}" for status, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    steps = "; ".join(NEXT_STEP[status] for status in counts if status in NEXT_STEP)
    return f"no trial produced a usable result ({ended}){': ' + steps if steps else ''}"


def results_folder(plan: Plan) -> Path | None:
    """Where trials.csv, best_config.json and the plots are written: the experiment folder (None
    on remote storage: they are in MLflow only)."""
    if "://" in plan.experiment_path:
        return None
    folder = Path(plan.experiment_path)
    return folder if folder.is_dir() else None


def write_results(plan: Plan, opts: SearchOptions, rows: list[TrialRow], best: TrialRow | None,
                  folder: Path | None, *, val_clips: int = 0,
                  importance: Importance | None = None) -> dict[str, Path]:
    """The search's results as files: trials.csv (ranked by the objective), best_config.json
    (the best trial's row and its whole TrainConfig, which `trainer.train --config` reads) and
    the three plots. In `folder`, or a temporary folder when None or when `folder` cannot take
    them (a full disk): MLflow gets them either way. `val_clips`: the validation set's size (the
    CSV's intervals); `importance`: its bar chart joins the plots when it was computed."""
    if folder is not None:
        try:
            return _write_results(plan, opts, rows, best, folder, val_clips, importance)
        except OSError as e:
            print(f"note: the results could not be written to {folder} ({e.strerror or e}); "
                  "they go to MLflow only")
    temporary = Path(tempfile.mkdtemp(prefix="vidtune-results-"))
    return _write_results(plan, opts, rows, best, temporary, val_clips, importance)


def _write_results(plan: Plan, opts: SearchOptions, rows: list[TrialRow], best: TrialRow | None,
                   target: Path, val_clips: int, importance: Importance | None) -> dict[str, Path]:
    files = {"trials_csv": write_csv(rows, target / "trials.csv", objective=opts.objective,
                                     val_clips=val_clips),
             "history": plot_history(rows, target / "objective_history.png", objective=opts.objective,
                                     title=plan.name),
             "params": plot_objective_vs_params(rows, target / "objective_vs_params.png",
                                                objective=opts.objective, title=plan.name),
             "scatter": plot_scatter(rows, target / "accuracy_vs_speed.png", title=plan.name),
             "importance": importance.plot(target / "param_importance.png", title=plan.name)
             if importance is not None else None}
    if best:
        wd = {"weight_decay": best.weight_decay} if best.weight_decay is not None else {}
        doc = {**best.__dict__, "objective": opts.objective, "search": plan.name,
               "train_config": plan.base.with_overrides(batch_size=best.batch_size, lr=best.lr,
                                                        **wd).to_dict()}
        path = target / "best_config.json"
        path.write_text(json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")
        files["best_config"] = path
    return {k: v for k, v in files.items() if v}


def record_in_mlflow(plan: Plan, opts: SearchOptions, tracker: MLflowTracker, rows: list[TrialRow],
                     pairs: list[tuple[TrialRow, tune.Result, str]], states: list[tuple[str, str]],
                     best: TrialRow | None, files: dict[str, Path], *, interrupted: bool, val_clips: int = 0,
                     answer: list[str] | None = None, importance: Importance | None = None) -> str | None:
    """Reconcile the child runs with Tune's results, log the parent's summary (the trials table
    with `val_clips`' intervals; `answer`: the sentences that open the description) and end every
    run. Returns None when MLflow is up to date, else why it is not (the store failed)."""
    try:
        tracker.open_parent(refresh=True)
        if states:
            lost = tracker.retire_lost_runs({trial_id for trial_id, _ in states})
            if lost:
                print(f"MLflow: {len(lost)} run(s) of trials lost when the earlier driver died moved to the "
                      f"trash: {lost}")
        written = tracker.reconcile(pairs)
        if written:
            print(f"MLflow: wrote {written} epoch(s) it had missed (from the search's saved results)")
        tracker.log_summary(files=list(files.values()), best=best.__dict__ if best else None,
                            best_checkpoint=best.checkpoint if best else None,
                            metrics=importance.metrics() if importance is not None else None)
        tracker.publish_view(table_markdown=format_markdown(ranked(rows, opts.objective), val_clips),
                             best_trial_id=best.trial_id if best else None, objective=opts.objective,
                             answer=answer or ())
        tracker.close(interrupted=interrupted)
    except Exception as e:   # the store is down or full: the search's own results stand
        reason = faults.one_line(e)
        return f"{opts.tracking.mlflow_uri} failed ({reason})"
    return None


def ui_hint(uri: str) -> str:
    path = sqlite_path(uri)
    return f"  (after: mlflow ui --backend-store-uri sqlite:///{path})" if path is not None else ""


def mlflow_lines(opts: SearchOptions, tracker: MLflowTracker, pending: str | None) -> str:
    """The links that follow the answer: the runs table, ready to compare, and the parent run
    (the store's URI only, when MLflow is not up to date or its experiment is unknown)."""
    hint = ui_hint(opts.tracking.mlflow_uri)
    if not pending and getattr(tracker, "experiment_id", None):
        parent = tracker.run_url(tracker.parent_run_id)
        return (f"compare the trials in MLflow: {tracker.runs_table_url()}{hint}\n"
                f"  the search's run (answer, trials table, plots): {parent}")
    return f"compare the trials in MLflow: {opts.tracking.mlflow_uri}{hint}"
