"""Multi-node behaviour on Ray's fake two-node cluster (both nodes on this machine): the clip
cache filled on every node that trains before the first trial (trainer/cluster/node_cache.py), with a head
(the driver's node, skipped: the driver fills its own) and a worker node whose cache folder
differs ($XDG_CACHE_HOME per node, as two machines' disks); then a node that joins later, whose
workers' check copies the Kinetics weights there and fills its cache once
(trainer/cluster/node_setup.py).

A search spreading its trials over several nodes and collecting every result in the driver's
MLflow store is checked on the autoscaling cluster's search (tests/test_autoscaling_cluster.py),
which runs its trials on two GPU nodes; this file's own two-node search was the same check.
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

# Runs in its own process: making a `Cluster` points this process's Ray internals at the new
# cluster, and its shutdown resets them, which would break the session's Ray that the pytest
# process may hold (`ray_session`). No dashboard: nothing here reads it, and it is a process less
# on the 2 cores. The driver's node is the head; the fill runs twice.
CLUSTER = PRELUDE + r"""
data_root, head_cache, node_cache = sys.argv[1], sys.argv[2], sys.argv[3]
cluster = start_head(num_cpus=1, include_dashboard=False, env_vars={"XDG_CACHE_HOME": head_cache})
try:
    cluster.add_node(num_cpus=1, env_vars={"XDG_CACHE_HOME": node_cache})
    cluster.wait_for_nodes()
    import ray
    ray.init(address=cluster.address)
    from vidtune.datasets.config import DataConfig
    from vidtune.datasets.index import build_index
    from vidtune.trainer.cluster.node_cache import fill_every_node
    data = DataConfig(root=data_root)
    index = build_index(data)
    videos = list(index.train) + list(index.val)
    skip = ray.get_runtime_context().get_node_id()
    first = fill_every_node(data, videos, height=32, width=32, on_gpu=False, skip=skip)
    second = fill_every_node(data, videos, height=32, width=32, on_gpu=False, skip=skip)
    # A node that joins after those fills (an autoscaled or KubeRay pod): a worker's check there,
    # twice, as two trials' workers would (trainer/cluster/node_setup.py).
    late_cache, late_torch, driver_weights = sys.argv[4], sys.argv[5], sys.argv[6]
    late = cluster.add_node(num_cpus=1, env_vars={"XDG_CACHE_HOME": late_cache, "TORCH_HOME": late_torch})
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from vidtune.trainer.cluster.node_setup import NodeSetup, prepare_this_node
    setup = NodeSetup(skip, kinetics_path=driver_weights, fill_cache=True)

    def check_twice():
        import torch.hub
        lines = [prepare_this_node(setup, data, videos, height=32, width=32, on_gpu=False) for _ in range(2)]
        return lines, (Path(torch.hub.get_dir()) / "checkpoints" / Path(driver_weights).name).read_text()

    on_late = NodeAffinitySchedulingStrategy(late.node_id, soft=False)
    check = ray.remote(num_cpus=0)(check_twice).options(scheduling_strategy=on_late)
    late_lines, copied = ray.get(check.remote(), timeout=200)
    print(json.dumps({"videos": len(videos), "first": first, "second": second, "late": late_lines,
                      "copied": copied}), flush=True)
    ray.shutdown()
finally:
    cluster.shutdown()
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_other_training_node_fills_its_own_cache_before_the_first_trial(synthetic_root, tmp_path):
    head_cache, node_cache = tmp_path / "head-cache", tmp_path / "node-cache"
    late_cache, late_torch = tmp_path / "late-cache", tmp_path / "late-torch"
    driver_weights = tmp_path / "driver-hub" / "checkpoints" / "mvit_v2_s-ae3be167.pth"
    driver_weights.parent.mkdir(parents=True)
    driver_weights.write_text("the driver's Kinetics-400 weights")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    argv = [sys.executable, "-c", CLUSTER, str(synthetic_root), str(head_cache), str(node_cache),
            str(late_cache), str(late_torch), str(driver_weights)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (first,), (second,) = result["first"].values(), result["second"].values()
    n = result["videos"]
    # The worker node decoded every video into its own cache; the head's (skipped) is untouched.
    assert f"wrote {n} entries" in first and str(node_cache) in first, first
    assert "wrote 0 entries" in second and f"{n} already cached" in second, second
    assert any((node_cache / "vidtune" / "clips").rglob("*")) and not head_cache.exists()
    assert "clip cache on node" in proc.stdout and "filling it on 1 other node(s)" in proc.stdout
    # The late node: its first check copied the driver's weights into its own hub cache and
    # decoded every video into its own clip cache, before training; the second did nothing.
    first_check, second_check = result["late"]
    assert any("Kinetics-400 weights mvit_v2_s-ae3be167.pth: copied to" in line and str(late_torch) in line
               for line in first_check), first_check
    assert any("joined after the search started" in line and f"wrote {n} entries" in line
               and str(late_cache) in line for line in first_check), first_check
    assert second_check == [] and result["copied"] == "the driver's Kinetics-400 weights"
    assert any((late_cache / "vidtune" / "clips").rglob("*.json"))


# bench/trial_overhead.py measures what a trial costs beyond training; its input
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

    monkeypatch.setattr("vidtune.trainer.ray_setup.launch.init_ray", no_ray)
    with pytest.raises(SystemExit) as exc:
        trial_overhead.main(argv)
    assert flag in str(exc.value)
