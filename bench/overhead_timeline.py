"""bench.search_overhead's timelines: the search's trials read back from its Tune folders and
MLflow store (trial spans, epochs, the console's stages) in the plain side's format, and where the
time of one side went (`side_summary`)."""
from __future__ import annotations

import functools
import json
import math
import statistics
import sys
from itertools import pairwise
from pathlib import Path

from mlflow.tracking import MlflowClient

from bench.common import max_overlap, union_length

EXPERIMENT = "search-overhead"      # the MLflow experiment and the Tune experiment name
TRIAL_ID_TAG = "vidtune.trial_id"   # the child-run tag tune/tracking/tracker.py writes


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
