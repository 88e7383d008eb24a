"""The clip cache filled on every node that trains before the first trial (tune/node_cache.py),
on Ray's fake cluster: a head (the driver's node, skipped: the driver fills its own) and a
worker node whose cache folder differs ($XDG_CACHE_HOME per node, as two machines' disks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.fake_cluster import PRELUDE

CLUSTER = PRELUDE + r"""
data_root, head_cache, node_cache = sys.argv[1], sys.argv[2], sys.argv[3]
cluster = start_head(num_cpus=1, env_vars={"XDG_CACHE_HOME": head_cache})
try:
    cluster.add_node(num_cpus=1, env_vars={"XDG_CACHE_HOME": node_cache})
    cluster.wait_for_nodes()
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
    print(json.dumps({"videos": len(videos), "first": first, "second": second}), flush=True)
    ray.shutdown()
finally:
    cluster.shutdown()
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_other_training_node_fills_its_own_cache_before_the_first_trial(synthetic_root, tmp_path):
    head_cache, node_cache = tmp_path / "head-cache", tmp_path / "node-cache"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    argv = [sys.executable, "-c", CLUSTER, str(synthetic_root), str(head_cache), str(node_cache)]
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
