"""`--weights kinetics`: fetched once on the driver before Ray starts (trainer.models.registry.fetch_kinetics,
from trainer.training.model_checks), refused there in one line when offline with an empty cache, and
copied into the torch hub cache of every node of a cluster that lacks it (trainer/cluster/kinetics.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error

import pytest
import torch

from tests.fake_cluster import PRELUDE
from vidtune.flags import ConfigError
from vidtune.trainer.models import registry as models
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.model_checks import check_model


def _offline(monkeypatch):
    calls = []

    def no_network(*args, **kwargs):
        calls.append(args)
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torch.hub, "urlopen", no_network)
    return calls


def test_offline_with_an_empty_cache_is_refused_before_ray_naming_the_file(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    calls = _offline(monkeypatch)
    with pytest.raises(ConfigError) as info:
        check_model(TrainConfig(model="mvit_v2_s", weights="kinetics"))
    assert info.value.flag == "--weights"
    expected = tmp_path / "hub" / "checkpoints" / "mvit_v2_s-ae3be167.pth"
    assert f"copy it to {expected}" in str(info.value) and len(calls) == 1
    assert not expected.exists() and not list(expected.parent.glob("*"))   # nothing half-written


def test_a_prefilled_cache_is_used_offline_and_fetched_once(monkeypatch, tmp_path):
    """The driver's check finds the file and downloads nothing; building the model in a worker
    reads that same file."""
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    calls = _offline(monkeypatch)
    path = models.kinetics_file("mvit_v2_s")
    path.parent.mkdir(parents=True)
    torch.save(models.build_model("mvit_v2_s", num_classes=400).state_dict(), path)
    check_model(TrainConfig(model="mvit_v2_s", weights="kinetics"))
    assert models.fetch_kinetics("mvit_v2_s") == path
    model = models.build_model("mvit_v2_s", weights="kinetics")
    assert calls == [] and models.classifier(model).out_features == 2


CLUSTER = PRELUDE + r"""
driver_home, node_home = sys.argv[1], sys.argv[2]
os.environ["TORCH_HOME"] = driver_home
cluster = start_head(num_cpus=1, env_vars={"TORCH_HOME": driver_home})
try:
    cluster.add_node(num_cpus=1, env_vars={"TORCH_HOME": node_home})
    cluster.wait_for_nodes()
    import ray
    ray.init(address=cluster.address)
    from vidtune.trainer.cluster.kinetics import copy_to_every_node
    source = Path(driver_home) / "hub" / "checkpoints" / "weights-0123abcd.pth"
    source.parent.mkdir(parents=True)
    source.write_bytes(os.urandom(3 << 20))
    first = copy_to_every_node(source)
    second = copy_to_every_node(source)
    print(json.dumps({"first": first, "second": second}), flush=True)
    ray.shutdown()
finally:
    cluster.shutdown()
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_drivers_file_is_copied_once_to_a_node_without_it(tmp_path):
    """A head whose cache has the file and a node whose cache (another TORCH_HOME) does not:
    the node gets a byte-identical copy; a second call copies nothing."""
    driver_home, node_home = tmp_path / "driver", tmp_path / "node"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", CLUSTER, str(driver_home), str(node_home)], env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["first"]) == 1 and result["second"] == [], result
    copied = node_home / "hub" / "checkpoints" / "weights-0123abcd.pth"
    source = driver_home / "hub" / "checkpoints" / "weights-0123abcd.pth"
    assert copied.read_bytes() == source.read_bytes()
    assert [p.name for p in copied.parent.iterdir()] == [copied.name]   # no partial file left
