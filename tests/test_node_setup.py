"""trainer/cluster/node_setup.py and the once-per-node fill of trainer/cluster/node_cache.py: what a
worker checks on its node before it trains, so that a node joining after the search started (an
autoscaled or KubeRay pod) gets the Kinetics weights and a filled clip cache before its first
timed epoch, and a node that has them costs a file check. The cross-node copy and fill on a node
added to a running Ray cluster: tests/test_multinode.py; in a search on an autoscaling cluster:
tests/test_autoscaling_cluster.py."""
from __future__ import annotations

import pytest

from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index
from vidtune.trainer.cluster import node_cache, node_setup
from vidtune.trainer.cluster.node_setup import NodeSetup, copy_weights_here, prepare_this_node


@pytest.fixture
def few_videos(synthetic_root, tmp_path):
    data = DataConfig(root=str(synthetic_root), clip_cache_dir=str(tmp_path / "clips"),
                      clip_cache_format="raw")
    index = build_index(data)
    return data, list(index.train)[:3] + list(index.val)[:1]


def test_a_node_is_filled_once_and_then_only_checked(few_videos, monkeypatch):
    data, videos = few_videos
    first = node_cache.fill_this_node(data, videos, 32, 32, False, once=True)
    assert "wrote 4 entries" in first, first

    def no_fill(*args, **kwargs):
        raise AssertionError("a node marked filled was decoded again")

    with monkeypatch.context() as m:
        m.setattr(node_cache, "fill_cache", no_fill)
        assert node_cache.fill_this_node(data, videos, 32, 32, False, once=True) == ""
    # the start of a search fills anyway (cheap when cached), and another size is another fill
    assert "wrote 0 entries" in node_cache.fill_this_node(data, videos, 32, 32, False)
    assert "wrote 4 entries" in node_cache.fill_this_node(data, videos, 48, 32, False, once=True)
    assert node_cache.fill_key(videos, 32, 32, "raw") != node_cache.fill_key(videos[:3], 32, 32, "raw")


def test_a_worker_on_a_prepared_node_does_nothing(few_videos, monkeypatch, tmp_path):
    import torch

    data, videos = few_videos
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    weights = tmp_path / "hub" / "checkpoints" / "mvit_v2_s-ae3be167.pth"
    weights.parent.mkdir(parents=True)
    weights.write_text("here already")
    monkeypatch.setattr(node_setup.ray, "remote", lambda *a, **k: pytest.fail("asked the driver's node"))
    setup = NodeSetup("driver-node", kinetics_path="/on/the/driver/mvit_v2_s-ae3be167.pth", fill_cache=True)
    assert copy_weights_here(setup) is None and copy_weights_here(NodeSetup("driver-node")) is None
    node_cache.fill_this_node(data, videos, 32, 32, False)           # the search's start-of-search fill
    assert prepare_this_node(setup, data, videos, height=32, width=32, on_gpu=False) == []
    # Without a fill at the start (--no-cache), no fill here either.
    lines = prepare_this_node(NodeSetup("driver-node"), data, videos, height=64, width=64, on_gpu=False)
    assert lines == []


def test_a_node_without_the_fill_gets_it_before_training_with_a_line(few_videos):
    data, videos = few_videos
    (line,) = prepare_this_node(NodeSetup("driver-node", fill_cache=True), data, videos, height=32, width=32,
                                on_gpu=False)
    assert "joined after the search started" in line and "wrote 4 entries" in line, line
    assert prepare_this_node(NodeSetup("driver-node", fill_cache=True), data, videos, height=32, width=32,
                             on_gpu=False) == []


def test_the_setup_crosses_the_ray_boundary_as_a_dict():
    setup = NodeSetup("abc", kinetics_path="/x/w.pth", fill_cache=True)
    assert NodeSetup.from_dict(setup.to_dict()) == setup and NodeSetup.from_dict(None) is None


def test_a_search_trials_workers_check_their_node_before_they_build_the_run(monkeypatch):
    """The wiring: the trainer carries the setup to its workers (build_torch_trainer), and a
    worker checks its node (`prepare_for_run`) before it builds the run, only when given one."""
    from types import SimpleNamespace

    import torch

    from vidtune.trainer.cluster import worker
    from vidtune.trainer.cluster.build_trainer import build_torch_trainer
    from vidtune.trainer.cluster.cpu_share import CpuPlan
    from vidtune.trainer.cluster.node_setup import NODE_SETUP_CONFIG_KEY
    from vidtune.trainer.training.config import TrainConfig

    setup = NodeSetup("driver-node", kinetics_path="/w.pth", fill_cache=True)
    assert build_torch_trainer(TrainConfig(), node_setup=setup).train_loop_config[NODE_SETUP_CONFIG_KEY] == \
        setup.to_dict()
    assert NODE_SETUP_CONFIG_KEY not in build_torch_trainer(TrainConfig()).train_loop_config
    calls = []
    monkeypatch.setattr(worker.ray.train, "get_context",
                        lambda: SimpleNamespace(get_world_rank=lambda: 0, get_world_size=lambda: 1))
    monkeypatch.setattr(worker, "train_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(worker, "_use_allocated_cpus", lambda cfg, on_gpu: CpuPlan(1, 0))
    monkeypatch.setattr(worker, "prepare_for_run",
                        lambda s, cfg, index, on_gpu: calls.append(("prepare", s)) or [])
    monkeypatch.setattr(worker, "build_run", lambda cfg, index, **kw: calls.append(("build", None)) or "run")
    index = SimpleNamespace(train=[], val=[])
    worker._setup(TrainConfig(), slot=None, index=index, node_setup=setup)   # type: ignore[arg-type]
    assert calls == [("prepare", setup), ("build", None)]
    calls.clear()
    worker._setup(TrainConfig(), slot=None, index=index)   # type: ignore[arg-type]
    assert calls == [("build", None)]
