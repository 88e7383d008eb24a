"""`vidtune search` with VIDTUNE_SIMULATE_GPUS=4: placement, leases and recorded GPU ids as
on a 4-GPU machine, the trainings themselves on the CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

REPO_ROOT = Path(__file__).resolve().parents[1]
SEARCH = [sys.executable, str(REPO_ROOT / "tune" / "search.py")]


def training_windows(storage: Path) -> dict[str, list[tuple[float, float]]]:
    """Trial folder name (the MLflow run name) -> (start, end) unix seconds of each epoch it
    trained, from Tune's results (result.json of each trial)."""
    windows = {}
    for file in storage.glob("*/ray/*/result.json"):   # Tune's trial folders, in each search's ray/
        rows = sorted((json.loads(line) for line in file.read_text().splitlines() if line.strip()),
                      key=lambda r: r["epoch"])
        windows[file.parent.name] = [(r["epoch_start_ts"], r["epoch_end_ts"]) for r in rows]
    return windows


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_five_trials_on_four_simulated_gpus_use_every_gpu_one_training_each(synthetic_root, tmp_path):
    env = {**os.environ, "VIDTUNE_SIMULATE_GPUS": "4"}
    env.pop("RAY_ADDRESS", None)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    # 0.2 CPUs a worker: the 2 cores hold all 5 trials at once, 4 leads (one training per GPU) and
    # a follower behind one of them; one torch thread each keeps 4 CPU trainings from thrashing.
    out = subprocess.run(SEARCH + ["--data", str(synthetic_root), "--num-samples", "5", "--epochs", "2",
                                   "--batch-sizes", "4", "--cpus-per-worker", "0.2", "--cpu-threads", "1",
                                   "--loader-workers", "0", "--no-early-stop", "--no-log-model",
                                   "--storage", str(tmp_path / "results"), "--mlflow-uri", uri],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "5 trial(s), 5 at a time on 4 GPU(s) (simulated: training on the CPU)" in out.stdout, out.stdout

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("vidtune")
    runs = client.search_runs([experiment.experiment_id], "tags.`mlflow.parentRunId` != ''")
    assert len(runs) == 5 and all(r.info.status == "FINISHED" for r in runs), [r.info.status for r in runs]
    gpu_of = {r.info.run_name: r.data.tags["gpu_ids"] for r in runs}
    assert set(gpu_of.values()) == {"0", "1", "2", "3"}                   # every GPU trained
    windows = training_windows(tmp_path / "results")
    assert set(windows) == set(gpu_of) and all(len(w) == 2 for w in windows.values()), windows
    # The first four trainings to start ran at once, each on its own GPU (the leads).
    first = sorted(windows, key=lambda run: windows[run][0][0])[:4]
    assert sorted(gpu_of[run] for run in first) == ["0", "1", "2", "3"], (first, gpu_of)
    assert max(windows[run][0][0] for run in first) < min(windows[run][-1][1] for run in first)
    # Never two trainings on one GPU at once (one GPU had two trials): the device lease,
    # keyed by the physical GPU id.
    for a in windows:
        for b in windows:
            if a < b and gpu_of[a] == gpu_of[b]:
                for s1, e1 in windows[a]:
                    for s2, e2 in windows[b]:
                        assert e1 <= s2 or e2 <= s1, (a, b, gpu_of[a])
    assert all(r.data.metrics["concurrent_trainings"] == 1 for r in runs)
    # Free, then hand over: the lease's record (device_lease.json beside the search's log) has
    # every trial give its GPU back holding no device memory, and the follower granted that GPU
    # only at the release, its first step after it.
    (record_file,) = (tmp_path / "results").glob("*/device_lease.json")
    record = json.loads(record_file.read_text())
    name_of = {r.data.tags["vidtune.trial_id"]: r.info.run_name for r in runs}
    releases = [e for e in record if e["event"] == "release"]
    assert sorted(name_of[e["owner"]] for e in releases) == sorted(gpu_of), record
    assert all(e["device_mb"] == 0.0 for e in releases), releases
    for grant in (e for e in record if e["event"] == "grant"):
        before = [e for e in releases if e["keys"] == grant["keys"] and e["time"] <= grant["time"]]
        others = [e for e in record if e["event"] == "grant" and e["keys"] == grant["keys"]
                  and e["time"] < grant["time"]]
        assert len(before) == len(others), (grant, record)     # each earlier holder had released
        assert windows[name_of[grant["owner"]]][0][0] >= grant["time"]


def test_a_bad_simulated_gpu_count_is_refused_naming_the_variable(synthetic_root, tmp_path):
    env = {**os.environ, "VIDTUNE_SIMULATE_GPUS": "four"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(SEARCH + ["--data", str(synthetic_root), "--dry-run",
                                   "--storage", str(tmp_path / "r"),
                                   "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "VIDTUNE_SIMULATE_GPUS" in out.stderr and "'four'" in out.stderr
