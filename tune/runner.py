"""The search, from parsed options to its summary: check everything on the driver before Ray
starts (`prepare`), take the search's lock, start Ray, check the cluster, size the trials, run
(or resume) the Tuner with the MLflow writer and the resource releaser, then report.

`tune/search.py` parses the flags and imports this module only then: it pulls in Ray, Optuna,
MLflow and torch, which `--help` and a bad flag do not need."""
from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
from ray import tune

from datasets.cache import FrameCache
from datasets.cache_fill import fill_cache
from datasets.flags import ConfigError
from datasets.index import VideoIndex, build_index
from trainer.batch_probe import BatchProbe, probe_batch_size
from trainer.config import TrainConfig
from trainer.gpus import simulated_gpus, train_device
from trainer.launch import (
    REPO_ROOT,
    check_batch_sizes,
    check_num_frames,
    check_writable_folder,
    init_ray,
    validate_config,
)
from trainer.lease import start_lease
from trainer.models import get_spec
from tune import cleanup, faults, space, trust
from tune.cluster import (
    AUTOSCALER_CONFIG,
    Fit,
    check_paths_on_every_node,
    driver_node_gpus,
    fit_to_cluster,
    read_capacity,
    trial_resources,
    waiting_line,
)
from tune.console import SearchConsole, keep_ray_lines_off_the_console, log_file_for, quiet_libraries
from tune.demo import ensure_demo_data
from tune.faults import DiskFullError
from tune.lock import SearchLock, check_not_running
from tune.options import SearchOptions
from tune.plots import plot_objective_vs_params, plot_scatter
from tune.ray_internals import (
    FINISHED_STATES,
    check_experiment_state,
    drop_unreadable_error_pickles,
    trial_states,
)
from tune.results import (
    TrialRow,
    best_trial,
    format_markdown,
    format_table,
    pareto_front,
    ranked,
    row_from_result,
    write_csv,
)
from tune.search import base_config
from tune.tracking import MLflowTracker, check_store_uri, git_commit, sqlite_path
from tune.trial import DRIVER_CPUS, make_trial_driver, short_name
from tune.trust import SignAfterSave, StateSigner

DEFAULT_STORAGE = "vidtune-results"


@dataclass(frozen=True)
class Plan:
    """The resolved search before Ray: options (dataset path resolved), the training run every
    trial starts from, where results go, and the driver's index of the videos."""

    opts: SearchOptions
    base: TrainConfig
    storage: str              # Tune storage root (absolute path or URI)
    name: str                 # experiment name (folder under storage)
    demo: bool
    index: VideoIndex | None = None   # the driver's index of the videos (None in tests that skip it)

    @property
    def experiment_path(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}"


def prepare(opts: SearchOptions) -> Plan:
    """The one validation on the driver, before Ray starts: no driver already running this
    search (tune/lock.py), options, training config, stores, storage, the dataset (indexed here,
    and every candidate batch size checked against the training videos each worker gets), the
    experiment name. Raises ConfigError / DataError
    naming the flag or file at fault; a plan that passes cannot fail for a reason known here."""
    storage = opts.storage or str(Path(DEFAULT_STORAGE).resolve())
    if "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
        check_writable_folder(storage, "--storage")
    if opts.name:   # first: a second driver on a running search stops in seconds, not after the checks
        check_not_running(f"{storage.rstrip('/')}/{opts.name}", "--resume" if opts.resume else "--name")
    demo = opts.demo
    if demo:
        root, made = ensure_demo_data()
        print(f"demo: {'generated' if made else 'using'} the synthetic dataset in {root}"
              " (pass --data PATH for your own videos)")
    else:
        root = Path(opts.train.data.root).expanduser().resolve()
    opts = replace(opts, train=opts.train.with_overrides(data=replace(opts.train.data, root=str(root))))
    base = base_config(opts)
    validate_config(base)
    if base.data.clip_cache and base.data.clip_cache_dir is not None:
        check_writable_folder(base.data.clip_cache_dir, "--cache-dir")
    check_store_uri(opts.tracking.mlflow_uri, "--mlflow-uri")
    if opts.optuna_storage and opts.optuna_storage.startswith("sqlite:"):
        check_store_uri(opts.optuna_storage, "--optuna-storage")
    name = experiment_name(opts, storage)
    index = index_data(base)
    check_num_frames(base, index)
    if opts.space.batch_sizes is not None:   # the defaults depend on the cluster: checked once it is up
        check_batch_sizes(opts.space.batch_sizes, len(index.train), opts.resources.workers_per_trial,
                          flag="--batch-sizes", workers_flag="--workers-per-trial")
    return Plan(opts=opts, base=base, storage=storage, name=name, demo=demo, index=index)


def experiment_name(o: SearchOptions, storage: str) -> str:
    """--name, or with --resume the latest restorable experiment in storage, else a new name."""
    if o.resume:
        if o.name:
            path = f"{storage.rstrip('/')}/{o.name}"
            if not tune.Tuner.can_restore(path):
                raise ConfigError("--resume", f"no interrupted search to continue at {path}; "
                                  "check --name and --storage")
            name = o.name
        else:
            if "://" in storage:
                raise ConfigError("--resume", "with remote --storage, also pass --name of the search to "
                                  "continue")
            found = sorted((p for p in Path(storage).glob("*")
                            if p.is_dir() and tune.Tuner.can_restore(str(p))),
                           key=lambda p: p.stat().st_mtime)
            if not found:
                raise ConfigError("--resume", f"no interrupted search to continue in {storage}; "
                                  "pass --storage (and --name)")
            name = found[-1].name
        check_resumable(f"{storage.rstrip('/')}/{name}", trust_state=o.trust_state)
        return name
    if o.name:
        if "://" not in storage and (Path(storage) / o.name).exists():
            raise ConfigError("--name", f"{Path(storage) / o.name} already exists; continue it with --resume "
                              "or pick another --name")
        return o.name
    return time.strftime("vidtune-%Y%m%d-%H%M%S")


def check_resumable(path: str, *, trust_state: bool) -> None:
    """Before anything of a search is unpickled: no live driver holds it (tune/lock.py), Tune's
    saved state parses, and this user's key signed every state file (tune/trust.py), unless
    --trust-state."""
    check_not_running(path, "--resume")
    try:
        check_experiment_state(path)
    except ValueError as e:
        raise ConfigError("--resume", unreadable_state(path, e)) from None
    if trust_state:
        print(f"--trust-state: loading the saved state at {path} without checking who wrote it; "
              "it is signed with your key from now on")
        return
    trust.verify(path)


def index_data(base: TrainConfig) -> VideoIndex:
    """Probe every video on the driver: fails fast (DataError) with the dropped-file report.
    Returns the VideoIndex the trials train on."""
    index = build_index(base.data)
    print(index.summary())
    return index


def describe(plan: Plan) -> str:
    """`--dry-run`'s printout: every option as resolved (the same names as the flags' fields),
    with what is decided later said so."""
    doc = plan.opts.to_dict()
    doc["experiment"] = plan.experiment_path
    doc["demo"] = plan.demo
    doc["early_stopping"] = "ASHA" if space.early_stopping_enabled(plan.opts) else "off"
    if doc["space"]["batch_sizes"] is None:
        doc["space"]["batch_sizes"] = "by device once Ray is up (CPU 4,8; GPU 8,16,32)"
    if doc["train"]["data"]["clip_cache_format"] == "auto":
        doc["train"]["data"]["clip_cache_format"] = "auto (jpeg when trials train on GPUs, else raw)"
    return "resolved configuration:\n" + json.dumps(doc, indent=2, default=list)


def execute(plan: Plan) -> int:
    """Lock the search (one driver per search), start Ray, check the cluster, run (or resume)
    the search, report; the lock goes when this returns or raises."""
    lock = SearchLock(plan.experiment_path, flag="--resume" if plan.opts.resume else "--name")
    lock.acquire()   # before Ray and before any file is written: a second driver stops in seconds
    try:
        return _execute(plan)
    finally:
        lock.release()


def _execute(plan: Plan) -> int:
    # A tracking server that stops answering must not hold the search: MLflow's client would
    # retry each call for minutes. One try, a short wait; tune/tracking.py catches up later.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    log_options, ray_lines = {}, None
    streams = sys.stdout, sys.stderr
    if not plan.opts.verbose:
        log = quiet_libraries(log_file_for(plan.experiment_path, plan.name))
        ray_lines = keep_ray_lines_off_the_console(log)
        print(f"logs: {log} (Ray's, Tune's and the libraries' messages; --verbose shows them here)",
              flush=True)
        log_options = {"log_to_driver": False, "configure_logging": False}
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")   # Tune's boxes and hints: not at verbose 0
    started, signer = False, None
    try:
        started = init_ray(address=plan.opts.resources.address, **log_options)
        # Tags Tune's state files as it saves them, so that a later --resume trusts them (tune/trust.py)
        signer = StateSigner(plan.experiment_path).start()
        return run_search(plan)
    finally:
        if signer is not None:
            signer.stop()
        if started:
            ray.shutdown()
        sys.stdout, sys.stderr = streams
        if ray_lines is not None:
            ray_lines.close()



def check_cluster(opts: SearchOptions) -> Fit:
    """Right after connecting, before any trial: `fit_to_cluster` on what the running Ray
    cluster offers, counting the nodes its autoscaler can start (on a cluster: `--address`)."""
    config = None
    if opts.resources.address is not None:
        config = Path(opts.resources.cluster_config) if opts.resources.cluster_config else AUTOSCALER_CONFIG
    capacity = read_capacity(config)
    fit = fit_to_cluster(opts, capacity)
    if fit.waits_for_nodes and capacity.may_add_gpus:
        print(waiting_line(capacity), flush=True)
    return fit


def probe_batch_sizes(opts: SearchOptions, base: TrainConfig) -> SearchOptions:
    """--probe-batch-size: drop batch sizes above the largest that fits, measured on a GPU."""
    if not opts.space.probe_batch_size:
        return opts
    if float(ray.cluster_resources().get("GPU", 0.0)) < 1:
        print("--probe-batch-size: no whole GPU in the cluster; batch sizes not capped")
        return opts

    @ray.remote(num_gpus=1)
    def probe(model: str, precision: str, frames: int | None, height: int | None, width: int | None,
              limit: int) -> BatchProbe:
        return probe_batch_size(model, precision=precision, device=train_device(), num_frames=frames,
                                height=height, width=width, limit=limit)

    d = base.data
    found = ray.get(probe.remote(opts.train.model, opts.train.precision, d.num_frames, d.height, d.width,
                                 max(opts.space.batch_sizes)))
    largest = found.batch_size
    kept = tuple(b for b in opts.space.batch_sizes if b <= largest)
    print(f"--probe-batch-size: {found.describe()}; searching batch sizes {kept}")
    if not kept:
        raise ConfigError("--batch-sizes", f"none of {list(opts.space.batch_sizes)} fits in GPU memory "
                          f"(largest: {largest}); pass smaller sizes or lower --num-frames/--height/--width")
    return replace(opts, space=replace(opts.space, batch_sizes=kept))


def fill_clip_cache(base: TrainConfig, index: VideoIndex | None, *, on_gpu: bool,
                    trains_here: bool = True) -> TrainConfig:
    """Decode every indexed video once into this node's clip cache before the first trial, so no
    trial's epoch 1 pays for decoding (other nodes of a cluster fill theirs on first read).
    Not when no trial trains on this node (`trains_here` False: the CPU head of a GPU cluster):
    the nodes that train fill their own caches. Returns `base` with the cache format resolved
    (auto: jpeg when trials train on GPUs, else raw), so every worker reads the same format."""
    d = base.data
    cache = FrameCache.from_config(d, on_gpu=on_gpu)
    if cache is None:
        return base
    base = base.with_overrides(data=replace(d, clip_cache_format=cache.format))
    if index is None:
        return base
    if not trains_here:
        print(f"clip cache: no trial trains on this node; each GPU node fills its own cache ({cache.root}) "
              "during its first epoch")
        return base
    spec = get_spec(base.model)
    height, width = d.height or spec.height, d.width or spec.width
    videos = list(index.train) + list(index.val)
    # Every video decoded once at the model's size before the first trial (its summary says so).
    print(fill_cache(videos, height=height, width=width, cache=cache).summary(cache))
    return base


def run_search(plan: Plan, *, trainer_factory: Callable[..., Any] | None = None) -> int:
    """Run the planned search to the end (or resume it); print and record the summary.
    `trainer_factory`: see `tune.trial.make_trial_driver` (tests)."""
    fit = check_cluster(plan.opts)
    opts, concurrency, local_gpu = fit.opts, fit.concurrency, fit.local_gpu
    if plan.opts.space.batch_sizes is None and plan.index is not None:
        # The hardware's default batch sizes, now known, against the videos (explicit ones were
        # checked before Ray started).
        check_batch_sizes(opts.space.batch_sizes, len(plan.index.train), opts.resources.workers_per_trial,
                          flag="--batch-sizes", workers_flag="--workers-per-trial")
    opts = probe_batch_sizes(opts, plan.base)
    resources = trial_resources(opts)
    check_paths_on_every_node(plan.storage, opts.train.weights)
    base = fill_clip_cache(plan.base, plan.index, on_gpu=resources.use_gpu,
                           trains_here=not resources.use_gpu or driver_node_gpus() > 0)
    base = base.with_overrides(batch_size=opts.space.batch_sizes[0])
    objective = space.objective_for(opts.objective)
    on = ""
    if fit.gpus:
        on = f" on {fit.gpus:g} GPU(s){' (simulated: training on the CPU)' if simulated_gpus() else ''}"
    print(f"search {plan.experiment_path}: {opts.num_samples} trial(s), {concurrency} at a time{on}"
          f"{' (local GPU mode)' if local_gpu else ''}; batch sizes {list(opts.space.batch_sizes)}, "
          f"lr {opts.space.lr_min:g}..{opts.space.lr_max:g}, objective {opts.objective}, "
          f"early stopping {'ASHA' if space.early_stopping_enabled(opts) else 'off'}")

    registry_name = f"vidtune-pg-registry-{plan.name}"
    lease_name = f"vidtune-device-lease-{plan.name}"
    # The registry and lease actors live as long as this process holds their handles.
    registry = cleanup.start_registry(registry_name)
    lease = start_lease(lease_name, capacity=resources.trainings_per_gpu, lead_slots=fit.lead_slots)
    tracker = make_tracker(plan, opts)
    driver = make_trial_driver(base, resources, train_storage=f"{plan.experiment_path}/train_runs",
                               registry_name=registry_name, lease_name=lease_name, index=plan.index,
                               trainer_factory=trainer_factory)
    trainable = tune.with_resources(driver, {"cpu": DRIVER_CPUS})
    param_space = space.param_space(opts)
    if opts.resume:
        try:
            check_experiment_state(plan.experiment_path)
        except ValueError as e:
            raise ConfigError("--resume", unreadable_state(plan.experiment_path, e)) from None
        for path in drop_unreadable_error_pickles(plan.experiment_path):
            print(f"resume: removed {path}, cut short (full disk?); the trial's error.txt stays")
        try:
            # Errored trials continue from their last checkpoint too (a full disk, a lost node);
            # out of memory is not an error (the trial ended normally with oom=1) and stays done.
            tuner = tune.Tuner.restore(plan.experiment_path, trainable=trainable, resume_unfinished=True,
                                       resume_errored=True, param_space=param_space)
        except Exception as e:   # a damaged state must stop the resume, never restart the search
            raise ConfigError("--resume", unreadable_state(plan.experiment_path, e)) from None
    else:
        tuner = tune.Tuner(
            trainable, param_space=param_space,
            tune_config=tune.TuneConfig(
                metric=objective.metric, mode=objective.mode, num_samples=opts.num_samples,
                search_alg=space.build_searcher(opts, objective, study_name=plan.name),
                scheduler=space.build_scheduler(opts), max_concurrent_trials=concurrency,
                # One readable name per trial: console, table, MLflow, trial and checkpoint folders.
                trial_name_creator=short_name, trial_dirname_creator=short_name,
                # A trial driver's process (Python, Ray, Tune, torch: ~3 s of CPU to start) serves
                # the next trial too; the driver keeps no state between trials. A stopped trial's
                # process is free once tune.cleanup has ended its Train run (see there).
                reuse_actors=True),
            run_config=tune.RunConfig(
                # Tune's own progress tables only with --verbose: SearchConsole prints vidtune's.
                name=plan.name, storage_path=plan.storage, verbose=1 if opts.verbose else 0,
                # A trial is not rerun by Tune: its Train run already restarted a dead worker group
                # (--max-failures), and out of memory is an answer, not a failure.
                failure_config=tune.FailureConfig(max_failures=0),
                callbacks=[tracker, cleanup.ReleaseTrialResources(registry_name, lease_name),
                           faults.InterruptWatch(), SignAfterSave(),
                           SearchConsole(num_samples=opts.num_samples, epochs=opts.train.epochs,
                                         objective=opts.objective, quiet=opts.quiet)]),
        )
    results, failure = None, None
    announce_mlflow(tracker)
    faults.install()   # Ctrl-C / SIGTERM: Tune's graceful stop, remembered (tune/faults.py)
    try:
        results = tuner.fit()
    except Exception as e:
        failure = e
    finally:
        faults.uninstall()
        code = summarise(plan, opts, results, tracker, failed=failure is not None)
        del registry, lease
    if failure is not None:
        full = faults.disk_full(failure, plan.storage)
        if full:
            try:
                check_experiment_state(plan.experiment_path)
                then = (f"free space there (or pass another --storage and copy {plan.experiment_path} to "
                        "it), then continue the search with --resume; the epochs already checkpointed are "
                        "kept")
            except ValueError:
                then = ("the search's saved state was cut short, so it cannot be resumed: free space and "
                        "start a new search under another --name; the runs recorded so far stay in MLflow")
            raise DiskFullError(f"disk full at {plan.storage} ({full}): {then}") from None
        if opts.resume:
            raise ConfigError("--resume", unreadable_state(plan.experiment_path, failure)) from failure
        raise failure
    return code


def unreadable_state(experiment_path: str, error: BaseException) -> str:
    reason = faults.one_line(error)
    return (f"the saved state of the search at {experiment_path} cannot be read ({type(error).__name__}: "
            f"{reason}); it was damaged, e.g. by a full disk or a copy cut short. Nothing was restarted. "
            "Start a new search under another --name; this search's runs stay in MLflow as they are")


def make_tracker(plan: Plan, opts: SearchOptions) -> MLflowTracker:
    sp, res, train = opts.space, opts.resources, opts.train
    searched = {"batch_sizes": ",".join(map(str, sp.batch_sizes)), "lr_min": sp.lr_min, "lr_max": sp.lr_max}
    if sp.search_weight_decay:
        searched.update(weight_decay_min=sp.weight_decay_min, weight_decay_max=sp.weight_decay_max)
    commit = git_commit(REPO_ROOT)
    tags = {"vidtune.objective": opts.objective, "vidtune.kind": "search"}
    if commit:
        tags.update({"mlflow.source.git.commit": commit, "vidtune.git_commit": commit})
    gpus = (res.gpus_per_worker or 0.0) * res.workers_per_trial
    return MLflowTracker(
        tracking_uri=opts.tracking.mlflow_uri, experiment=opts.tracking.experiment,
        experiment_path=plan.experiment_path, epochs=train.epochs, parent_tags=tags,
        parent_params={**searched, "dataset": plan.base.data.root, "model": train.model,
                       "weights": train.weights, "objective": opts.objective, "epochs": train.epochs,
                       "num_samples": opts.num_samples, "seed": train.seed,
                       "workers_per_trial": res.workers_per_trial, "gpus_per_trial": gpus,
                       "precision": train.precision},
        child_params={"precision": train.precision, "model": train.model, "workers": res.workers_per_trial,
                      "gpus": gpus, "dataset": plan.base.data.root, "epochs": train.epochs},
    )


def summarise(plan: Plan, opts: SearchOptions, results: tune.ResultGrid | None, tracker: MLflowTracker, *,
              failed: bool = False) -> int:
    """Print the table / best / Pareto front / checkpoint; bring MLflow up to date (every epoch,
    final statuses, the parent's artifacts; KILLED when the search did not finish), or say what
    is pending when the store cannot be reached. Exit code: 0 with a best trial, 1 without, 130
    when interrupted. The last lines printed say how to compare, resume or flush. `failed`: the
    search ended in an exception, which the caller reports (no resume hint here)."""
    # --quiet sends everything before the summary away (tune.search.run); the summary still shows.
    say = functools.partial(print, file=sys.__stdout__ if opts.quiet else sys.stdout, flush=True)

    rows: list[TrialRow] = []
    pairs: list[tuple[TrialRow, tune.Result, str]] = []   # (row, Tune result, Train run folder)
    states: list[tuple[str, str]] = []
    if results is not None:
        states = trial_states(results)   # (trial id, Tune status), same order as the Results
        for (trial_id, status), result in zip(states, results, strict=True):
            # Tune marks the trials it stops on Ctrl-C TERMINATED, like finished ones (tune/faults.py)
            finished = status in FINISHED_STATES and not faults.trial_unfinished(trial_id)
            name = Path(result.path).name if result.path else trial_id   # the trial's folder: short_name
            train_run = f"{plan.experiment_path}/train_runs/{name}"
            row = row_from_result(result, trial_id=trial_id, epochs=opts.train.epochs, finished=finished,
                                         train_run=train_run, name=name)
            rows.append(row)
            pairs.append((row, result, train_run))
    interrupted = results is None or faults.STATE.interrupted or any(r.status == "UNFINISHED" for r in rows)
    if results is not None and not interrupted and len(rows) < opts.num_samples:
        # Tune ended with nothing left to run: a resume would not add the missing trials.
        say(f"\nnote: the search ended with {len(rows)} of {opts.num_samples} trials; its saved state had "
              "lost the others (e.g. cut short by a full disk). Start a new search to run more.")
    best = best_trial(rows, opts.objective)
    if rows:
        say("\ntrials:\n" +
            format_table(ranked(rows, opts.objective), show_wd=opts.space.search_weight_decay))
    if opts.objective == "pareto" and rows:
        front = pareto_front(rows)
        say("\nPareto front (val_acc vs clips/s):\n" +
            format_table(front, show_wd=opts.space.search_weight_decay))
    folder = results_folder(plan)
    files = write_results(plan, opts, rows, best, folder)
    pending = record_in_mlflow(plan, opts, tracker, rows, pairs, states, best, files, interrupted=interrupted)
    uri = opts.tracking.mlflow_uri
    resume = (f"python tune/search.py --resume --name {plan.name} --storage {plan.storage}"
              f"{'' if uri == 'sqlite:///mlruns.db' else ' --mlflow-uri ' + uri}")
    if best:
        wd = f"  weight_decay={best.weight_decay:.3g}" if best.weight_decay is not None else ""
        say(f"\nbest trial ({opts.objective}): {best.name or best.trial_id}  batch_size={best.batch_size}  "
            f"lr={best.lr:.3g}{wd}  val_acc={best.val_acc:.3f}  val_f1={best.val_f1:.3f} "
            f"(epoch {best.best_epoch})  clips/s={best.clips_per_s:.1f} (steady state)")
        say(f"best checkpoint: {best.checkpoint or 'none kept'}")
        if "best_config" in files:
            say(f"train it again: python -m trainer.train --config {files['best_config']}")
    if files:
        say(f"results: {files['trials_csv'].parent} (trials.csv, best_config.json, plots)")
    say(mlflow_lines(opts, tracker, pending))
    if pending:
        say(f"MLflow is not up to date: {pending}. Nothing is lost: every epoch of every trial is kept in "
            f"{plan.experiment_path}. Once the store answers, write it with:\n  {resume}")
    if interrupted and not failed:
        say(f"search interrupted; continue it with:\n  {resume}")
        return 130
    if not best and rows:
        say(no_usable_trial(opts, rows))
    return 0 if best else 1


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
                  folder: Path | None) -> dict[str, Path]:
    """The search's results as files: trials.csv (ranked by the objective), best_config.json
    (the best trial's row and its whole TrainConfig, which `trainer.train --config` reads) and
    the two plots. In `folder`, or a temporary folder when None or when `folder` cannot take
    them (a full disk): MLflow gets them either way."""
    if folder is not None:
        try:
            return _write_results(plan, opts, rows, best, folder)
        except OSError as e:
            print(f"note: the results could not be written to {folder} ({e.strerror or e}); "
                  "they go to MLflow only")
    return _write_results(plan, opts, rows, best, Path(tempfile.mkdtemp(prefix="vidtune-results-")))


def _write_results(plan: Plan, opts: SearchOptions, rows: list[TrialRow], best: TrialRow | None,
                   target: Path) -> dict[str, Path]:
    files = {"trials_csv": write_csv(rows, target / "trials.csv", objective=opts.objective),
             "scatter": plot_scatter(rows, target / "accuracy_vs_speed.png", title=plan.name),
             "params": plot_objective_vs_params(rows, target / "objective_vs_params.png",
                                                objective=opts.objective, title=plan.name)}
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
                     best: TrialRow | None, files: dict[str, Path], *, interrupted: bool) -> str | None:
    """Reconcile the child runs with Tune's results, log the parent's summary and end every run.
    Returns None when MLflow is up to date, else why it is not (the store failed)."""
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
                            best_checkpoint=best.checkpoint if best else None)
        tracker.publish_view(table_markdown=format_markdown(ranked(rows, opts.objective)),
                             best_trial_id=best.trial_id if best else None, objective=opts.objective)
        tracker.close(interrupted=interrupted)
    except Exception as e:   # the store is down or full: the search's own results stand
        reason = faults.one_line(e)
        return f"{opts.tracking.mlflow_uri} failed ({reason})"
    return None


def announce_mlflow(tracker: MLflowTracker) -> None:
    """Create (or find) the parent run now and print where the runs table is, so it can be
    opened while the search runs. A store that fails here is retried by the tracker later."""
    try:
        tracker.open_parent()
    except Exception as e:
        print(f"MLflow: cannot reach {tracker.tracking_uri} yet ({faults.one_line(e, 200)}); "
              "the runs are written when it answers")
        return
    print(f"MLflow runs table: {tracker.runs_table_url()}{ui_hint(tracker.tracking_uri)}", flush=True)


def ui_hint(uri: str) -> str:
    path = sqlite_path(uri)
    return f"  (after: mlflow ui --backend-store-uri sqlite:///{path})" if path is not None else ""


def mlflow_lines(opts: SearchOptions, tracker: MLflowTracker, pending: str | None) -> str:
    """The summary's last lines: the runs table and the parent run, ready to compare (the store's
    URI only, when MLflow is not up to date or its experiment is unknown)."""
    hint = ui_hint(opts.tracking.mlflow_uri)
    if not pending and getattr(tracker, "experiment_id", None):
        parent = tracker.run_url(tracker.parent_run_id)
        return (f"compare the trials in MLflow: {tracker.runs_table_url()}{hint}\n"
                f"  the search's run (trials table, best run, plots): {parent}")
    return f"compare the trials in MLflow: {opts.tracking.mlflow_uri}{hint}"
