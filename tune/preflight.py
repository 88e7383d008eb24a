"""The search before Ray: everything that can be checked on the driver, and the typed `Plan` it
leaves. `prepare` runs every check that needs no Ray cluster (no driver already on this search,
options, training config, stores, storage, the dataset indexed once, the experiment name, a
resumed search's saved state and its signature); `describe` is `--dry-run`'s printout. A plan
that passes is what `tune.runner.execute` runs; a --resume of a finished search stops at its
state (`Plan.finished`, `tune.state.finished`), and nothing runs.

Bad input raises ConfigError / DataError naming the flag or file, which `tune.search.main` turns
into exit code 2, in seconds and before any Ray process exists."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ray import tune

from vidtune.datasets.index import VideoIndex
from vidtune.flags import ConfigError
from vidtune.trainer.ray_setup.launch import check_output_folders, check_training_inputs
from vidtune.trainer.training.config import TrainConfig
from vidtune.tune.config import layout
from vidtune.tune.config.demo import ensure_demo_data
from vidtune.tune.config.options import CPU_BATCH_SIZES, GPU_BATCH_SIZES, SearchOptions, base_config
from vidtune.tune.running import faults
from vidtune.tune.running.budget import parse_duration
from vidtune.tune.running.ray_internals import check_experiment_state
from vidtune.tune.state import last_good, saved_options, trust
from vidtune.tune.state.finished import finished_search
from vidtune.tune.state.lock import check_not_running
from vidtune.tune.state.search_record import SearchRecord
from vidtune.tune.study import space
from vidtune.tune.study.dashboard import default_storage
from vidtune.tune.study.warm_start import load_warm_start
from vidtune.tune.tracking.store import check_artifact_location, check_model_name, check_store_uri

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
    # --resume of a finished search: its record; nothing runs (`tune.state.finished`), nothing was checked
    # past the search's own state
    finished: SearchRecord | None = None
    # When this run of the search began (unix time): the summary's "N trials in T". Set by
    # `tune.search.run_search` when it is called, so a notebook's second search counts its own time.
    started_at: float = field(default_factory=time.time)

    @property
    def search_path(self) -> str:
        """The search's folder: the user's files at its top (`tune.config.layout`)."""
        return layout.search_path(self.storage, self.name)

    @property
    def experiment_path(self) -> str:
        """Ray Tune's experiment folder, inside the search's (`tune.config.layout.state_path`)."""
        return layout.state_path(self.search_path)

    @property
    def tune_name(self) -> str:
        """The experiment's name under `storage` as Tune's RunConfig takes it (`<name>/ray`)."""
        return self.experiment_path[len(self.storage.rstrip("/")) + 1:]


def prepare(opts: SearchOptions, given: dict[str, Any] | None = None) -> Plan:
    """The one validation on the driver, before Ray starts: no driver already running this
    search (tune/state/lock.py), options, training config, stores, storage, the dataset (indexed here,
    and every candidate batch size checked against the training videos each worker gets), the
    experiment name. A --resume runs with the options the search saved when it started
    (`tune.state.saved_options`); `given`, what its command line set, must agree with them. Raises
    ConfigError / DataError naming the flag or file at fault; a plan that passes cannot fail for
    a reason known here."""
    storage = opts.storage or str(Path(DEFAULT_STORAGE).resolve())
    if "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
    check_output_folders(opts.train, storage)
    if opts.name:   # first: a second driver on a running search stops in seconds, not after the checks
        check_not_running(layout.search_path(storage, opts.name), "--resume" if opts.resume else "--name")
    name = None
    if opts.resume:   # the search's own options, before anything reads them (the dataset, the stores)
        name = experiment_name(opts, storage)
        opts = saved_options.resumed_options(opts, given or {}, layout.search_path(storage, name))
        done = finished_search(layout.search_path(storage, name))
        if done is not None:   # nothing to resume: no store, dataset or Ray is needed to say so
            return Plan(opts=opts, base=base_config(opts), storage=storage, name=name, demo=opts.demo,
                        finished=done)
    check_store_uri(opts.tracking.mlflow_uri, "--mlflow-uri")
    check_model_name(opts.tracking)
    if opts.tracking.artifact_location:
        opts = replace(opts, tracking=replace(
            opts.tracking, artifact_location=check_artifact_location(opts.tracking.artifact_location)))
    if opts.optuna_storage is None:   # the study beside the MLflow store, for optuna-dashboard
        opts = replace(opts, optuna_storage=default_storage(opts.tracking.mlflow_uri, storage))
        if opts.optuna_storage and opts.optuna_storage.startswith("sqlite:///"):
            # in --storage when MLflow is a server: that folder may not exist yet (it was checked
            # writable above)
            Path(opts.optuna_storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    if opts.optuna_storage and opts.optuna_storage.startswith("sqlite:"):
        check_store_uri(opts.optuna_storage, "--optuna-storage")
    name = name or experiment_name(opts, storage)
    if opts.time_budget:
        parse_duration(opts.time_budget)
    # A bad --warm-start is refused here, before Ray starts (and by --dry-run); build_searcher loads
    # it again for the study once the batch sizes are known. Until then (their defaults depend on
    # the cluster) it is checked against every batch size a default may have.
    if opts.warm_start:
        space = opts.space if opts.space.batch_sizes is not None else replace(
            opts.space, batch_sizes=tuple(sorted({*CPU_BATCH_SIZES, *GPU_BATCH_SIZES})))
        load_warm_start(opts.warm_start, space, opts.objective, own_storage=opts.optuna_storage,
                        own_study=opts.study_name or name)
    # The dataset last, after every check that needs none: the demo's videos take seconds to make
    demo = opts.demo
    if demo:
        root, made = ensure_demo_data()
        print(f"demo: {'generated' if made else 'using'} the synthetic dataset in {root}"
              " (pass --data PATH for your own videos)")
    else:
        root = Path(opts.train.data.root).expanduser().resolve()
    opts = replace(opts, train=opts.train.with_overrides(data=replace(opts.train.data, root=str(root))))
    base = base_config(opts)
    # The batch-size defaults depend on the cluster: checked once it is up (tune.runner)
    index = check_training_inputs(base, batch_sizes=opts.space.batch_sizes,
                                  workers=opts.resources.workers_per_trial, batch_flag="--batch-sizes",
                                  workers_flag="--workers-per-trial",
                                  show=lambda index: print(index.summary()))
    return Plan(opts=opts, base=base, storage=storage, name=name, demo=demo, index=index)


def experiment_name(o: SearchOptions, storage: str) -> str:
    """--name, or with --resume the latest restorable experiment in storage, else a new name."""
    if o.resume:
        if o.name:
            path = layout.search_path(storage, o.name)
            if not tune.Tuner.can_restore(layout.state_path(path)):
                raise ConfigError("--resume", f"no interrupted search to continue at {path}; "
                                  "check --name and --storage")
            name = o.name
        else:
            if "://" in storage:
                raise ConfigError("--resume", "with remote --storage, also pass --name of the search to "
                                  "continue")
            found = sorted((p for p in Path(storage).glob("*")
                            if p.is_dir() and tune.Tuner.can_restore(layout.state_path(str(p)))),
                           key=lambda p: p.stat().st_mtime)
            if not found:
                raise ConfigError("--resume", f"no interrupted search to continue in {storage}; "
                                  "pass --storage (and --name)")
            name = found[-1].name
        check_resumable(layout.search_path(storage, name), trust_state=o.trust_state)
        return name
    if o.name:
        if "://" not in storage and (Path(storage) / o.name).exists():
            raise ConfigError("--name", f"{Path(storage) / o.name} already exists; continue it with --resume "
                              "or pick another --name")
        return o.name
    return time.strftime("vidtune-%Y%m%d-%H%M%S")


def check_resumable(path: str, *, trust_state: bool) -> None:
    """Before anything of the search at `path` (its folder) is unpickled: no live driver holds it
    (tune/state/lock.py), Tune's saved state (`tune.config.layout.state_path`) parses, and this user's key
    signed every state file (tune/state/trust.py), unless --trust-state."""
    check_not_running(path, "--resume")
    path = layout.state_path(path)
    key = trust.load_key(create=False) if trust.key_path().exists() else None
    restored = last_good.restore(path, key)      # a state cut short by a full disk: its last whole copy
    if restored:
        print(restored)
        trust.sign(path, last_good.restored_names(path), key=key)
    try:
        check_experiment_state(path)
    except ValueError as e:
        raise ConfigError("--resume", unreadable_state(path, e)) from None
    if trust_state:
        print(f"--trust-state: loading the saved state at {path} without checking who wrote it; "
              "it is signed with your key from now on")
        return
    trust.verify(path)


def describe(plan: Plan) -> str:
    """`--dry-run`'s printout: every option as resolved (the same names as the flags' fields),
    with what is decided later said so."""
    doc = plan.opts.to_dict()
    doc["experiment"] = plan.search_path
    doc["demo"] = plan.demo
    doc["early_stopping"] = "ASHA" if space.early_stopping_enabled(plan.opts) else "off"
    if doc["space"]["batch_sizes"] is None:
        doc["space"]["batch_sizes"] = "by device once Ray is up (CPU 4,8; GPU 8,16,32)"
    if doc["train"]["data"]["clip_cache_format"] == "auto":
        doc["train"]["data"]["clip_cache_format"] = "auto (jpeg when trials train on GPUs, else raw)"
    return "resolved configuration:\n" + json.dumps(doc, indent=2, default=list)


def unreadable_state(experiment_path: str, error: BaseException) -> str:
    reason = faults.one_line(error)
    return (f"the saved state of the search at {experiment_path} cannot be read ({type(error).__name__}: "
            f"{reason}); it was damaged, e.g. by a full disk or a copy cut short. Nothing was restarted. "
            "Start a new search under another --name; this search's runs stay in MLflow as they are")
