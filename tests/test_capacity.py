"""vidtune.trainer.cluster.capacity: the one rule, for `vidtune train` and the search, that a training's
workers fit where it runs; and the node setup check's refusal of GPUs torch has no kernels for."""
from __future__ import annotations

import pytest

from vidtune.flags import ConfigError
from vidtune.trainer.cluster.capacity import WorkerRequest, check_fits, check_gpus_per_worker


def _refused(request: WorkerRequest, nodes, where="this machine") -> ConfigError:
    with pytest.raises(ConfigError) as e:
        check_fits(request, nodes, where=where, more="pass --address")
    return e.value


def test_a_share_of_a_gpu_with_several_workers_is_refused_naming_the_flag():
    with pytest.raises(ConfigError) as e:
        check_gpus_per_worker(0.5, 2, flag="--gpus-per-worker", workers_flag="--workers",
                              whole="--gpus-per-worker 1")
    assert e.value.flag == "--gpus-per-worker"
    assert "0.5 GPU per worker with --workers 2" in str(e.value) and "--gpus-per-worker 1" in str(e.value)
    with pytest.raises(ConfigError, match="whole number"):
        check_gpus_per_worker(1.5, 1, flag="--gpus-per-worker", workers_flag="--workers", whole="")
    for fine in ((None, 4), (0.0, 4), (0.5, 1), (1.0, 4), (2.0, 2)):
        check_gpus_per_worker(*fine, flag="--gpus-per-worker", workers_flag="--workers", whole="")


def test_more_gpus_or_cpus_than_the_nodes_have_are_refused_naming_the_flag_and_value():
    e = _refused(WorkerRequest(2, 1.0, 1.0, gpus_flag="--workers"), [(8.0, 1.0)])
    assert e.flag == "--workers"
    assert "asks for 2 GPU(s) (--workers 2 x 1 per worker) but this machine has 1" in str(e)
    e = _refused(WorkerRequest(3, 1.0, 0.0), [(2.0, 0.0)])
    assert e.flag == "--workers/--cpus-per-worker" and "asks for 3 CPUs" in str(e) and "has 2" in str(e)
    e = _refused(WorkerRequest(1, 1.95, 0.0, extra_cpus=0.1, what="a trial"), [(2.0, 0.0)])
    assert "plus 0.1 for its driver" in str(e)               # a trial's driver counts beside its workers
    check_fits(WorkerRequest(2, 1.0, 1.0), [(4.0, 2.0)], where="this machine", more="")   # fits


def test_workers_must_each_fit_on_one_node():
    """Totals that fit are not enough: Ray places each worker on one node, and Train waits without
    end for a worker no node can hold."""
    e = _refused(WorkerRequest(2, 4.0, 1.0), [(2.0, 1.0), (2.0, 1.0), (8.0, 0.0)], "the Ray cluster")
    assert e.flag == "--cpus-per-worker" and "0 of the 2 worker(s) fit" in str(e)
    assert "2 x (2 CPU, 1 GPU), 1 x (8 CPU)" in str(e)
    e = _refused(WorkerRequest(1, 1.0, 2.0), [(8.0, 1.0), (8.0, 1.0)], "the Ray cluster")
    assert e.flag == "--gpus-per-worker" and "2 GPU(s) on one node" in str(e)
    check_fits(WorkerRequest(2, 4.0, 1.0), [(8.0, 1.0), (8.0, 1.0)], where="the Ray cluster", more="")


def test_the_node_setup_check_refuses_a_gpu_torch_has_no_kernels_for():
    """The views come from `node_view` on each node (`unsupported_gpus` on GPU nodes): a V100 under a
    CUDA 13 torch is refused before any trial, on a cluster and on one machine."""
    from vidtune import __version__
    from vidtune.tune.running.cluster import check_every_node

    v100 = ("GPU 0: Tesla V100-SXM2-16GB (compute capability 7.0) is not a GPU torch 2.14.1+cu130 "
            "(CUDA 13.0, kernels for sm_75, sm_80) was built for")
    node = {"node": "10.0.0.1", "storage": True, "weights": True, "vidtune": __version__}
    gpu_node = {**node, "node": "10.0.0.2", "unsupported_gpus": [v100]}
    with pytest.raises(ConfigError) as e:
        check_every_node("s3://bucket/x", "none", views=lambda marker, weights: [node, gpu_node])
    assert e.value.flag == "--address"
    assert "node 10.0.0.2, GPU 0: Tesla V100-SXM2-16GB (compute capability 7.0)" in str(e.value)
    assert "torch 2.14.1+cu130" in str(e.value) and "leave that node out" in str(e.value)
    with pytest.raises(ConfigError) as e:                      # one GPU machine, no cluster
        check_every_node("s3://bucket/x", "none", views=lambda marker, weights: [gpu_node])
    assert e.value.flag == "--gpus-per-worker" and "Tesla V100" in str(e.value)
    fine = {**gpu_node, "unsupported_gpus": []}
    check_every_node("s3://bucket/x", "none", views=lambda marker, weights: [node, fine])


def test_node_view_reads_the_gpus_only_when_asked(monkeypatch):
    from vidtune.tune.running import cluster

    monkeypatch.setattr(cluster.ray.util, "get_node_ip_address", lambda: "10.0.0.9")
    monkeypatch.setattr(cluster, "unsupported_gpus", lambda: ["GPU 0: why"])
    assert "unsupported_gpus" not in cluster.node_view(None, None)       # CPU nodes: no torch import
    assert cluster.node_view(None, None, True)["unsupported_gpus"] == ["GPU 0: why"]


def test_the_local_cpus_are_a_containers_quota_when_it_is_less_than_the_cores(monkeypatch, tmp_path):
    from vidtune.trainer.cluster import capacity

    v2 = tmp_path / "cpu.max"
    monkeypatch.setattr(capacity.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(capacity, "CPU_QUOTA_FILES", ((str(v2), None),))
    v2.write_text("200000 100000\n")
    assert capacity.local_cpus() == 2.0                   # a 2-CPU container on a 64-core host
    v2.write_text("max 100000\n")
    assert capacity.local_cpus() == 64.0                  # no quota: the cores
    quota, period = tmp_path / "cfs_quota_us", tmp_path / "cfs_period_us"
    quota.write_text("150000\n")
    period.write_text("100000\n")
    files = ((str(tmp_path / "none"), None), (str(quota), str(period)))    # no v2 file: v1's
    monkeypatch.setattr(capacity, "CPU_QUOTA_FILES", files)
    assert capacity.local_cpus() == 1.5                   # cgroup v1
