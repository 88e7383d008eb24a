"""A search on Ray's simulated autoscaling cluster: a CPU head alone at first, and a GPU node type
the autoscaler may start twice (Ray's fake multi-node provider runs each "node" as local
processes with the declared resources). The search waits for the GPU nodes instead of refusing,
its pending trials make the autoscaler start them, and the trials train on both at once. The
head has little memory for Ray's tasks (4.6 GiB): a trial's Tune driver and Ray Train controller
(~0.9 GB) may land there, so the search runs only the trials the head holds, and says so; where
each driver, controller and training worker ran is read back from Ray's record of its actors.

It also stands for a search spread over a multi-node cluster (it was tests/test_multinode.py's
own search, on a second cluster): the trials' rank 0 ran on both GPU nodes, each tag naming a
real node, and every trial's result came back to the driver's MLflow store under the search's
parent run. As there, the nodes' processes do not inherit the repository on PYTHONPATH: the
workers get the code as on a real cluster.

This is what `ray.cluster_utils.AutoscalingCluster` sets up, without its `ray stop --force`
(which would end every Ray on the machine, the test session's too): the cluster gets its own
ports and is ended by killing the processes that name its GCS address.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.test_simulated_gpus import training_windows

REPO_ROOT = Path(__file__).resolve().parents[1]
SEARCH = [sys.executable, str(REPO_ROOT / "tune" / "search.py")]


HEAD_MEMORY = int(4.6 * 2**30)     # the head's memory for Ray's tasks: 2 trials (tune.running.cluster)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_config(gcs_address: str) -> dict:
    """The fake multi-node provider's cluster config: a 1-CPU head, up to 2 GPU nodes of 2 CPUs
    (room for a lead and a follower trial on each: the head's memory is what holds trials back)."""
    return {
        "cluster_name": "vidtune-test", "max_workers": 2, "upscaling_speed": 1.0, "idle_timeout_minutes": 5,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs_address},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "gpu_node": {"resources": {"CPU": 2, "GPU": 1}, "node_config": {}, "min_workers": 0,
                         "max_workers": 2},
        },
        "head_node_type": "ray.head.default", "auth": {}, "docker": {}, "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
        "rsync_filter": [], "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


def cluster_env() -> dict[str, str]:
    # RAY_AUTH_MODE: the same (none) for the cluster and the search, whatever ~/.ray holds.
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_AUTH_MODE": "disabled",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    # Nor may the nodes' processes inherit the repository on their path: as on a real cluster,
    # the workers must get it from init_ray's runtime_env (else `import datasets` finds Hugging
    # Face's package, which is installed too).
    env.pop("PYTHONPATH", None)
    return env


def end_cluster(port: int) -> None:
    """Kill every process of the cluster whose GCS listens on `port` (its own only)."""
    out = subprocess.run(["pgrep", "-f", f"[:=]{port}( |$)"], capture_output=True, text=True).stdout
    for pid in map(int, out.split()):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_search_waits_for_gpu_nodes_and_trains_on_two_at_once(synthetic_root, tmp_path):
    import tempfile

    import ray

    port = free_port()
    ip = ray.util.get_node_ip_address()       # the fake provider's nodes join the GCS at this address
    temp_dir = tempfile.mkdtemp(prefix="vt-ray-", dir="/tmp")   # short: Ray's socket paths must fit 107 bytes
    config = tmp_path / "cluster.json"
    config.write_text(json.dumps(cluster_config(f"{ip}:{port}")))
    env = cluster_env()
    start = ["ray", "start", "--head", f"--port={port}", "--num-cpus=1", f"--memory={HEAD_MEMORY}",
             f"--autoscaling-config={config}", f"--dashboard-port={free_port()}",
             f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
             f"--temp-dir={temp_dir}"]
    subprocess.run(start, env=env, check=True, capture_output=True, timeout=120)
    try:
        uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
        search_env = {**env, "VIDTUNE_SIMULATE_GPUS": "1"}   # the nodes' GPUs do not exist: train on the CPU
        search_env.pop("RAY_FAKE_CLUSTER")
        out = subprocess.run(SEARCH + ["--address", f"{ip}:{port}", "--cluster-config", str(config),
                                       "--data", str(synthetic_root), "--num-samples", "3", "--epochs", "2",
                                       "--batch-sizes", "4", "--cpus-per-worker", "0.8",
                                       "--loader-workers", "0", "--cpu-threads", "1", "--no-early-stop",
                                       "--no-log-model",
                                       "--probe-batch-size", "--storage", str(tmp_path / "results"),
                                       "--mlflow-uri", uri, "--name", "autoscaled"],
                             cwd=tmp_path, env=search_env, capture_output=True, text=True, timeout=540)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        actors = json.loads(subprocess.run(["ray", "list", "actors", "--address", f"{ip}:{port}", "--format",
                                            "json", "--detail", "--limit", "10000"], env=env, check=True,
                                           capture_output=True, text=True, timeout=120).stdout)
        head_id = json.loads(subprocess.run(["ray", "list", "nodes", "--address", f"{ip}:{port}", "--format",
                                             "json", "--filter", "is_head_node=True"], env=env, check=True,
                                            capture_output=True, text=True, timeout=120).stdout)[0]["node_id"]
    finally:
        end_cluster(port)
        shutil.rmtree(temp_dir, ignore_errors=True)
    # Sized by the nodes the autoscaler can start (2 GPU nodes, a lead and a follower each: 3 of
    # the 3 trials), not the CPU head alone; then by the head's memory: 2 at once, and it says why.
    assert "the Ray cluster has 0 GPU(s) now" in out.stdout, out.stdout
    assert "3 trial(s), 2 at a time on 2 GPU(s)" in out.stdout, out.stdout
    assert "2 trials at a time, not 3: the head node's 4.6 GB for Ray's tasks holds 2" in out.stdout, \
        out.stdout
    # Where the drivers and controllers ran, from Ray's record of every actor (the dead ones too):
    # Ray puts a trial's driver wherever its 0.1-CPU bundle fits (the head or a GPU node) and
    # Train V2 its controller beside it. 2 trial drivers for 3 trials when Tune reuses a finished
    # trial's (it did in every run here; a third would not break the cap, only the reuse).
    by_class: dict[str, set[str]] = {}
    for actor in actors:
        by_class.setdefault(actor["class_name"], set()).add(actor["node_id"])
    placed = {cls: sorted(by_class.get(cls, ()))
              for cls in ("ImplicitFunc", "TrainController", "RayTrainWorker")}
    print("head", head_id, "actors' nodes", placed)
    assert 2 <= len([a for a in actors if a["class_name"] == "ImplicitFunc"]) <= 3, placed
    assert len([a for a in actors if a["class_name"] == "TrainController"]) == 3, placed
    assert by_class["TrainController"] <= by_class["ImplicitFunc"], placed   # beside their drivers
    assert head_id not in by_class["RayTrainWorker"] and len(by_class["RayTrainWorker"]) == 2, placed
    # the batch probe waits for the first GPU node rather than skipping, and says so
    assert "--probe-batch-size: waiting for the first GPU node to join" in out.stdout, out.stdout
    assert re.search(r"--probe-batch-size: probed after \d+ s", out.stdout), out.stdout
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("vidtune")
    runs = client.search_runs([experiment.experiment_id], "tags.`mlflow.parentRunId` != ''")
    assert len(runs) == 3 and all(r.info.status == "FINISHED" for r in runs), [r.info.status for r in runs]
    # Every trial's result in the driver's store, under the search's one parent run.
    parents = [r for r in client.search_runs([experiment.experiment_id])
               if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED", [p.info for p in parents]
    for run in runs:
        assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id, run.data.tags
        assert run.data.tags.get("vidtune.trial_id"), run.data.tags
        for key in ("val_acc", "val_f1", "clips_per_s", "epoch_time_s", "data_wait_frac"):
            assert key in run.data.metrics, (key, run.data.metrics)
        assert 0.0 <= run.data.metrics["val_acc"] <= 1.0
        assert run.data.metrics["clips_per_s"] > 0
    assert all(r.data.tags.get("node") for r in runs)                    # where it ran (the node's IP)
    nodes = {r.data.tags.get("vidtune.node_id") for r in runs}           # the fake nodes share one IP
    assert nodes == by_class["RayTrainWorker"], nodes                    # trials on both GPU nodes
    assert all(r.data.tags.get("gpu_ids") == "0" for r in runs)          # each node's one GPU
    windows = sorted((w[0][0], w[-1][1]) for w in training_windows(tmp_path / "results").values())
    assert len(windows) == 3 and windows[0][1] > windows[1][0], windows  # the first two at the same time
