"""Running the planned search on Ray: take the search's lock, start (or join) Ray, check the
cluster, size the trials, fill the clip cache, run (or resume) the Tuner with the MLflow writer,
the resource releaser and the console; then summarise the results (`tune.summary`, no MLflow),
have the tracker record that summary in MLflow, and print it. The plan comes from
`tune.preflight.prepare`, which checked everything that needs no Ray."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import ray
import ray.train
from ray import tune
from ray.tune import CLIReporter
from ray.tune.search import Searcher

from vidtune.atomic import write_atomically
from vidtune.atomic_fs import storage_filesystem
from vidtune.datasets.cache import FrameCache
from vidtune.datasets.index import VideoIndex
from vidtune.flags import ConfigError
from vidtune.trainer.cluster import kinetics, node_cache
from vidtune.trainer.cluster.lease import start_lease
from vidtune.trainer.cluster.node_setup import NodeSetup
from vidtune.trainer.models.registry import get_spec, kinetics_file
from vidtune.trainer.ray_setup.launch import check_batch_sizes, init_ray, joins_cluster
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.gpus import simulated_gpus
from vidtune.tune import best_model
from vidtune.tune.config import searched
from vidtune.tune.config.options import SearchOptions
from vidtune.tune.outputs.console import SearchConsole
from vidtune.tune.outputs.results import objective_key
from vidtune.tune.outputs.resume_line import announce_resume, resume_command
from vidtune.tune.outputs.search_log import (
    LOG_FILE,
    keep_ray_lines_off_the_console,
    log_file_for,
    quiet_libraries,
)
from vidtune.tune.preflight import Plan, unreadable_state
from vidtune.tune.running import cleanup, disk_full, faults
from vidtune.tune.running.budget import TimeBudget
from vidtune.tune.running.cluster import (
    AUTOSCALER_CONFIG,
    Fit,
    check_every_node,
    fit_to_cluster,
    read_capacity,
    trial_resources,
    waiting_line,
)
from vidtune.tune.running.faults import DiskFullError
from vidtune.tune.running.probe_sites import probe_each_kind, probe_sites
from vidtune.tune.running.ray_internals import (
    check_experiment_state,
    drop_unreadable_error_pickles,
    restored_searcher,
)
from vidtune.tune.running.trial import DRIVER_CPUS, make_trial_driver, short_name
from vidtune.tune.state import last_good, saved_options, search_record
from vidtune.tune.state.lock import SearchLock
from vidtune.tune.state.trust import SignAfterSave, StateSigner
from vidtune.tune.study import space
from vidtune.tune.summary import print_summary, summarise
from vidtune.tune.tracking.description import ui_hint
from vidtune.tune.tracking.runs import parent_tags
from vidtune.tune.tracking.tracker import MLflowTracker


def execute(plan: Plan) -> int:
    """Lock the search (one driver per search), start Ray, check the cluster, run (or resume) the
    search, report; the lock goes when this returns or raises (Ctrl-C: `faults.before_trials`)."""
    faults.reset()
    lock = SearchLock(plan.search_path, flag="--resume" if plan.opts.resume else "--name")
    lock.acquire()   # before Ray and before any file is written: a second driver stops in seconds
    try:
        return _execute(plan)
    except KeyboardInterrupt:   # before Tune's first saved state (Ray's start, the cache fill): said so
        if faults.STATE.tuner_started:
            raise
    finally:
        lock.release()
    raise faults.before_trials(plan.search_path, resume=plan.opts.resume) from None


def _execute(plan: Plan) -> int:
    # A tracking server that stops answering must not hold the search: one try, a short wait, caught up later
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    log_options, ray_lines, streams = {}, None, (sys.stdout, sys.stderr)
    if not plan.opts.verbose:
        log = quiet_libraries(log_file_for(plan.search_path, plan.name))
        ray_lines = keep_ray_lines_off_the_console(log)
        print(f"logs: {log} (Ray's, Tune's and the libraries' messages; --verbose shows them here)",
              flush=True)
        log_options = {"log_to_driver": False, "configure_logging": False}
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")   # Tune's boxes and hints: not at verbose 0
    started, signer, ray_was_up = False, None, ray.is_initialized()
    try:
        started = init_ray(address=plan.opts.resources.address, ray_start=plan.opts.resources.ray_start,
                           **log_options)
        # Tags Tune's state files as it saves them, so that a later --resume trusts them (tune/state/trust.py)
        signer = StateSigner(plan.experiment_path).start()
        return run_search(plan)
    finally:
        if signer is not None:
            signer.stop()
        if started or not ray_was_up and ray.is_initialized():   # Ctrl-C may land before init_ray returns
            ray.shutdown()
        sys.stdout, sys.stderr = streams
        if ray_lines is not None:
            # On a full disk the log's last buffered lines cannot be written; the search's own
            # error (disk full at ...) is the one to show, not this close's.
            with contextlib.suppress(OSError):
                ray_lines.close()


def check_cluster(opts: SearchOptions) -> Fit:
    """Right after connecting, before any trial: `fit_to_cluster` on what the running Ray
    cluster offers, counting the nodes its autoscaler can start (on a cluster: `--address`)."""
    config = None
    if joins_cluster(opts.resources.address):
        config = Path(opts.resources.cluster_config) if opts.resources.cluster_config else AUTOSCALER_CONFIG
    capacity = read_capacity(config)
    fit = fit_to_cluster(opts, capacity)
    if fit.waits_for_nodes and capacity.may_add_gpus:
        print(waiting_line(capacity), flush=True)
    return fit


def probe_batch_sizes(opts: SearchOptions, base: TrainConfig, fit: Fit | None = None) -> SearchOptions:
    """--probe-batch-size: drop batch sizes above the largest that fits in a trial's share of a GPU
    (--gpus-per-trial 0.5: half its memory), measured with the trials' precision, --channels-last
    and --compile on a GPU of each kind the cluster has (`tune.running.probe_sites`: the smallest
    cap wins); with none up yet but some to come (`fit.waits_for_nodes`), it waits for the first,
    saying so."""
    if not opts.space.probe_batch_size:
        return opts
    waits = fit is not None and fit.waits_for_nodes
    if float(ray.cluster_resources().get("GPU", 0.0)) < 1 and not waits:
        print("--probe-batch-size: no whole GPU in the cluster; batch sizes not capped")
        return opts
    per_worker = opts.resources.gpus_per_worker or 1.0
    share = per_worker if opts.resources.workers_per_trial == 1 and 0 < per_worker < 1 else 1.0
    d, t = base.data, opts.train
    sites = probe_sites(ray.nodes())
    if not sites:
        print("--probe-batch-size: waiting for the first GPU node to join, then probing on it", flush=True)
    asked = time.monotonic()
    found = probe_each_kind(sites, t.model, precision=t.precision, channels_last=t.channels_last,
                            compile=t.compile, num_frames=d.num_frames, height=d.height, width=d.width,
                            limit=max(opts.space.batch_sizes), share=share)
    if waits:
        print(f"--probe-batch-size: probed after {time.monotonic() - asked:.0f} s", flush=True)
    for site, probe in found:
        where = site.describe() if site is not None else "on the first GPU node to join"
        print(f"--probe-batch-size: {where}: {probe.describe()}")
    largest = min(probe.batch_size for _, probe in found)
    kept = tuple(b for b in opts.space.batch_sizes if b <= largest)
    print(f"--probe-batch-size: searching batch sizes {kept}" + (
        f" (the smallest cap of the {len(found)} GPU kinds)" if len(found) > 1 else ""))
    if not kept:
        raise ConfigError("--batch-sizes", f"none of {list(opts.space.batch_sizes)} fits in GPU memory "
                          f"(largest: {largest}); pass smaller sizes or lower --num-frames/--height/--width")
    return replace(opts, space=replace(opts.space, batch_sizes=kept))


def fill_clip_cache(base: TrainConfig, index: VideoIndex | None, *, on_gpu: bool,
                    trains_here: bool = True) -> TrainConfig:
    """Decode every indexed video once into the clip cache of each node that trains, before the
    first trial, so no trial's epoch 1 pays for decoding: this node's here (not when no trial
    trains on it, `trains_here` False: a head without the GPUs, or the CPUs, trials train on),
    the other nodes' by a task on each (`trainer.cluster.node_cache`). Returns `base` with the cache format
    resolved (auto: jpeg when trials train on GPUs, else raw), so every worker reads the same
    format."""
    d = base.data
    cache = FrameCache.from_config(d, on_gpu=on_gpu)
    if cache is None:
        return base
    base = base.with_overrides(data=replace(d, clip_cache_format=cache.format))
    if index is None:
        return base
    spec = get_spec(base.model)
    height, width = d.height or spec.height, d.width or spec.width
    videos = list(index.train) + list(index.val)
    if trains_here:   # every video decoded once at the model's size (its summary says so)
        print(f"Clip cache {cache.root}: decoding {len(videos)} videos before the first trial", flush=True)
        print(node_cache.fill_this_node(base.data, videos, height, width, on_gpu))   # marks it filled
    node_cache.fill_every_node(base.data, videos, height=height, width=width, on_gpu=on_gpu,
                               skip=ray.get_runtime_context().get_node_id() if trains_here else None)
    return base


def run_search(plan: Plan, *, trainer_factory: Callable[..., Any] | None = None) -> int:
    """Run the planned search to the end (or resume it); print and record the summary.
    `trainer_factory`: see `tune.running.trial.make_trial_driver` (tests)."""
    if not plan.opts.resume:   # the options a --resume continues with (tune/state/saved_options.py)
        try:
            saved_options.save(plan.opts, plan.search_path, demo=plan.demo)
        except OSError as e:
            raise_failure(plan, plan.opts, e)
    fit = check_cluster(plan.opts)
    opts, concurrency, local_gpu = fit.opts, fit.concurrency, fit.local_gpu
    if plan.opts.space.batch_sizes is None and plan.index is not None:
        # The hardware's default batch sizes, now known, against the videos (explicit ones were
        # checked before Ray started).
        check_batch_sizes(opts.space.batch_sizes, len(plan.index.train), opts.resources.workers_per_trial,
                          flag="--batch-sizes", workers_flag="--workers-per-trial")
    opts = probe_batch_sizes(opts, plan.base, fit)
    resources = trial_resources(opts)
    check_every_node(plan.storage, opts.train.weights)
    if opts.train.weights == "kinetics":
        kinetics.share_kinetics(opts.train.model)
    base = fill_clip_cache(plan.base, plan.index, on_gpu=resources.use_gpu,
                           trains_here=node_cache.this_node_trains(resources.use_gpu))
    base = base.with_overrides(batch_size=opts.space.batch_sizes[0])
    on = ""
    if fit.gpus:
        on = f" on {fit.gpus:g} GPU(s){' (simulated: training on the CPU)' if simulated_gpus() else ''}"
    print(f"search {plan.search_path}: {opts.num_samples} trial(s), {concurrency} at a time{on}"
          f"{' (local GPU mode)' if local_gpu else ''}; "
          f"{', '.join(d.describe() for d in searched.domains(opts.space).values())}, "
          f"objective {opts.objective}, "
          f"early stopping {'ASHA' if space.early_stopping_enabled(opts) else 'off'}")
    if fit.note:
        print(fit.note)
    # before any trial: a killed driver prints nothing at its end
    announce_resume(plan.name, str(plan.storage), plan.search_path, opts)

    registry_name = f"vidtune-pg-registry-{plan.name}"
    lease_name = f"vidtune-device-lease-{plan.name}"
    # The registry and lease actors live as long as this process holds their handles.
    registry = cleanup.start_registry(registry_name)
    lease = start_lease(lease_name, capacity=resources.trainings_per_gpu, lead_slots=fit.lead_slots)
    tracker = make_tracker(plan, opts)
    driver = make_trial_driver(base, resources, train_storage=f"{plan.experiment_path}/train_runs",
                               registry_name=registry_name, lease_name=lease_name, index=plan.index,
                               trainer_factory=trainer_factory, score_metric=objective_key(opts.objective),
                               node_setup=NodeSetup(  # for nodes that join later: what every node got above
                                   ray.get_runtime_context().get_node_id(), fill_cache=base.data.clip_cache,
                                   kinetics_path=str(kinetics_file(opts.train.model))
                                   if opts.train.weights == "kinetics" else None))
    trainable = tune.with_resources(driver, {"cpu": DRIVER_CPUS})
    callbacks = [disk_full.DiskFullStop(), tracker, cleanup.ReleaseTrialResources(registry_name, lease_name),
                 faults.InterruptWatch(), SignAfterSave(),
                 SearchConsole(num_samples=opts.num_samples, epochs=opts.train.epochs,
                               objective=opts.objective, quiet=opts.quiet,
                               concurrency=concurrency, rungs=space.asha_rungs(opts),
                               reduction_factor=opts.reduction_factor)]
    tuner, searcher = make_tuner(plan, opts, trainable, concurrency=concurrency, callbacks=callbacks)
    results, failure = None, None
    announce_mlflow(tracker)
    faults.install()   # Ctrl-C / SIGTERM: Tune's graceful stop, remembered (tune/running/faults.py)
    try:
        results = tuner.fit()
        # a trial's checkpoint filled the disk, which stopped the search (tune/running/disk_full.py)
        failure = faults.trial_disk_full(results, plan.storage) or disk_full.stopped_error()
    except Exception as e:
        failure = e
    finally:
        faults.tune_ended()   # a Ctrl-C from here on lets the summary and MLflow's record finish
        summary = summarise(plan, opts, results)        # with trials.csv, best_config.json, the plots
        pending = tracker.record_summary(summary)       # None once MLflow is up to date
        finished = pending is None and failure is None
        model = best_model.log_best_model(plan, opts, summary, tracker) if finished else \
            best_model.BestModel()
        code = print_summary(plan, opts, summary, mlflow_links=tracker.summary_links(pending),
                             pending=pending, failed=failure is not None, model=model.lines,
                             budget=searcher if isinstance(searcher, TimeBudget) else None)
        # what `vidtune.load` reads back beside trials.csv and best_config.json
        search_record.write(summary.files["trials_csv"].parent, search_record.make(
            name=plan.name, path=plan.search_path, objective=opts.objective, exit_code=code,
            interrupted=summary.interrupted, tracking_uri=opts.tracking.mlflow_uri, tracker=tracker,
            model_uri=model.uri, answer=summary.answer, pending=pending))
        save_lease_record(lease, log_file_for(plan.search_path, plan.name))
        del registry, lease
        faults.uninstall()
    if failure is not None:
        raise_failure(plan, opts, failure, trials_left=opts.num_samples - summary.trials_ended)
    return faults.late_exit_code(code)


def save_lease_record(lease: Any, log: Path) -> Path | None:
    """Write the device lease's record (`trainer.cluster.lease.LeaseBook.record`: every grant, release and
    end, with the device memory the trial's workers held) beside the search's log, as
    `device_lease.json` (NAME.device_lease.json beside a remote search's log); None when the lease
    could not be asked (the search goes on to its summary either way)."""
    path = log.with_name("device_lease.json" if log.name == LOG_FILE else f"{log.stem}.device_lease.json")
    try:
        record = ray.get(lease.snapshot.remote(), timeout=30)["record"]
        return write_atomically(path, json.dumps(record, indent=1))   # whole or not at all (a full disk)
    except Exception as e:    # bookkeeping: never the reason a search fails (a full disk says itself)
        if not faults.disk_full(e, str(log.parent)):
            print(f"vidtune: could not save the device lease's record: {e}", file=sys.stderr)
        return None


def raise_failure(plan: Plan, opts: SearchOptions, failure: Exception, trials_left: int = 0) -> NoReturn:
    """Re-raise what ended the Tuner, said for the user: a full disk (DiskFullError, with
    whether the search can be resumed), a resume whose state could not be read (ConfigError)."""
    full = faults.disk_full(failure, plan.storage)
    if full:
        raise DiskFullError(disk_full.message(
            plan.storage, plan.experiment_path, plan.search_path, full,
            resumable=disk_full.state_readable(plan.experiment_path),
            trials_left=trials_left or opts.num_samples,
            resume=resume_command(plan.name, str(plan.storage), opts),
            last_good=last_good.has_copy(plan.experiment_path))) from None
    if opts.resume:
        raise ConfigError("--resume", unreadable_state(plan.experiment_path, failure)) from failure
    raise failure


def make_tuner(plan: Plan, opts: SearchOptions, trainable: Any, *, concurrency: int,
               callbacks: list[tune.Callback]) -> tuple[tune.Tuner, Searcher | None]:
    """A new Tuner for the plan and its searcher, or with --resume the saved one restored (its
    state checked first: a damaged state stops the resume with ConfigError, never restarts the
    search) with the searcher it carries: Tune restores that searcher's state (a time budget's
    time used, the Optuna study) itself when the search continues."""
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
                                       resume_errored=True, param_space=param_space,
                                       storage_filesystem=storage_filesystem(plan.storage))
        except Exception as e:   # a damaged state must stop the resume, never restart the search
            raise ConfigError("--resume", unreadable_state(plan.experiment_path, e)) from None
        return tuner, restored_searcher(tuner)
    objective = space.objective_for(opts.objective)
    searcher = space.build_searcher(opts, objective, study_name=plan.name,
                                    val_clips=len(plan.index.val) if plan.index is not None else 0)
    tuner = tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=objective.metric, mode=objective.mode, num_samples=opts.num_samples,
            search_alg=searcher,
            scheduler=space.build_scheduler(opts), max_concurrent_trials=concurrency,
            # One readable name per trial: console, table, MLflow, trial and checkpoint folders.
            trial_name_creator=short_name, trial_dirname_creator=short_name,
            # A trial driver's process (Python, Ray, Tune, torch: ~3 s of CPU to start) serves
            # the next trial too; the driver keeps no state between trials. A stopped trial's
            # process is free once tune.running.cleanup has ended its Train run (see there).
            reuse_actors=True),
        run_config=tune.RunConfig(
            # Tune's own progress tables only with --verbose: SearchConsole prints vidtune's.
            name=plan.tune_name, storage_path=plan.storage, verbose=1 if opts.verbose else 0,
            storage_filesystem=storage_filesystem(plan.storage),   # whole files on a full disk
            # Tune runs a trial again (from its Train run's last checkpoint) when the node of its
            # driver and Train controller was lost (a reclaimed spot node): --max-failures times,
            # as Train restarts a lost worker group. A trial that failed by itself is not rerun
            # (tune.running.trial_retry), and out of memory is an answer, not a failure.
            failure_config=tune.FailureConfig(max_failures=opts.train.max_failures),
            # Tune's own reporter, silent at verbose 0: in a notebook Tune would pick its Jupyter
            # reporter, which puts an empty HTML block above the console's lines
            progress_reporter=None if opts.verbose else CLIReporter(),
            callbacks=callbacks),
    )
    return tuner, searcher


def make_tracker(plan: Plan, opts: SearchOptions) -> MLflowTracker:
    sp, res, train = opts.space, opts.resources, opts.train
    bounds = {k: v for d in searched.domains(sp).values() for k, v in d.option_values().items()}
    gpus = (res.gpus_per_worker or 0.0) * res.workers_per_trial
    return MLflowTracker(
        tracking_uri=opts.tracking.mlflow_uri, experiment=opts.tracking.experiment,
        artifact_location=opts.tracking.artifact_location, experiment_path=plan.search_path,
        epochs=train.epochs, parent_tags=parent_tags(opts.objective),
        objective=opts.objective, val_clips=len(plan.index.val) if plan.index is not None else 0,
        parent_params={**bounds, "dataset": plan.base.data.root, "model": train.model,
                       "weights": train.weights, "objective": opts.objective, "epochs": train.epochs,
                       "num_samples": opts.num_samples, "seed": train.seed,
                       "workers_per_trial": res.workers_per_trial, "gpus_per_trial": gpus,
                       "precision": train.precision, **searcher_params(opts),
                       # only where there is a collective to time out: trials of several workers
                       **({"collective_timeout_min": train.collective_timeout_min}
                          if res.workers_per_trial > 1 else {})},
        # every declared parameter, its trial's value replacing these when searched, as trials.csv has them
        child_params={**{p.name: getattr(train, p.name) for p in searched.PARAMS},
                      "precision": train.precision, "model": train.model, "workers": res.workers_per_trial,
                      "gpus": gpus, "dataset": plan.base.data.root, "epochs": train.epochs},
    )


def searcher_params(opts: SearchOptions) -> dict[str, Any]:
    """How the search searched (sampler, TPE kind, random start, ASHA or "off", lr scaling, time
    budget, warm start), as the parent run's params: searches compared side by side in MLflow."""
    asha = space.early_stopping_enabled(opts)
    params: dict[str, Any] = {
        "sampler": opts.sampler, "tpe": opts.tpe, "random_start_trials": space.random_start_trials(opts),
        "early_stopping": "asha" if asha else "off", "lr_scaling": opts.space.lr_scaling,
        "time_budget": opts.time_budget, "warm_start": opts.warm_start}
    if asha:
        params.update(grace_period=space.grace_period(opts), reduction_factor=opts.reduction_factor,
                      asha_brackets=space.asha_brackets(opts))
    if opts.space.lr_scaling != "none":
        params["lr_reference_batch"] = space.reference_batch(opts.space)
    return params


def announce_mlflow(tracker: MLflowTracker) -> None:
    """Create (or find) the parent run now and print where the runs table is, so it can be
    opened while the search runs. A store that fails here is retried by the tracker later."""
    try:
        tracker.open_parent()
    except KeyboardInterrupt:   # the parent run just made: KILLED, as a rerun (which reopens it) expects
        with contextlib.suppress(Exception):
            tracker.close(interrupted=True)
        raise
    except Exception as e:
        print(f"MLflow: cannot reach {tracker.tracking_uri} yet ({faults.one_line(e, 200)}); "
              "the runs are written when it answers")
        return
    print(f"MLflow runs table: {tracker.runs_table_url()}{ui_hint(tracker.tracking_uri)}", flush=True)
