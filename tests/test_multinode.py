"""One two-node Ray cluster (both nodes on this machine) for two checks: the clip cache is filled
on every other training node before the first trial (tune/node_cache.py), and a search's trials
land on both nodes with every result coming back to the driver's MLflow store.

The cluster comes from `ray.cluster_utils.Cluster`, made and shut down in a helper process, once
for this module; each node has a cache folder of its own ($XDG_CACHE_HOME per node, as two
machines' disks). The cache fill runs in that process as the cluster starts, before any search
(the search's trials would write to the head's cache too); the search runs as a subprocess joined
to the cluster with `--address`, as `ray job submit ... python tune/search.py --address auto`
does on a real cluster. The pytest process stays out of it: it may hold the session's local Ray
(`ray_session`), and a process can be connected to only one.
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
# pytest process may hold (`ray_session`). Fills the clip caches as a search's driver on the head
# would (`fill_every_node` skips the driver's node, which fills its own), twice; then prints the
# address, node ids and what the fills did as one JSON line, and keeps the cluster until its
# stdin closes.
CLUSTER_PROCESS = PRELUDE + r"""
# Private, but Ray has no public way to forget the "latest cluster" record (Cluster.shutdown uses it too).
from ray._common.utils import reset_ray_address

data_root, head_cache, node_cache = sys.argv[1], sys.argv[2], sys.argv[3]
cluster = start_head(num_cpus=NODE_CPUS, env_vars={"XDG_CACHE_HOME": head_cache})
# Cluster also records itself as the machine's latest Ray (/tmp/ray/ray_current_cluster), which
# any plain ray.init() here would then join; the search is given the address instead.
reset_ray_address()
try:
    cluster.add_node(num_cpus=NODE_CPUS, env_vars={"XDG_CACHE_HOME": node_cache})
    cluster.wait_for_nodes()
    assert cluster.address == os.environ["RAY_ADDRESS"], (cluster.address, os.environ["RAY_ADDRESS"])
    nodes = [n.node_id for n in cluster.list_all_nodes()]
    import ray
    ray.init(address=cluster.address)
    from vidtune.datasets.config import DataConfig
    from vidtune.datasets.index import build_index
    from vidtune.tune.node_cache import fill_every_node
    data = DataConfig(root=data_root)
    index = build_index(data)
    videos = list(index.train) + list(index.val)
    skip = ray.get_runtime_context().get_node_id()
    first = fill_every_node(data, videos, height=32, width=32, on_gpu=False, skip=skip)
    second = fill_every_node(data, videos, height=32, width=32, on_gpu=False, skip=skip)
    ray.shutdown()
    files = sum(1 for _ in (Path(node_cache) / "vidtune" / "clips").rglob("*"))
    print(json.dumps({"address": cluster.address, "node_ids": nodes, "videos": len(videos),
                      "first": first, "second": second, "head_cache_made": Path(head_cache).exists(),
                      "node_cache_files": files}), flush=True)
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


@pytest.fixture(scope="module")
def two_node_cluster(synthetic_root, tmp_path_factory):
    """A head + one worker node, each with NODE_CPUS CPUs and a cache folder of its own: the
    cluster process's JSON line (address, node ids, the two cache fills) and its folder."""
    folder = tmp_path_factory.mktemp("two-node")
    log_path = folder / "cluster.log"
    log = open(log_path, "w")
    argv = [sys.executable, "-c", CLUSTER_PROCESS, str(synthetic_root), str(folder / "head-cache"),
            str(folder / "node-cache")]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                            env=_child_env(), cwd=folder)
    try:
        lines = []          # Ray's own lines to the driver (the fills' progress) come before the JSON
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("{"):
                break
        if not lines or not lines[-1].startswith("{"):
            pytest.fail(f"the two-node cluster did not start:\n{log_path.read_text()[-3000:]}")
        yield {**json.loads(lines[-1]), "output": "".join(lines), "folder": folder}
    finally:
        proc.stdin.close()          # the process shuts its cluster down
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        log.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_other_training_node_fills_its_own_cache_before_the_first_trial(two_node_cluster):
    """Made as the cluster started (before any search): the head is the driver's node, skipped."""
    result = two_node_cluster
    head_cache, node_cache = result["folder"] / "head-cache", result["folder"] / "node-cache"
    (first,), (second,) = result["first"].values(), result["second"].values()
    n = result["videos"]
    # The worker node decoded every video into its own cache; the head's (skipped) is untouched.
    assert f"wrote {n} entries" in first and str(node_cache) in first, first
    assert "wrote 0 entries" in second and f"{n} already cached" in second, second
    assert result["node_cache_files"] > 0 and not result["head_cache_made"], (result, head_cache)
    output = result["output"]
    assert "clip cache on node" in output and "filling it on 1 other node(s)" in output, output


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_search_spreads_trials_over_both_nodes_and_collects_every_result(two_node_cluster, synthetic_root,
                                                                          tmp_path):
    from mlflow.tracking import MlflowClient

    address, node_ids = two_node_cluster["address"], set(two_node_cluster["node_ids"])
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
