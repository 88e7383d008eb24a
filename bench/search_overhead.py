"""What Ray Tune + Train + MLflow cost around the same trainings: prints a side-by-side table.

The same N trainings run twice on this machine, one after the other:
  - search: `vidtune search` as a subprocess (Tune + Optuna + Train + MLflow into a
    temporary sqlite store and --storage), --no-early-stop, one batch size, --num-samples N;
  - plain: one Python process (also a subprocess, so both pay Python start and imports) running
    the project's own loop (`trainer.training.loop.train_one_epoch` / `evaluate`, data, model, optimiser
    and a checkpoint per epoch built as `trainer/cluster/worker.py` builds them) for the same trials
    (batch size and the learning rates the search drew), one after another.
Both read a generated dataset (or --data) and start with an empty frame cache of their own (or
both decode with decord: --no-cache). The table splits each wall time into training epochs
(`epoch_time_s`), evaluation, the time between epochs (metrics, checkpoint, report), trial start
to first epoch, last epoch to trial end, and what comes before the first and after the last
trial (for the search: Python and imports, data index, Ray start); `ratio` = search / plain wall.
The search's trial spans come from its MLflow child runs (opened and closed when Tune starts and
ends a trial), its epochs from each result's epoch_start_ts / epoch_end_ts (estimated from the
report times where the code reports none); the plain side times itself the same way.

    python -m bench.search_overhead --quick                 # 2 short trials: checks it runs (~1 min)
    python -m bench.search_overhead --trial-seconds 10      # 4 trials of ~10 s each (target ratio <= 1.5)
    python -m bench.search_overhead --trial-seconds 60 --json overhead-60.json   # (target <= 1.10)

This module runs the two sides and prints; the plain side is bench/overhead_plain.py, reading the
search back and timing each side bench/overhead_timeline.py, the tables bench/overhead_report.py.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import write_json
from bench.cpu_usage import CpuSampler
from bench.overhead_plain import plain_process
from bench.overhead_report import report, while_training
from bench.overhead_timeline import (
    EXPERIMENT,
    mlflow_spans,
    read_search_trials,
    search_timeline,
    side_summary,
)
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index
from vidtune.datasets.synthetic import generate
from vidtune.tune.config import layout
from vidtune.tune.config.options import build_parser as search_parser

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Preset:
    """Sizes for one plain training of the tiny model (8 x 64 x 64) on 2 CPU cores."""

    videos: int            # generated videos, 80 % train (the synthetic generator's default split)
    size: int              # stored frame size in px: decoding cost follows it
    epochs: int
    batch_size: int
    trials: int            # default --trials
    target_ratio: float | None


# Sized on 2 cores (tiny, batch 8, 2 loader processes, 2 torch threads, warm frame cache): "10" is
# the demo's data and epochs (160 videos x 6), measured at 10.1-11.1 s per plain training; a train
# clip then costs ~12 ms, so "60" (480 videos x 13 epochs) trains ~60 s. Other load on the cores
# slows 2 threads far more than it slows 1 (OpenMP spin-waits): up to 3x seen. Re-measure with
# --plain-only.
PRESETS = {
    "quick": Preset(videos=16, size=64, epochs=1, batch_size=4, trials=2, target_ratio=None),
    "10": Preset(videos=160, size=112, epochs=6, batch_size=8, trials=4, target_ratio=1.5),
    "60": Preset(videos=480, size=112, epochs=13, batch_size=8, trials=4, target_ratio=1.10),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trial-seconds", choices=("10", "60"), default="10",
                   help="preset: dataset size and epochs for ~10 s or ~60 s per plain training (default 10)")
    p.add_argument("--quick", action="store_true",
                   help="tiny preset (2 trials x 1 epoch, 16 videos of 64 px) to check the script runs")
    p.add_argument("--trials", type=int, default=None,
                   help="trainings on each side (default: the preset's, 4)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per training (default: the preset's)")
    p.add_argument("--data", default=None,
                   help="dataset to use instead of generating one (any layout the search reads)")
    p.add_argument("--model", default="tiny", help="model (default tiny; the presets are sized for it)")
    p.add_argument("--loader-workers", type=int, default=2,
                   help="DataLoader processes per training (default 2, the search's)")
    p.add_argument("--seed", type=int, default=0,
                   help="--seed of the search (sampler and training; default 0)")
    p.add_argument("--no-cache", action="store_true",
                   help="both sides decode every clip with decord (search: --no-cache)")
    p.add_argument("--max-concurrent-trials", type=int, default=None,
                   help="passed to the search (default: the search decides)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch threads of every training, both sides (the search's --cpu-threads; "
                   "default all the cores). Fewer than the cores leaves some free, as a GPU training does: "
                   "the search then starts the next trial on them while one trains")
    p.add_argument("--plain-threads", type=int, default=None,
                   help="torch threads of the plain run (default: what the search gives a trial's worker)")
    p.add_argument("--plain-only", action="store_true", help="run only the plain side (to size a preset)")
    p.add_argument("--timeout-s", type=float, default=900,
                   help="give up on the search after this long (default 900)")
    p.add_argument("--verbose", action="store_true", help="echo the search's console output to stderr")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the rows and ratio as JSON")
    p.add_argument("--plain-spec", help=argparse.SUPPRESS)   # internal: run the plain side (subprocess)
    return p


# -- running a side ------------------------------------------------------------------------------

def run_logged(cmd: list[str], *, env: dict, cwd: Path, timeout_s: float, verbose: bool,
               log_path: Path) -> dict:
    """Run `cmd`, time-stamping each output line as it arrives (unbuffered child). Returns
    {launch, exit, returncode, lines: [(unix s, text)]}. Past `timeout_s` it is interrupted
    (SIGINT: the search closes its runs and Ray), then killed 30 s later."""
    env = {**env, "PYTHONUNBUFFERED": "1"}
    lines: list[tuple[float, str]] = []
    with CpuSampler() as cpu:
        launch = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=cwd)
        timers = [threading.Timer(timeout_s, proc.send_signal, [signal.SIGINT]),
                  threading.Timer(timeout_s + 30, proc.kill)]
        for timer in timers:
            timer.start()
        with open(log_path, "w") as log:
            for line in proc.stdout:
                lines.append((time.time(), line.rstrip("\n")))
                log.write(f"{lines[-1][0]:.3f} {line}")
                if verbose:
                    print(line, end="", file=sys.stderr, flush=True)
        returncode = proc.wait()
        done = time.time()
        for timer in timers:
            timer.cancel()
    return {"launch": launch, "exit": done, "returncode": returncode, "lines": lines, "log": str(log_path),
            "cpu": cpu.usage}


def search_argv(args: argparse.Namespace, data: str, tmp: Path, epochs: int, trials: int, batch: int,
                cache_flags: list[str]) -> list[str]:
    argv = ["--data", data, "--model", args.model, "--epochs", str(epochs), "--batch-sizes", str(batch),
            "--num-samples", str(trials), "--seed", str(args.seed), "--no-early-stop",
            "--loader-workers", str(args.loader_workers), "--storage", str(tmp / "results"),
            "--name", EXPERIMENT, "--mlflow-uri", f"sqlite:///{tmp / 'mlruns.db'}",
            "--experiment", EXPERIMENT, *cache_flags]
    if args.max_concurrent_trials:
        argv += ["--max-concurrent-trials", str(args.max_concurrent_trials)]
    if args.cpu_threads:
        argv += ["--cpu-threads", str(args.cpu_threads)]
    return argv


def cache_setup(no_cache: bool, tmp: Path) -> tuple[list[str], list[str], str]:
    """(the search's cache flags, the plain side's, what the table says about the frame cache)."""
    text = search_parser().format_help()
    has_dir, has_off = "--cache-dir" in text, "--no-cache" in text
    if no_cache:
        flags = ["--no-cache"] if has_off else []
        note = "" if has_off else " (WARNING: the search has no --no-cache flag; it may still use its cache)"
        return flags, flags, "off in both (--no-cache): every clip decoded with decord" + note
    if has_dir:
        return (["--cache-dir", str(tmp / "frames-search")], ["--cache-dir", str(tmp / "frames-plain")],
                "on in both: each side starts with an empty cache folder of its own (--cache-dir)")
    return [], [], "on in both (DataConfig defaults), each side with an empty $XDG_CACHE_HOME of its own"


def search_trial_threads() -> int:
    """Torch threads a search trial trains with on the CPU: all the node's cores, since the device
    lease (trainer/cluster/lease.py) lets one training at a time use the node's CPU."""
    return os.cpu_count() or 1


# -- the run -------------------------------------------------------------------------------------

def _check_args(args: argparse.Namespace, trials: int, epochs: int) -> None:
    for flag, value in (("--trials", trials), ("--epochs", epochs), ("--timeout-s", args.timeout_s),
                        ("--cpu-threads", 1 if args.cpu_threads is None else args.cpu_threads),
                        ("--plain-threads", 1 if args.plain_threads is None else args.plain_threads)):
        if value < 1:
            raise SystemExit(f"{flag} {value}: must be >= 1")
    if args.loader_workers < 0:
        raise SystemExit(f"--loader-workers {args.loader_workers}: must be >= 0")
    if args.data is not None and not Path(args.data).exists():
        raise SystemExit(f"--data {args.data}: no such file or folder")


def prepare_data(args: argparse.Namespace, preset: Preset, tmp: Path) -> tuple[str, str]:
    """(dataset root, one-line description); generated unless --data. Indexed once here, so
    both sides read the same index cache."""
    root = args.data or str(generate(tmp / "data", videos=preset.videos, size=preset.size, seed=0))
    index = build_index(DataConfig(root=root))
    made = "" if args.data else f"generated, {preset.size} px, 3 s at 15 fps"
    return root, f"{root}: {len(index.train)} train / {len(index.val)} val videos {made}".rstrip()


def run_plain(argv: list[str], trials: list[dict], threads: int, tmp: Path, args: argparse.Namespace) -> dict:
    spec_path = tmp / "plain-spec.json"
    (tmp / "checkpoints").mkdir(exist_ok=True)
    spec_path.write_text(json.dumps({"argv": argv, "trials": trials, "threads": threads,
                                     "checkpoints": str(tmp / "checkpoints")}))
    # cwd is tmp: the repository reaches `python -m bench.search_overhead` through PYTHONPATH
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "xdg-plain"),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = run_logged([sys.executable, "-m", "bench.search_overhead", "--plain-spec", str(spec_path)], env=env,
                     cwd=tmp, timeout_s=args.timeout_s, verbose=args.verbose, log_path=tmp / "plain.log")
    if run["returncode"] != 0:
        tail = "\n".join(text for _, text in run["lines"][-30:])
        raise SystemExit(f"the plain run failed (exit {run['returncode']}):\n{tail}")
    return {**run, **json.loads(Path(str(spec_path) + ".out.json").read_text())}


def run_search(argv: list[str], tmp: Path, args: argparse.Namespace) -> dict:
    # Without RAY_ADDRESS the search starts a Ray of its own: one RAY_ADDRESS names (another run's)
    # has other work on it and would not be torn down with the search, unlike the plain side.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["XDG_CACHE_HOME"] = str(tmp / "xdg-search")
    run = run_logged([sys.executable, str(REPO_ROOT / "tune" / "search.py"), *argv], env=env, cwd=tmp,
                     timeout_s=args.timeout_s, verbose=args.verbose, log_path=tmp / "search.log")
    # Tune's trial folders are in the search folder's state subfolder (tune.config.layout), not at its top
    experiment = Path(layout.state_path(str(tmp / "results" / EXPERIMENT)))
    trials = read_search_trials(experiment) if experiment.is_dir() else []
    if run["returncode"] != 0 or not any(t["results"] for t in trials):
        tail = "\n".join(text for _, text in run["lines"][-40:])
        raise SystemExit(f"the search failed (exit {run['returncode']}, {len(trials)} trial folders):"
                         f"\n{tail}")
    return {**run, "raw_trials": trials, "spans": mlflow_spans(f"sqlite:///{tmp / 'mlruns.db'}")}


def run_sides(args: argparse.Namespace, preset: Preset, trials: int, epochs: int, tmp: Path) -> dict:
    """Data, then the search, then the plain run of the trials the search drew; their timelines."""
    load, search = [os.getloadavg()[0]], None       # before this script's own work (data generation)
    data, data_line = prepare_data(args, preset, tmp)
    search_cache, plain_cache, cache_line = cache_setup(args.no_cache, tmp)
    argv = {side: search_argv(args, data, tmp, epochs, trials, preset.batch_size, flags)
            for side, flags in (("search", search_cache), ("plain", plain_cache))}
    if args.plain_only:
        lrs = [1e-4 * 30 ** (i / max(1, trials - 1)) for i in range(trials)]
        chosen = [{"trial_id": f"t{i}", "batch_size": preset.batch_size, "lr": lr}
                  for i, lr in enumerate(lrs)]
    else:
        print(f"search: {trials} trial(s) x {epochs} epoch(s) through tune/search.py ...", file=sys.stderr,
              flush=True)
        search = run_search(argv["search"], tmp, args)
        load.append(os.getloadavg()[0])
        chosen = [{"trial_id": t["trial_id"], **t["params"]} for t in search["raw_trials"] if t["results"]]
    print(f"plain: the same {len(chosen)} training(s) in one process ...", file=sys.stderr, flush=True)
    threads = args.plain_threads or args.cpu_threads or search_trial_threads()
    plain = run_plain(argv["plain"], chosen, threads, tmp, args)
    load.append(os.getloadavg()[0])
    if search:
        p_epochs = [e for t in plain["trials"] for e in t["epochs"]]
        est = {"eval_s": statistics.mean(e["end"] - e["start"] - e["train_s"] for e in p_epochs),
               "checkpoint_s": statistics.mean(e["checkpoint_s"] for e in p_epochs)}
        search["trials"] = search_timeline(search["raw_trials"], search["spans"], est)
        search["overlap"] = side_summary(search["launch"], search["exit"], search["trials"])
    command = "vidtune search " + " ".join(argv["search"]).replace(str(tmp), "TMP")
    return {"plain": plain, "search": search, "data": data_line, "cache": cache_line, "load": load,
            "command": command, "trials": len(chosen)}


def header_lines(run: dict, args: argparse.Namespace, name: str, preset: Preset, epochs: int) -> list[str]:
    plain, search, load = run["plain"], run["search"], run["load"]
    lines = [
        f"\nSearch overhead, preset {name}: {run['trials']} trainings x {epochs} epoch(s), {args.model}, "
        f"batch {preset.batch_size}, {args.loader_workers} loader process(es), seed {args.seed}",
        f"data: {run['data']}",
        f"plain: one process, trainings one after another, {plain['threads']} torch thread(s), "
        f"{plain['device']}",
        f"search: {run['command']}",
        f"frame cache: {run['cache']}",
        f"machine: {os.cpu_count()} cores; load average (1 min) before / after search / after plain: "
        + " / ".join(f"{x:.1f}" for x in load),
    ]
    if search:
        lines.insert(4, f"  at most {search['overlap']['trials_at_once']} trial(s) and "
                        f"{search['overlap']['trainings_at_once']} training epoch(s) at once")
    # The load average after each side counts that side's own work; only the one before says the
    # machine was busy with something else (the CPU tables' "not sampled" row says it for the run).
    if load[0] > 0.5 * (os.cpu_count() or 1):
        lines.append("WARNING: the machine was busy before the run (load average above half its cores); "
                     "other processes may slow both sides, unevenly")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plain_spec:
        return plain_process(args.plain_spec)
    name = "quick" if args.quick else args.trial_seconds
    preset = PRESETS[name]
    trials, epochs = args.trials or preset.trials, args.epochs or preset.epochs
    _check_args(args, trials, epochs)
    with tempfile.TemporaryDirectory(prefix="vidtune-overhead-") as tmp:
        run = run_sides(args, preset, trials, epochs, Path(tmp))
    plain, search = run["plain"], run["search"]
    text, rows = report(plain, search, header=header_lines(run, args, name, preset, epochs),
                        target=preset.target_ratio)
    print(text)
    if args.json:
        write_json(args.json, {
            "ratio": rows[0]["search_s"] / rows[0]["plain_s"] if search else None,
            "target_ratio": preset.target_ratio, "preset": name, "trials": run["trials"], "epochs": epochs,
            "model": args.model, "batch_size": preset.batch_size, "frame_cache": run["cache"],
            "plain_threads": plain["threads"], "load_avg": run["load"], "search_command": run["command"],
            "trials_at_once": search["overlap"]["trials_at_once"] if search else None,
            "trainings_at_once": search["overlap"]["trainings_at_once"] if search else None,
            "rows": rows, "plain_trials": plain["trials"],
            "search_trials": search["trials"] if search else None,
            "cpu": {"plain": plain["cpu"].to_dict(), "search": search["cpu"].to_dict() if search else None},
            "cores_while_training": dict(zip(("plain", "search"), while_training(plain, search),
                                             strict=True))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
