"""`python tune/search.py`: search batch size and learning rate for fine-tuning a video
transformer. Ray Tune + Optuna propose trials, each trial is a Ray Train run, MLflow records them.

With no arguments it runs the embedded demo (generated data, the `tiny` model, the CPU).
Bad input fails in seconds, before Ray starts, with exit code 2 and a message naming the flag.
"""
from __future__ import annotations

import sys

# Run by path (not as tune.search, nor as the copy multiprocessing's spawned children import,
# which inherit the fixed sys.path): put the repository root first on sys.path.
if __name__ == "__main__" and not __package__:
    import script_path  # noqa: F401

import contextlib
import io
import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from datasets.errors import DataError
from datasets.flags import ConfigError
from trainer.config import TrainConfig
from tune.lock import check_not_running
from tune.options import SearchOptions, build_parser, parse_options

__all__ = ["build_parser", "main"]

DEFAULT_STORAGE = "vidtune-results"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the search; returns the exit code (2 for unusable input, with a one-paragraph message)."""
    try:
        opts = parse_options(argv)
        return run(opts)
    except (ConfigError, DataError) as e:
        print(f"vidtune search: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from tune.faults import DiskFullError   # imports Ray: not before it is needed

        if not isinstance(e, DiskFullError):
            raise
        print(f"vidtune search: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("vidtune search: interrupted; every MLflow run was closed (KILLED). Continue with --resume.",
              file=sys.stderr)
        return 130


@dataclass(frozen=True)
class Plan:
    """The resolved search before Ray: options (dataset path resolved), the training run every
    trial starts from, where results go, and the driver's index of the videos."""

    opts: SearchOptions
    base: TrainConfig
    storage: str              # Tune storage root (absolute path or URI)
    name: str                 # experiment name (folder under storage)
    demo: bool
    index: Any = None         # the driver's datasets.index.VideoIndex (None in tests that skip it)

    @property
    def experiment_path(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}"


def run(opts: SearchOptions) -> int:
    # --quiet: nothing before the summary, which writes to the real stdout (tune.runner.summarise)
    quiet = opts.quiet and not opts.dry_run
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        plan = prepare(opts)
        if opts.dry_run:
            print(describe(plan))
            print("dry run: everything checked (cluster resources are checked when the search connects); nothing ran.")
            return 0
        return execute(plan)


def prepare(opts: SearchOptions) -> Plan:
    """The one validation on the driver, before Ray starts: no driver already running this
    search (tune/lock.py), options, training config, stores, storage, the dataset (indexed here, and every candidate batch size checked against the
    training videos each worker gets), the experiment name. Raises ConfigError / DataError
    naming the flag or file at fault; a plan that passes cannot fail for a reason known here."""
    from trainer.launch import check_batch_sizes, check_num_frames, check_writable_folder, validate_config
    from tune.tracking import check_store_uri

    storage = opts.storage or str(Path(DEFAULT_STORAGE).resolve())
    if "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
        check_writable_folder(storage, "--storage")
    if opts.name:   # first: a second driver on a running search stops in seconds, not after the checks
        check_not_running(f"{storage.rstrip('/')}/{opts.name}", "--resume" if opts.resume else "--name")
    demo = opts.demo
    if demo:
        from tune.demo import ensure_demo_data

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


def base_config(o: SearchOptions) -> TrainConfig:
    """The training run every trial starts from: `o.train` with a batch size and learning rate
    the search will replace (the first candidate, the middle of the log range)."""
    return o.train.with_overrides(batch_size=(o.space.batch_sizes or (8,))[0],
                                  lr=math.sqrt(o.space.lr_min * o.space.lr_max))


def experiment_name(o: SearchOptions, storage: str) -> str:
    """--name, or with --resume the latest restorable experiment in storage, else a new name."""
    from ray.tune import Tuner

    if o.resume:
        if o.name:
            path = f"{storage.rstrip('/')}/{o.name}"
            if not Tuner.can_restore(path):
                raise ConfigError("--resume", f"no interrupted search to continue at {path}; check --name and --storage")
            name = o.name
        else:
            if "://" in storage:
                raise ConfigError("--resume", "with remote --storage, also pass --name of the search to continue")
            found = sorted((p for p in Path(storage).glob("*") if p.is_dir() and Tuner.can_restore(str(p))),
                           key=lambda p: p.stat().st_mtime)
            if not found:
                raise ConfigError("--resume", f"no interrupted search to continue in {storage}; pass --storage (and --name)")
            name = found[-1].name
        check_resumable(f"{storage.rstrip('/')}/{name}", trust_state=o.trust_state)
        return name
    if o.name:
        if "://" not in storage and (Path(storage) / o.name).exists():
            raise ConfigError("--name", f"{Path(storage) / o.name} already exists; continue it with --resume or pick another --name")
        return o.name
    return time.strftime("vidtune-%Y%m%d-%H%M%S")


def check_resumable(path: str, *, trust_state: bool) -> None:
    """Before anything of a search is unpickled: no live driver holds it (tune/lock.py), Tune's
    saved state parses, and this user's key signed every state file (tune/trust.py), unless
    --trust-state."""
    from tune import trust
    from tune.ray_internals import check_experiment_state
    from tune.runner import unreadable_state

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


def index_data(base: TrainConfig) -> Any:
    """Probe every video on the driver: fails fast (DataError) with the dropped-file report.
    Returns the VideoIndex the trials train on."""
    from datasets.index import build_index

    index = build_index(base.data)
    print(index.summary())
    return index


def describe(plan: Plan) -> str:
    """`--dry-run`'s printout: every option as resolved (the same names as the flags' fields),
    with what is decided later said so."""
    from tune.space import early_stopping_enabled

    doc = plan.opts.to_dict()
    doc["experiment"] = plan.experiment_path
    doc["demo"] = plan.demo
    doc["early_stopping"] = "ASHA" if early_stopping_enabled(plan.opts) else "off"
    if doc["space"]["batch_sizes"] is None:
        doc["space"]["batch_sizes"] = "by device once Ray is up (CPU 4,8; GPU 8,16,32)"
    if doc["train"]["data"]["clip_cache_format"] == "auto":
        doc["train"]["data"]["clip_cache_format"] = "auto (jpeg when trials train on GPUs, else raw)"
    return "resolved configuration:\n" + json.dumps(doc, indent=2, default=list)


def execute(plan: Plan) -> int:
    """Lock the search (one driver per search), start Ray, check the cluster, run (or resume)
    the search, report; the lock goes when this returns or raises."""
    from tune.lock import SearchLock

    lock = SearchLock(plan.experiment_path, flag="--resume" if plan.opts.resume else "--name")
    lock.acquire()   # before Ray and before any file is written: a second driver stops in seconds
    try:
        return _execute(plan)
    finally:
        lock.release()


def _execute(plan: Plan) -> int:
    import ray

    from trainer.launch import init_ray
    from tune.runner import run_search
    from tune.trust import StateSigner

    # A tracking server that stops answering must not hold the search: MLflow's client would
    # retry each call for minutes. One try, a short wait; tune/tracking.py catches up later.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    log_options, ray_lines = {}, None
    streams = sys.stdout, sys.stderr
    if not plan.opts.verbose:
        from tune.console import keep_ray_lines_off_the_console, log_file_for, quiet_libraries

        log = quiet_libraries(log_file_for(plan.experiment_path, plan.name))
        ray_lines = keep_ray_lines_off_the_console(log)
        print(f"logs: {log} (Ray's, Tune's and the libraries' messages; --verbose shows them here)", flush=True)
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


if __name__ == "__main__":
    sys.exit(main())
