"""What a trial costs beyond its training, on this machine: prints a table.

Measures, with N repetitions each:
  - `ray.init` of a local Ray (or the connection to `--address`);
  - a plain Ray Tune function trial that does nothing (Tuner.fit total, and the time until the
    first line of the trial function runs);
  - a Tune trial that builds a Ray Train `TorchTrainer` with an empty training loop, as every
    vidtune trial does: Tuner.fit total, start of the trial function, `trainer.fit()` to the first
    line of the worker function (controller, worker actors, process group), last line of the
    worker function to `fit()` returning (mostly Train's health-check poll), `fit()` total;
    once with Ray's own `TorchTrainer` and once with vidtune's (`trainer.cluster.torch_trainer`, which
    starts no Ray Data `DatasetManager` and no `PlacementGroupCleaner`), alternating, so the two
    are compared side by side.

Compare the last numbers with a trial's epoch time to see how much of a short search is overhead.

    python -m bench.trial_overhead                       # 3 repetitions on a local 2-CPU Ray
    python -m bench.trial_overhead --quick               # 1 repetition: checks it runs (~1 min)
    python -m bench.trial_overhead --repeats 5 --train-workers 2 --num-cpus 4
    python -m bench.trial_overhead --health-check-interval-s 2   # Ray's default poll, for comparison
    python -m bench.trial_overhead --address auto --storage s3://bucket/tmp   # on a running cluster
    python -m bench.trial_overhead --json overhead.json   # also write the table as JSON
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import ray.train
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from vidtune.trainer.ray_setup.launch import (
    DEFAULT_HEALTH_CHECK_INTERVAL_S,
    HEALTH_CHECK_ENV,
    LOCAL_ADDRESS,
    init_ray,
)
from vidtune.tune.running.trial import DRIVER_CPUS

REPO_ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="repetitions of each measurement (default 3)")
    p.add_argument("--num-cpus", type=int, default=2,
                   help="CPUs of the local Ray (ignored with --address; default 2)")
    p.add_argument("--train-workers", type=int, default=1,
                   help="Ray Train workers in the TorchTrainer trial (default 1)")
    p.add_argument("--cpus-per-worker", type=float, default=1.0,
                   help="CPUs each Train worker asks for (default 1)")
    p.add_argument("--trial-cpus", type=float, default=DRIVER_CPUS,
                   help=f"CPU share of the Tune trial function itself (default {DRIVER_CPUS}, what vidtune "
                   "gives it)")
    p.add_argument("--health-check-interval-s", type=float, default=float(DEFAULT_HEALTH_CHECK_INTERVAL_S),
                   help=f"{HEALTH_CHECK_ENV} (vidtune sets {DEFAULT_HEALTH_CHECK_INTERVAL_S}; "
                   "Ray's default is 2)")
    p.add_argument("--address", default=None,
                   help="join this Ray cluster instead of starting one (e.g. auto); without it the bench "
                   "starts a Ray of its own even where RAY_ADDRESS names one")
    p.add_argument("--storage", default=None,
                   help="storage_path for the trials (default: a temporary folder; "
                   "on a multi-node cluster pass shared storage, e.g. s3://bucket/prefix)")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write every row (seconds per repetition, mean, min, max) to FILE")
    p.add_argument("--quick", action="store_true",
                   help="one repetition of each measurement, to check it runs")
    return p


def _check_args(args: argparse.Namespace) -> None:
    for flag, value, ok in (
        ("--repeats", args.repeats, args.repeats >= 1),
        ("--num-cpus", args.num_cpus, args.num_cpus >= 1),
        ("--train-workers", args.train_workers, args.train_workers >= 1),
        ("--cpus-per-worker", args.cpus_per_worker, args.cpus_per_worker > 0),
        ("--trial-cpus", args.trial_cpus, args.trial_cpus > 0),
        ("--health-check-interval-s", args.health_check_interval_s, args.health_check_interval_s > 0),
    ):
        if not ok:
            raise SystemExit(f"{flag}: got {value}; it must be a number > 0 (and a whole number for "
                             "--repeats, --num-cpus and --train-workers)")
    if args.address is None and args.train_workers * args.cpus_per_worker + args.trial_cpus > args.num_cpus:
        raise SystemExit(
            f"--train-workers {args.train_workers} x --cpus-per-worker {args.cpus_per_worker} + "
            f"--trial-cpus {args.trial_cpus} needs more than --num-cpus {args.num_cpus}: the trial would "
            "wait forever; raise --num-cpus or lower the others"
        )


def _noop_trial(config: dict) -> None:
    tune.report({"t_first_line": time.time()})


def _empty_loop_per_worker(config: dict) -> None:
    first = time.time()
    # One report, as every real epoch makes; TuneReportCallback forwards rank 0's to Tune.
    ray.train.report({"t_worker_first_line": first, "t_worker_last_line": time.time()})


def _torch_trainer_trial(config: dict) -> None:
    """The Tune trial function: one TorchTrainer named after the trial, as tune/search.py does;
    `config["trainer"]` says whose: "ray" (`ray.train.torch.TorchTrainer`) or "vidtune"
    (`trainer.cluster.torch_trainer.VidtuneTorchTrainer`, what a search builds)."""
    # Both import torch: heavy (seconds), only in the trial.
    from vidtune.trainer.cluster.torch_trainer import TorchTrainer, VidtuneTorchTrainer

    first = time.time()
    trainer_class = VidtuneTorchTrainer if config["trainer"] == "vidtune" else TorchTrainer
    trainer = trainer_class(
        _empty_loop_per_worker,
        scaling_config=ray.train.ScalingConfig(
            num_workers=config["train_workers"], resources_per_worker={"CPU": config["cpus_per_worker"]}
        ),
        run_config=ray.train.RunConfig(
            name=tune.get_context().get_trial_id(), storage_path=config["storage"],
            callbacks=[TuneReportCallback()]
        ),
    )
    fit_start = time.time()
    trainer.fit()
    tune.report({"t_first_line": first, "t_fit_start": fit_start, "t_fit_end": time.time()})


def _run_tuner(trainable, *, trial_cpus: float, storage: str, config: dict,
               name: str) -> tuple[float, dict]:
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": trial_cpus}),
        param_space=config,
        tune_config=tune.TuneConfig(num_samples=1),
        run_config=tune.RunConfig(name=name, storage_path=storage, verbose=0),
    )
    start = time.time()
    grid = tuner.fit()
    total = time.time() - start
    result = grid[0]
    if result.error:
        raise SystemExit(f"the {name} trial failed: {result.error}")
    # Every report of the trial, in order: the worker's (forwarded by TuneReportCallback), then
    # the trial function's own last one.
    merged: dict = {}
    for row in result.metrics_dataframe.to_dict("records"):
        merged.update({k: v for k, v in row.items() if k.startswith("t_") and v == v})
    out = {"start_to_first_line_s": merged["t_first_line"] - start}
    if "t_fit_start" in merged:
        out["fit_to_worker_s"] = merged["t_worker_first_line"] - merged["t_fit_start"]
        out["worker_end_to_fit_return_s"] = merged["t_fit_end"] - merged["t_worker_last_line"]
        out["fit_total_s"] = merged["t_fit_end"] - merged["t_fit_start"]
    return total, out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.repeats = 1
    _check_args(args)
    # Read by Train's controller when it starts, so set before Ray does.
    os.environ[HEALTH_CHECK_ENV] = str(args.health_check_interval_s)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    # (label, seconds per repetition), in print order.
    rows: dict[str, list[float]] = {}
    init_times = []
    rounds = 1 if args.address else args.repeats
    for i in range(rounds):
        start = time.time()
        # "local": a Ray of its own, not one RAY_ADDRESS names (another run's: its load would skew this)
        init_ray(address=args.address or LOCAL_ADDRESS, num_cpus=None if args.address else args.num_cpus,
                 log_to_driver=False)
        init_times.append(time.time() - start)
        if i < rounds - 1:
            ray.shutdown()
    init_label = ("ray.init (connect to --address)" if args.address
                  else f"ray.init (local, {args.num_cpus} CPUs)")
    rows[init_label] = init_times

    plain = "plain Tune function trial"
    trainers = {"ray": f"Ray's TorchTrainer trial, empty loop, {args.train_workers} worker(s)",
                "vidtune": "vidtune's TorchTrainer trial (no DatasetManager, no PlacementGroupCleaner), "
                           f"{args.train_workers} worker(s)"}
    with tempfile.TemporaryDirectory(prefix="vidtune-overhead-") as tmp:
        storage = args.storage or tmp
        config = {"train_workers": args.train_workers, "cpus_per_worker": args.cpus_per_worker,
                  "storage": storage}
        for i in range(args.repeats):
            total, m = _run_tuner(_noop_trial, trial_cpus=args.trial_cpus, storage=storage, config={},
                                  name=f"noop-{i}")
            rows.setdefault(f"{plain}: Tuner.fit total", []).append(total)
            rows.setdefault(f"{plain}: Tuner.fit -> trial function starts", []).append(
                m["start_to_first_line_s"])
        for i in range(args.repeats):
            for kind, trainer in trainers.items():   # alternating: side by side on a noisy machine
                total, m = _run_tuner(_torch_trainer_trial, trial_cpus=args.trial_cpus, storage=storage,
                                      config={**config, "trainer": kind}, name=f"trainer-{kind}-{i}")
                rows.setdefault(f"{trainer}: Tuner.fit total", []).append(total)
                rows.setdefault(f"{trainer}: Tuner.fit -> trial function starts", []).append(
                    m["start_to_first_line_s"])
                rows.setdefault(f"{trainer}: trainer.fit -> worker function starts", []).append(
                    m["fit_to_worker_s"])
                rows.setdefault(f"{trainer}: worker function ends -> fit returns", []).append(
                    m["worker_end_to_fit_return_s"])
                rows.setdefault(f"{trainer}: trainer.fit total", []).append(m["fit_total_s"])
    ray.shutdown()
    print(format_table(rows, args))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {label: {"seconds": values, "mean": statistics.mean(values), "min": min(values),
                     "max": max(values)} for label, values in rows.items()}, indent=2) + "\n")
    return 0


def format_table(rows: dict[str, list[float]], args: argparse.Namespace) -> str:
    """One line per step: mean / min / max seconds over the repetitions; trial rows grouped."""
    lines = [
        f"\nTrial overhead on this machine ({os.cpu_count()} cores; Train workers: {args.train_workers} x "
        f"{args.cpus_per_worker} CPU; trial function: {args.trial_cpus} CPU; health check every "
        f"{args.health_check_interval_s} s)\n",
        f"{'step':<58} {'mean_s':>7} {'min_s':>7} {'max_s':>7} {'n':>3}",
        "-" * 86,
    ]
    group = None
    for label, values in rows.items():
        head, _, step = label.partition(": ")
        if step:
            if head != group:
                lines.append(head)
                group = head
            label = "  " + step
        lines.append(f"{label:<58} {statistics.mean(values):>7.2f} {min(values):>7.2f} {max(values):>7.2f} "
                     f"{len(values):>3}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
