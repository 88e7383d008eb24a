"""A search on a two-node Ray cluster (both nodes on this machine): trials land on both nodes and
every result comes back to the driver's MLflow store.

The cluster comes from `ray.cluster_utils.Cluster`, made and shut down in a helper process; the
search runs as a subprocess joined to it with `--address`, as `ray job submit ... python
tune/search.py --address auto` does on a real cluster. The pytest process stays out of it: it
may hold the session's local Ray (`ray_session`), and a process can be connected to only one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_cluster import PRELUDE

REPO_ROOT = Path(__file__).resolve().parents[1]
SEARCH_TIMEOUT_S = 420

# Each node has 1 CPU. A trial is a driver (0.1 CPU) plus one Train worker of 0.6 CPU, so a node
# holds at most one worker even when both drivers sit on it (0.2 + 0.6 <= 1 < 0.6 + 0.6): two
# trials running at once must use both nodes, whatever Ray's scheduling policy prefers.
NODE_CPUS = 1
CPUS_PER_WORKER = 0.6
TRIALS = 2


# Runs in its own process: making a `Cluster` points this process's Ray internals (internal KV)
# at the new cluster, and its shutdown resets them, which would break the session's Ray that the
# pytest process may hold (`ray_session`). Prints the address and node ids as one JSON line, then
# keeps the cluster until its stdin closes.
CLUSTER_PROCESS = PRELUDE + """
# Private, but Ray has no public way to forget the "latest cluster" record (Cluster.shutdown uses it too).
from ray._common.utils import reset_ray_address

cluster = start_head(num_cpus=NODE_CPUS)
# Cluster also records itself as the machine's latest Ray (/tmp/ray/ray_current_cluster), which
# any plain ray.init() here would then join; the search is given the address instead.
reset_ray_address()
try:
    cluster.add_node(num_cpus=NODE_CPUS)
    cluster.wait_for_nodes()
    assert cluster.address == os.environ["RAY_ADDRESS"], (cluster.address, os.environ["RAY_ADDRESS"])
    nodes = [n.node_id for n in cluster.list_all_nodes()]
    print(json.dumps({"address": cluster.address, "node_ids": nodes}), flush=True)
    sys.stdin.read()
finally:
    cluster.shutdown()
""".replace("NODE_CPUS", str(NODE_CPUS))


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The search must join the cluster given by --address, not one named in the environment.
    env.pop("RAY_ADDRESS", None)
    # Nor may the nodes' processes inherit the repository on their path: as on a real cluster,
    # the workers must get it from init_ray's runtime_env (else `import datasets` finds Hugging
    # Face's package, which is installed too).
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture
def two_node_cluster(tmp_path):
    """(address, node ids) of a head + one worker node, each with NODE_CPUS CPUs."""
    log_path = tmp_path / "cluster.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER_PROCESS], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True, env=_child_env(), cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"the two-node cluster did not start:\n{log_path.read_text()[-3000:]}")
        info = json.loads(line)
        yield info["address"], set(info["node_ids"])
    finally:
        proc.stdin.close()          # the process shuts its cluster down
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()


@pytest.mark.slow
def test_search_spreads_trials_over_both_nodes_and_collects_every_result(two_node_cluster, synthetic_root,
                                                                          tmp_path):
    from mlflow.tracking import MlflowClient

    address, node_ids = two_node_cluster
    assert len(node_ids) == 2
    db = tmp_path / "mlruns.db"
    cmd = [
        sys.executable, "tune/search.py",
        "--data", str(synthetic_root), "--model", "tiny",
        "--address", address,
        "--num-samples", str(TRIALS), "--epochs", "1", "--batch-sizes", "4", "--no-early-stop",
        "--no-log-model",
        # The tiny model's own clip size, decoded in the training process (no loader processes).
        "--num-frames", "8", "--height", "64", "--width", "64", "--loader-workers", "0",
        "--cpus-per-worker", str(CPUS_PER_WORKER),
        "--storage", str(tmp_path / "results"),
        "--mlflow-uri", f"sqlite:///{db}", "--experiment", "multinode",
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_child_env(), capture_output=True, text=True,
                          timeout=SEARCH_TIMEOUT_S)
    output = f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, output
    assert f"{TRIALS} at a time" in proc.stdout, output

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("multinode")
    assert experiment is not None, output
    runs = client.search_runs([experiment.experiment_id])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == TRIALS, output
    for run in children:
        assert run.info.status == "FINISHED", (run.info.run_name, run.data.tags)
        assert run.data.tags["mlflow.parentRunId"] == parents[0].info.run_id
        assert run.data.tags.get("vidtune.trial_id")
        for key in ("val_acc", "val_f1", "clips_per_s", "epoch_time_s", "data_wait_frac"):
            assert key in run.data.metrics, (key, run.data.metrics)
        assert 0.0 <= run.data.metrics["val_acc"] <= 1.0
        assert run.data.metrics["clips_per_s"] > 0
    # The point of the test: rank 0 of the trials ran on both machines, and each tag names a real node.
    placed = {run.data.tags.get("vidtune.node_id") for run in children}
    assert placed == node_ids, f"trials ran on {placed}; cluster nodes {node_ids}"


# bench/trial_overhead.py measures what each of these trials costs beyond training; its input
# checks run before Ray starts, so they are cheap to test here.
@pytest.mark.parametrize("argv, flag", [
    (["--repeats", "0"], "--repeats"),
    (["--cpus-per-worker", "0"], "--cpus-per-worker"),
    (["--health-check-interval-s", "-1"], "--health-check-interval-s"),
    # Asks more CPUs than the local Ray has: the trial would wait forever, so it is refused.
    (["--num-cpus", "2", "--train-workers", "2", "--cpus-per-worker", "1"], "--num-cpus 2"),
])
def test_trial_overhead_bench_refuses_bad_flags_before_starting_ray(argv, flag, monkeypatch):
    import importlib.util


    spec = importlib.util.spec_from_file_location("trial_overhead", REPO_ROOT / "bench" / "trial_overhead.py")
    trial_overhead = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trial_overhead)

    def no_ray(*args, **kwargs):
        raise AssertionError("the bench started Ray despite a bad flag")

    monkeypatch.setattr("vidtune.trainer.launch.init_ray", no_ray)
    with pytest.raises(SystemExit) as exc:
        trial_overhead.main(argv)
    assert flag in str(exc.value)
