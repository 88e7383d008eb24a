"""What Ray Tune + Train + MLflow cost around the same trainings: prints a side-by-side table.

The same N trainings run twice on this machine, one after the other:
  - search: `vidtune search` as a subprocess (Tune + Optuna + Train + MLflow into a
    temporary sqlite store and --storage), --no-early-stop, one batch size, --num-samples N;
  - plain: one Python process (also a subprocess, so both pay Python start and imports) running
    the project's own loop (`trainer.loop.train_one_epoch` / `evaluate`, data, model, optimiser
    and a checkpoint per epoch built as `trainer/worker.py` builds them) for the same trials
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
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
from mlflow.tracking import MlflowClient

from bench.common import format_table, max_overlap, union_length, write_json
from bench.cpu_usage import CpuSampler, CpuUsage
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import VideoIndex, build_index
from vidtune.datasets.synthetic import generate
from vidtune.trainer.config import TrainConfig
from vidtune.trainer.metrics import reduce_epoch
from vidtune.trainer.precision import default_device, is_cuda
from vidtune.trainer.run import (
    TRAINED,
    Run,
    build_run,
    data_counts,
    place_model,
    run_epoch,
    save_run_checkpoint,
)
from vidtune.tune import layout, searched
from vidtune.tune.options import base_config, parse_options
from vidtune.tune.options import build_parser as search_parser
from vidtune.tune.runner import fill_clip_cache
from vidtune.tune.trial import trial_config

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
EXPERIMENT = "search-overhead"      # the MLflow experiment and the Tune experiment name
TRIAL_ID_TAG = "vidtune.trial_id"   # the child-run tag tune/tracking/tracker.py writes


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


# -- the plain side ------------------------------------------------------------------------------

def plain_process(spec_path: str) -> int:
    """The plain side, in its own process: the trials of `spec_path` one after another; writes
    their timeline next to it (`<spec>.out.json`)."""
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    base = base_config(parse_options(spec["argv"]))
    index = build_index(base.data)
    print(index.summary(), flush=True)      # the same console markers as the search's
    device = default_device()
    # The clip cache filled before the first trial as the search does, its `auto` format resolved.
    base = fill_clip_cache(base, index, on_gpu=is_cuda(device))
    trials = []
    for trial in spec["trials"]:
        sampled = {p.name: trial[p.name] for p in searched.PARAMS if p.name in trial}
        row = _plain_trial(trial_config(base, sampled), index, device, spec["checkpoints"])
        trials.append({"trial_id": f"plain:{trial['trial_id']}", **row})
    out = {"trials": trials, "cache": base.data.clip_cache, "threads": torch.get_num_threads(),
           "device": str(device)}
    Path(spec_path + ".out.json").write_text(json.dumps(out))
    return 0


def _plain_trial(cfg: TrainConfig, index: VideoIndex, device: torch.device, checkpoints: str) -> dict:
    """One training built and run as a trial's worker does (`trainer.run`), without Ray; like a
    trial, it ends at an epoch that diverged or ran out of memory."""
    start = time.time()
    run = build_run(cfg, index, device=device)
    place_model(run)
    epochs = []
    for epoch in range(1, cfg.epochs + 1):
        row = _plain_epoch(run, epoch, checkpoints)
        if row is None:
            break
        epochs.append(row)
    reads, hits, _, _ = data_counts(run)
    del run                     # stops the persistent loader processes: part of the trial's end
    gc.collect()
    return {"batch_size": cfg.batch_size, "lr": cfg.lr, "start": start,
            "end": time.time(), "epochs": epochs, "cache_hit_frac": hits / reads if reads else None}


def _plain_epoch(run: Run, epoch: int, checkpoints: str) -> dict | None:
    """`run_epoch` and a checkpoint, timed; None when the epoch did not train to the end."""
    start = time.time()
    result = run_epoch(run, epoch)
    end = time.time()
    if result.outcome != TRAINED:
        print(f"plain: {result.outcome} in epoch {epoch} (lr {run.cfg.lr:.2e})", file=sys.stderr, flush=True)
        return None
    metrics = reduce_epoch(result.stats, result.eval_out)
    with tempfile.TemporaryDirectory(dir=checkpoints) as directory:
        save_run_checkpoint(run, directory, epoch=epoch, metrics=metrics)
    return {"epoch": epoch, "start": start, "train_s": result.stats.epoch_time_s, "end": end, "exact": True,
            "checkpoint_s": time.time() - end, "clips_per_s": metrics["clips_per_s"],
            "val_acc": metrics["val_acc"]}


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
    lease (trainer/lease.py) lets one training at a time use the node's CPU."""
    return os.cpu_count() or 1


# -- reading the search's results ----------------------------------------------------------------

def read_search_trials(experiment: Path) -> list[dict]:
    """Each trial folder's params.json and result.json lines (one per epoch)."""
    trials = []
    for folder in sorted(p for p in experiment.iterdir() if (p / "params.json").is_file()):
        lines = ((folder / "result.json").read_text().splitlines()
                 if (folder / "result.json").is_file() else [])
        results = [json.loads(line) for line in lines if line.strip()]
        trial_id = results[0]["trial_id"] if results else folder.name.split("_")[2]
        trials.append({"trial_id": trial_id, "params": json.loads((folder / "params.json").read_text()),
                       "results": [r for r in results if "epoch_time_s" in r]})
    return trials


def mlflow_spans(uri: str) -> dict[str, tuple[float, float | None]]:
    """trial id -> (start, end) unix s of its MLflow child run (opened / closed by the search's
    driver when Tune starts / ends the trial; millisecond resolution)."""
    try:
        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(EXPERIMENT)
        runs = client.search_runs([exp.experiment_id], max_results=10000) if exp else []
    except Exception as e:  # an unreadable store: fall back to Tune's own timestamps
        print(f"warning: MLflow store {uri} not readable ({e}); using Tune's timestamps (1 s resolution)",
              file=sys.stderr)
        return {}
    return {r.data.tags[TRIAL_ID_TAG]: (r.info.start_time / 1000,
                                        r.info.end_time / 1000 if r.info.end_time else None)
            for r in runs if TRIAL_ID_TAG in r.data.tags}


def _reported(results: list[dict], key: str) -> list[float]:
    """The values `results` report for `key` (results without it left out)."""
    return [float(r[key]) for r in results if r.get(key) is not None]


def search_timeline(trials: list[dict], spans: dict, est: dict[str, float]) -> list[dict]:
    """The search's trials in the plain side's timeline format. Epoch positions come from the
    reported epoch_start_ts / epoch_end_ts where present; otherwise from the report time
    (trial start + time_total_s) less the plain side's mean checkpoint and evaluation times."""
    out = []
    for t in trials:
        res = t["results"]
        span = spans.get(t["trial_id"])
        start = span[0] if span else (res[0]["timestamp"] - res[0]["time_total_s"] if res else None)
        if start is None:
            continue
        epochs = []
        for r in res:
            train = float(r["epoch_time_s"])
            if r.get("epoch_start_ts") and r.get("epoch_end_ts"):
                epochs.append({"epoch": r["epoch"], "start": r["epoch_start_ts"], "train_s": train,
                               "end": r["epoch_end_ts"], "exact": True})
                continue
            end = start + float(r["time_total_s"]) - est["checkpoint_s"]
            epochs.append({"epoch": r["epoch"], "start": end - est["eval_s"] - train, "train_s": train,
                           "end": end, "exact": False})
        end = span[1] if span and span[1] else (res[-1]["timestamp"] if res else start)
        values = functools.partial(_reported, res)
        out.append({"trial_id": t["trial_id"], "batch_size": t["params"].get("batch_size"),
                    "lr": t["params"].get("lr"), "start": start, "end": end, "epochs": epochs,
                    "device_wait_s": sum(values("device_wait_s")) if values("device_wait_s") else None,
                    "cache_hit_frac": (statistics.mean(values("cache_hit_frac"))
                                       if values("cache_hit_frac") else None),
                    "concurrent": max(values("concurrent_trainings"), default=None)})
    return sorted(out, key=lambda t: t["start"])


# (stage, text of its console line): both sides print the index summary and the cache fill report.
CONSOLE_MARKERS = (("data_indexed", "Probed "), ("cache_filled", "Cache usage "),
                   ("ray_up", "Started a local Ray instance"), ("ray_up", "Connected to Ray cluster"))


def stage_times(side: dict) -> dict[str, float]:
    """Seconds from one console stage to the next, launch to the first trial's start
    ("launch -> data indexed": Python start, imports, option checks, the data index)."""
    first = min(t["start"] for t in side["trials"])
    marks = console_markers(side["lines"])
    points = [("launch", side["launch"])] + [(n, marks[n]) for n, _ in CONSOLE_MARKERS
                                             if n in marks and marks[n] < first]
    points = sorted(dict.fromkeys(points), key=lambda p: p[1]) + [("first trial starts", first)]
    return {f"{a} -> {b}".replace("_", " "): tb - ta for (a, ta), (b, tb) in pairwise(points)}


def console_markers(lines: list[tuple[float, str]]) -> dict[str, float]:
    """Unix time of the first console line of each stage (data indexed, Ray up, search planned)."""
    found: dict[str, float] = {}
    for ts, text in lines:
        for name, needle in CONSOLE_MARKERS:
            if name not in found and needle in text:
                found[name] = ts
    return found


# -- where the time goes -------------------------------------------------------------------------

def side_summary(launch: float, exit_: float, trials: list[dict]) -> dict[str, float]:
    """Seconds of one side: wall, its parts around the trials, and sums over the trials' epochs."""
    spans = [(t["start"], t["end"]) for t in trials]
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    epochs = [e for t in trials for e in t["epochs"]]
    ran = [t for t in trials if t["epochs"]]
    mean = lambda xs: statistics.mean(xs) if xs else math.nan  # noqa: E731
    return {
        "wall_s": exit_ - launch,
        "before_first_trial_s": first - launch,
        "trials_running_s": union_length(spans),
        "between_trials_s": (last - first) - union_length(spans),
        "after_last_trial_s": exit_ - last,
        "training_s": sum(e["train_s"] for e in epochs),
        "evaluation_s": sum(e["end"] - e["start"] - e["train_s"] for e in epochs),
        "between_epochs_s": 0.0 + sum(b["start"] - a["end"] for t in ran for a, b in pairwise(t["epochs"])),
        "trial_start_to_first_epoch_s": mean([t["epochs"][0]["start"] - t["start"] for t in ran]),
        "last_epoch_to_trial_end_s": mean([t["end"] - t["epochs"][-1]["end"] for t in ran]),
        "no_training_s": (exit_ - launch) - union_length((e["start"], e["start"] + e["train_s"])
                                                         for e in epochs),
        "trials_at_once": max_overlap(spans),
        "trainings_at_once": max_overlap((e["start"], e["start"] + e["train_s"]) for e in epochs),
    }


ROWS = (  # (key, label) of the side-by-side table, in print order
    ("wall_s", "wall time"),
    ("before_first_trial_s", "  before the first trial starts"),
    ("trials_running_s", "  trials running (any)"),
    ("between_trials_s", "  between trials (none running)"),
    ("after_last_trial_s", "  after the last trial ends"),
    ("training_s", "training epochs: sum of epoch_time_s"),
    ("evaluation_s", "evaluation: sum"),
    ("between_epochs_s", "between epochs (metrics, checkpoint, report): sum"),
    ("trial_start_to_first_epoch_s", "trial start -> first epoch, mean"),
    ("last_epoch_to_trial_end_s", "last epoch scored -> trial end, mean"),
    ("no_training_s", "wall time with no training epoch running"),
)


def report(plain: dict, search: dict | None, *, header: list[str],
           target: float | None) -> tuple[str, list[dict]]:
    """The printed tables and the JSON rows."""
    p = side_summary(plain["launch"], plain["exit"], plain["trials"])
    s = side_summary(search["launch"], search["exit"], search["trials"]) if search else {}
    estimated = search is not None and any(not e["exact"] for t in search["trials"] for e in t["epochs"])
    rows = [{"name": key, "plain_s": p[key], "search_s": s.get(key)} for key, _ in ROWS]
    table = [(label + (" (est.)" if estimated and key == "evaluation_s" else ""), p[key], s.get(key),
              s[key] - p[key] if s else None) for key, label in ROWS]
    stages = {"plain": stage_times(plain), "search": stage_times(search) if search else {}}
    for stage in dict.fromkeys([*stages["plain"], *stages["search"]]):
        a, b = stages["plain"].get(stage), stages["search"].get(stage)
        rows.append({"name": f"before_first_trial:{stage}", "plain_s": a, "search_s": b})
        table.append((f"    {stage}", a, b, b - a if a is not None and b is not None else None))
    if search:
        waits = [t["device_wait_s"] for t in search["trials"] if t["device_wait_s"] is not None]
        if waits:
            rows.append({"name": "device_wait_s", "plain_s": None, "search_s": sum(waits)})
            table.append(("search: waiting for the device (lease), sum", None, sum(waits), None))
    lines = [*header, "", format_table(("seconds", "plain", "search", "search-plain"), table)]
    if search:
        ratio = s["wall_s"] / p["wall_s"]
        verdict = ("" if target is None
                   else f" (target <= {target:g}: {'met' if ratio <= target else 'NOT met'})")
        lines += ["", f"ratio search / plain wall time: {ratio:.2f}{verdict}"]
        if estimated:
            lines.append("(est.): the search reported no epoch_start_ts / epoch_end_ts; its epochs are "
                         "placed from the report times less the plain side's mean evaluation and checkpoint "
                         "times")
    lines += ["", "per trial:", trial_table(plain, search)]
    if plain["cpu"].by_kind:
        lines += ["", cpu_table(plain["cpu"], search["cpu"] if search else None, trials=len(plain["trials"]))]
        lines += ["", training_cpu_table(*while_training(plain, search))]
    return "\n".join(lines), rows


def cpu_table(plain: CpuUsage, search: CpuUsage | None, *, trials: int, top: int = 14) -> str:
    """CPU seconds of each side: the whole machine's, and per process kind (processes started,
    CPU seconds), the kinds that used the most first; `trials`: how many each side ran (the note)."""
    sides = [plain, search] if search else [plain]
    kinds = sorted({k for side in sides for k in side.by_kind},
                   key=lambda k: -max(side.by_kind.get(k, (0, 0.0))[1] for side in sides))
    shown, rest = kinds[:top], kinds[top:]

    def cells(side: CpuUsage | None, names: list[str]) -> list:
        if side is None:
            return [None, None]
        n = sum(side.by_kind.get(k, (0, 0.0))[0] for k in names)
        return [n, sum(side.by_kind.get(k, (0, 0.0))[1] for k in names)]

    rows = [(k, *cells(plain, [k]), *cells(search, [k])) for k in shown]
    if rest:
        rows.append((f"{len(rest)} other kinds", *cells(plain, rest), *cells(search, rest)))
    rows.append(("not sampled (short-lived, other load)", None, plain.machine_busy_s - plain.sampled_s,
                 None, search.machine_busy_s - search.sampled_s if search else None))
    rows.append(("whole machine, busy", None, plain.machine_busy_s, None,
                 search.machine_busy_s if search else None))
    rows.append(("  = cores busy on average", None, plain.machine_busy_s / max(plain.wall_s, 1e-9), None,
                 search.machine_busy_s / max(search.wall_s, 1e-9) if search else None))
    table = format_table(("CPU seconds by process kind", "plain n", "plain cpu_s", "search n",
                          "search cpu_s"), rows)
    note = (f"(n: processes of that kind started; {trials} trials on each side. Every Ray Train run starts "
            "its controller, its workers and helper actors in fresh processes; a worker's DataLoader "
            "processes carry its title, ray::RayTrainWorker.)")
    return table + "\n" + note


# The processes that train: on the plain side its one process (its DataLoader processes are forks
# with the same title), in the search the Ray Train workers (their loader processes likewise).
PLAIN_TRAINING_KIND = "python -m bench.search_overhead"
SEARCH_TRAINING_KIND = "ray::RayTrainWorker"


def training_cpu(side: dict, training_kind: str) -> dict:
    """Cores used on average while the side's training epochs ran (each epoch's
    start .. start + epoch_time_s): by the training processes, by every other process the side
    started, and by the whole machine (which adds anything else running)."""
    windows = [(e["start"], e["start"] + e["train_s"]) for t in side["trials"] for e in t["epochs"]]
    covered, busy, by_kind = side["cpu"].within(windows)
    if covered <= 0:
        return {"seconds": 0.0, "training": None, "others": None, "machine": None, "others_by_kind": {}}
    others = {k: cpu / covered for k, cpu in sorted(by_kind.items(), key=lambda kv: -kv[1])
              if k != training_kind}
    return {"seconds": covered, "training": by_kind.get(training_kind, 0.0) / covered,
            "others": sum(others.values(), 0.0), "machine": busy / covered, "others_by_kind": others}


def while_training(plain: dict, search: dict | None) -> tuple[dict, dict | None]:
    """`training_cpu` of each side."""
    return (training_cpu(plain, PLAIN_TRAINING_KIND),
            training_cpu(search, SEARCH_TRAINING_KIND) if search else None)


def training_cpu_table(plain: dict, search: dict | None, top: int = 6) -> str:
    """Who used the cores while the training epochs ran, each side: training processes, the rest."""
    sides = [plain, search] if search else [plain]
    rows = [("the training processes (with their loader processes)", *(s["training"] for s in sides)),
            ("every other process the run started", *(s["others"] for s in sides)),
            ("the whole machine, busy", *(s["machine"] for s in sides))]
    if search and search["others_by_kind"]:
        rows += [(f"  search: {k}", *([None] if len(sides) == 2 else []), cores)
                 for k, cores in list(search["others_by_kind"].items())[:top]]
    head = ("cores used while training epochs ran (average)", "plain", *(["search"] if search else []))
    note = ("(A training that uses every core slows by more than the share the other processes take: its "
            "threads wait for each other at every parallel step. python -m bench.cpu_noise measures it.)")
    return format_table(head, rows, digits=2) + "\n" + note


def trial_table(plain: dict, search: dict | None) -> str:
    rows = []
    for side in (plain, search) if search else (plain,):
        for t in side["trials"]:
            ep = t["epochs"]
            rows.append((t["trial_id"], t["batch_size"], f"{t['lr']:.2e}", len(ep),
                         sum(e["train_s"] for e in ep), sum(e["end"] - e["start"] - e["train_s"] for e in ep),
                         ep[0]["start"] - t["start"] if ep else None, t.get("device_wait_s"),
                         t["end"] - ep[-1]["end"] if ep else None, t["end"] - t["start"],
                         t.get("cache_hit_frac"), t.get("concurrent")))
    return format_table(("trial", "batch", "lr", "epochs", "train_s", "eval_s", "start_s", "wait_s", "end_s",
                         "total_s", "cache_hit", "concurrent"), rows, digits=2)


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
    # Tune's trial folders are in the search folder's state subfolder (tune.layout), not at its top
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
