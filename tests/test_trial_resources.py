"""vidtune.tune.running.trial.TrialResources: what a trial asks Ray for, so that the next trial can start
beside a
training one while the device lease keeps the trainings apart."""
from __future__ import annotations

from vidtune.tune.running.trial import TrialResources


def test_one_worker_gpu_trial_asks_ray_for_a_lead_or_follower_share():
    from vidtune.trainer.cluster.lease import FOLLOW, LEAD

    whole = TrialResources(workers=1, cpus_per_worker=2, gpus_per_worker=1.0)
    assert whole.overlaps and whole.trainings_per_gpu == 1       # the lease lets one train per GPU
    lead, follow = whole.per_worker(LEAD)["GPU"], whole.per_worker(FOLLOW)["GPU"]
    assert lead > 0.5 and lead + follow == 1.0         # no two leads share a GPU; a follower fills one
    assert whole.per_worker() == {"CPU": 2, "GPU": lead}
    packed = TrialResources(workers=1, cpus_per_worker=2, gpus_per_worker=0.5)   # --gpus-per-trial 0.5
    assert not packed.overlaps and packed.trainings_per_gpu == 2    # two train side by side
    # ... and spread first: a lead per GPU (no two fit on one), then a follower in what it leaves
    assert packed.takes_roles and packed.per_worker(LEAD)["GPU"] > 0.5
    assert packed.per_worker(LEAD)["GPU"] + packed.per_worker(FOLLOW)["GPU"] == 1.0
    quarter = TrialResources(workers=1, gpus_per_worker=0.25)
    assert quarter.trainings_per_gpu == 4
    assert quarter.per_worker(LEAD)["GPU"] + 3 * quarter.per_worker(FOLLOW)["GPU"] <= 1.0 + 1e-9
    assert not TrialResources(workers=2, gpus_per_worker=1.0).takes_roles   # DDP: whole GPUs, no roles


def test_multi_worker_and_cpu_trials_ask_for_what_they_train_on():
    ddp = TrialResources(workers=2, cpus_per_worker=2, gpus_per_worker=1.0)
    assert ddp.per_worker() == {"CPU": 2, "GPU": 1.0}          # two ranks must never share one GPU
    assert TrialResources(workers=1, cpus_per_worker=0.9).per_worker() == {"CPU": 0.9}
    no_overlap = TrialResources(workers=1, cpus_per_worker=1, gpus_per_worker=1.0, overlap=False)
    assert no_overlap.per_worker()["GPU"] == 1.0
    assert TrialResources(workers=1, gpus_per_worker=2.0).per_worker()["GPU"] == 2.0   # whole GPUs stay whole


# -- trial_config: the sampled values in the base training run ----------------------------------

def test_trial_config_puts_the_sampled_values_in_and_keeps_the_rest():
    import pytest

    from vidtune.trainer.training.config import TrainConfig
    from vidtune.tune.running.trial import trial_config

    base = TrainConfig(epochs=5, grad_accum_steps=2, seed=7)
    cfg = trial_config(base, {"batch_size": 16.0, "lr": "0.001", "weight_decay": 0.01})
    assert (cfg.batch_size, cfg.lr, cfg.weight_decay) == (16, 1e-3, 0.01)
    assert type(cfg.batch_size) is int and type(cfg.lr) is float     # Optuna/Tune may hand floats or numpy
    assert (cfg.epochs, cfg.grad_accum_steps, cfg.seed, cfg.data) == (5, 2, 7, base.data)
    assert trial_config(base, {}) == base
    with pytest.raises(ValueError, match="momentum"):
        trial_config(base, {"momentum": 0.9})


# -- fit_to_cluster: hardware defaults, refusals and trials at once -----------------------------

def _opts(*argv):
    from vidtune.tune.config.options import parse_options

    return parse_options(["--smoke-test", *argv])


def _fit(opts, *, cpus=2.0, gpus=0.0, cpu_nodes=1, node_types=()):
    """fit_to_cluster on `cpu_nodes` nodes sharing `cpus`, the GPUs all on the last one (the first
    node the head), and the autoscaler's `node_types`. Returns (options, concurrency, local_gpu)."""
    from vidtune.tune.running.cluster import ClusterCapacity, fit_to_cluster

    nodes = tuple((cpus / cpu_nodes, gpus if i == cpu_nodes - 1 else 0.0) for i in range(cpu_nodes))
    fit = fit_to_cluster(opts, ClusterCapacity(nodes, nodes[0], tuple(node_types)))
    return fit.opts, fit.concurrency, fit.local_gpu


def test_cpu_machine_runs_one_trial_at_a_time_with_the_cpu_defaults():
    opts, concurrency, local_gpu = _fit(_opts("--num-samples", "4", "--batch-sizes", "4,8"))
    assert concurrency == 1 and not local_gpu                  # one training per CPU node
    assert opts.resources.gpus_per_worker == 0.0
    opts, concurrency, _ = _fit(_opts("--num-samples", "4"), cpus=8.0, cpu_nodes=3)
    assert concurrency == 3                                    # one per CPU-only node


def test_cpu_threads_that_leave_cores_free_let_the_next_trial_start_behind_the_training():
    _, behind, _ = _fit(_opts("--num-samples", "4", "--cpu-threads", "1"))
    assert behind == 2                                         # 1 thread on 2 cores: one trains, one starts
    _, all_cores, _ = _fit(_opts("--num-samples", "4", "--cpu-threads", "2"))
    assert all_cores == 1                                      # the training uses every core
    _, two_workers, _ = _fit(_opts("--num-samples", "4", "--cpu-threads", "1", "--workers-per-trial", "2",
                                   "--cpus-per-worker", "0.45"))
    assert two_workers == 1                                    # 2 workers x 1 thread: every core again
    _, asked, _ = _fit(_opts("--num-samples", "4", "--cpu-threads", "1", "--max-concurrent-trials", "1"))
    assert asked == 1


def test_one_gpu_machine_is_local_mode_with_a_trial_starting_behind_the_training_one():
    from dataclasses import replace

    opts = _opts("--num-samples", "6")
    opts = replace(opts, space=replace(opts.space, batch_sizes=None))
    opts, concurrency, local_gpu = _fit(opts, cpus=8.0, gpus=1.0)
    assert local_gpu and opts.resources.gpus_per_worker == 1.0
    assert opts.space.batch_sizes == (8, 16, 32)               # the GPU defaults
    assert concurrency == 2                                    # one training, one starting up
    _, packed, _ = _fit(_opts("--num-samples", "6", "--gpus-per-trial", "0.5"), cpus=8.0, gpus=1.0)
    assert packed == 2                                         # two trainings side by side, as asked
    _, four, local = _fit(_opts("--num-samples", "20", "--address", "auto"), cpus=32.0, gpus=4.0)
    assert four == 8 and not local
    _, capped, _ = _fit(_opts("--num-samples", "3"), cpus=32.0, gpus=4.0)
    assert capped == 3                                         # never more than the trials
    _, asked, _ = _fit(_opts("--max-concurrent-trials", "1"), cpus=32.0, gpus=4.0)
    assert asked == 1


def test_gpu_trials_by_default_reserve_the_cpus_that_go_with_their_gpu():
    """A GPU trial's --cpus-per-worker defaults to its GPU's share of the node's CPUs (was 0.9,
    which gave a GPU worker 2 loaders): split between the two trials per GPU (one trains, one
    starts behind it) or the packed ones, less their drivers, rounded down to half a CPU, at least
    0.9; a CPU-only trial keeps 0.9, and a value given is kept."""
    from vidtune.tune.running.cluster import NodeType

    def cpus(*args, **where):
        opts, concurrency, _ = _fit(_opts("--num-samples", "20", *args), **where)
        return opts.resources.cpus_per_worker, concurrency

    # the README's / deploy/kuberay's GPU nodes: 8 CPUs, 1 GPU, none alive yet
    assert cpus("--address", "auto", cpus=4.0, node_types=[NodeType("gpu", 8, 1, 4)]) == (3.5, 8)
    assert cpus(cpus=8.0, gpus=1.0) == (3.5, 2)                      # one GPU, 8 cores: still two trials
    assert cpus(cpus=16.0, gpus=1.0) == (7.5, 2)
    assert cpus("--gpus-per-trial", "0.5", cpus=8.0, gpus=1.0) == (3.5, 2)   # two train side by side
    assert cpus("--gpus-per-trial", "0.25", cpus=8.0, gpus=1.0) == (1.5, 4)
    assert cpus("--workers-per-trial", "2", "--gpus-per-worker", "1", cpus=32.0, gpus=4.0) == (7.5, 2)
    assert cpus("--address", "auto", cpus=4.0, node_types=[NodeType("gpu", 48, 4, 1)]) == (5.5, 8)
    assert cpus(cpus=2.0, gpus=4.0) == (0.9, 2)                      # simulated GPUs on 2 cores: the floor
    assert cpus(cpus=8.0) == (0.9, 1)                                # CPU-only: as before
    assert cpus("--cpus-per-worker", "2", cpus=8.0, gpus=1.0) == (2.0, 2)


def test_trials_the_cluster_cannot_hold_are_refused_naming_the_flag():
    import pytest

    from vidtune.flags import ConfigError

    with pytest.raises(ConfigError) as e:
        _fit(_opts("--gpus-per-trial", "2"), gpus=1.0)
    assert e.value.flag == "--gpus-per-trial" and "has 1" in str(e.value)
    with pytest.raises(ConfigError) as e:
        _fit(_opts("--gpus-per-worker", "1"))
    assert e.value.flag == "--gpus-per-worker"
    with pytest.raises(ConfigError) as e:
        _fit(_opts("--workers-per-trial", "3"))
    assert e.value.flag == "--workers-per-trial/--cpus-per-worker"
    # The head of an autoscaling cluster with GPU node types: 0 GPUs now is not an error.
    from vidtune.tune.running.cluster import NodeType

    opts, _, _ = _fit(_opts("--gpus-per-trial", "1", "--address", "auto"),
                      node_types=[NodeType("gpu", 8, None, 2)])
    assert opts.resources.gpus_per_worker == 1.0


def test_fractional_gpus_per_worker_with_several_workers_are_refused_naming_the_flag():
    import pytest

    from vidtune.flags import ConfigError

    with pytest.raises(ConfigError) as e:
        _opts("--workers-per-trial", "2", "--gpus-per-trial", "1")
    assert e.value.flag == "--gpus-per-trial" and "two ranks" in str(e.value)
    with pytest.raises(ConfigError) as e:
        _opts("--workers-per-trial", "2", "--gpus-per-worker", "0.5")
    assert e.value.flag == "--gpus-per-worker"
    with pytest.raises(ConfigError) as e:
        _opts("--gpus-per-worker", "1.5")
    assert e.value.flag == "--gpus-per-worker" and "whole number" in str(e.value)
    # whole GPUs: fine
    assert _opts("--workers-per-trial", "2", "--gpus-per-trial", "2").resources.gpus_per_trial == 2


# -- an autoscaling cluster: the nodes it can start count --------------------------------------

def test_an_autoscaling_cluster_sizes_trials_by_the_nodes_it_can_start():
    """The README's cluster: a 4-CPU head alone at first, up to 2 + 4 g5.2xlarge (8 CPUs, 1 GPU)."""
    from vidtune.tune.running.cluster import NodeType

    types = [NodeType("gpu_ondemand", 8, 1, 2), NodeType("gpu_spot", 8, 1, 4)]
    args = ("--address", "auto", "--num-samples", "20")
    from dataclasses import replace

    opts = _opts(*args, "--cpus-per-worker", "7")
    opts, concurrency, _ = _fit(replace(opts, space=replace(opts.space, batch_sizes=None)), cpus=4.0,
                                node_types=types)
    assert concurrency == 6                                    # one trial per GPU node (7 + 7 CPUs > 8)
    assert opts.space.batch_sizes == (8, 16, 32)               # the GPU defaults, from the node types
    assert opts.resources.gpus_per_worker == 1.0
    _, overlapping, _ = _fit(_opts(*args, "--cpus-per-worker", "3.5"), cpus=4.0, node_types=types)
    assert overlapping == 12                                   # a lead and a follower per GPU node
    from vidtune.tune.running.cluster import ClusterCapacity, fit_to_cluster

    alive = ((4.0, 0.0), (8.0, 1.0))                           # the head and one GPU node
    fit = fit_to_cluster(_opts(*args, "--cpus-per-worker", "7"), ClusterCapacity(alive, alive[0]))
    assert fit.concurrency == 1                                # without the node types: what is alive
    assert fit_to_cluster(_opts(*args, "--cpus-per-worker", "7"),
                          ClusterCapacity(alive, alive[0], tuple(types))).concurrency == 6


def test_the_cluster_config_node_types_are_read_and_capped_by_max_workers(tmp_path):
    from vidtune.tune.running.cluster import NodeType, read_node_types

    cfg = tmp_path / "ray_bootstrap_config.yaml"
    assert read_node_types(cfg) == ()                          # not a cluster head
    cfg.write_text("max_workers: 3\nhead_node_type: head\navailable_node_types:\n"
                   "  head: {resources: {CPU: 4}, max_workers: 0}\n"
                   "  cpu: {resources: {CPU: 16}, max_workers: 2}\n"
                   "  gpu: {resources: {CPU: 8, GPU: 1}, max_workers: 2}\n"
                   "  detected: {resources: {}, max_workers: 4}\n")
    types = {t.name: t for t in read_node_types(cfg)}
    assert set(types) == {"cpu", "gpu", "detected"}            # the head's own type is not one to start
    assert types["gpu"] == NodeType("gpu", 8.0, 1.0, 2)        # GPU types first within max_workers 3
    assert types["detected"].gpus is None and types["detected"].max_workers == 1
    assert types["cpu"].max_workers == 0


def test_a_search_that_waits_for_gpu_nodes_says_so():
    from vidtune.tune.running.cluster import ClusterCapacity, NodeType, fit_to_cluster, waiting_line

    capacity = ClusterCapacity(((4.0, 0.0),), (4.0, 0.0), (NodeType("gpu_spot", 8, 1, 4),))
    fit = fit_to_cluster(_opts("--address", "auto", "--num-samples", "8", "--cpus-per-worker", "3"), capacity)
    assert fit.waits_for_nodes and fit.lead_slots == 4 and fit.concurrency == 8
    assert "0 GPU(s) now" in waiting_line(capacity) and "gpu_spot up to 4 x 1 GPU" in waiting_line(capacity)


def test_a_folder_or_weights_file_that_another_node_lacks_is_refused(tmp_path):
    """Two nodes: this one (the real view of its paths) and another that sees what it is told."""
    from pathlib import Path

    import pytest

    from vidtune import __version__
    from vidtune.flags import ConfigError
    from vidtune.tune.running.cluster import check_every_node

    weights = tmp_path / "w.pt"
    weights.write_bytes(b"x")

    def two_nodes(other_sees_storage: bool, other_has_weights: bool):
        def views(marker, weights_path):
            assert marker is None or Path(marker).exists()       # the driver wrote the marker first
            here = {"node": "10.0.0.1", "storage": marker is None or Path(marker).exists(),
                    "weights": weights_path is None or Path(weights_path).is_file(), "vidtune": __version__}
            return [here, {"node": "10.0.0.2", "storage": marker is None or other_sees_storage,
                           "weights": weights_path is None or other_has_weights, "vidtune": __version__}]
        return views

    storage = tmp_path / "results"
    check_every_node(str(storage), str(weights), views=two_nodes(True, True))   # shared: fine
    assert list(storage.iterdir()) == []                                                # the marker is gone
    with pytest.raises(ConfigError) as e:
        check_every_node(str(storage), "none", views=two_nodes(False, True))
    assert e.value.flag == "--storage" and "10.0.0.2" in str(e.value) and "s3://" in str(e.value)
    with pytest.raises(ConfigError) as e:
        check_every_node("s3://bucket/x", str(weights), views=two_nodes(False, False))
    assert e.value.flag == "--weights" and "10.0.0.2" in str(e.value) and "every node" in str(e.value)


def test_a_node_without_this_vidtune_is_refused_naming_it_and_the_fix(tmp_path):
    """Trials import the vidtune installed on their node: a node without it (the check's own task
    cannot be unpickled there) or with another version stops the search before any trial."""
    import pytest

    from vidtune import __version__
    from vidtune.flags import ConfigError
    from vidtune.tune.running.cluster import check_every_node

    def nodes(*others):
        def views(marker, weights_path):
            return [{"node": "10.0.0.1", "storage": True, "weights": True, "vidtune": __version__}, *others]
        return views

    same = {"node": "10.0.0.2", "storage": True, "weights": True, "vidtune": __version__}
    check_every_node("s3://bucket/x", "none", views=nodes(same))
    missing = {"node": "10.0.0.2", "error": "ModuleNotFoundError: No module named 'vidtune'"}
    older = {"node": "10.0.0.3", "storage": True, "weights": True, "vidtune": "0.0.9"}
    with pytest.raises(ConfigError) as e:
        check_every_node("s3://bucket/x", "none", views=nodes(missing, older))
    assert e.value.flag == "--address"
    assert "10.0.0.2 (ModuleNotFoundError: No module named 'vidtune')" in str(e.value)
    assert "10.0.0.3 (vidtune 0.0.9)" in str(e.value) and "pip install" in str(e.value)


def test_the_heads_memory_caps_the_trials_at_once_with_a_line_saying_why():
    """The README's cluster: a 16 GB m5.xlarge head (Ray's `memory` ~10.5 GB once its object
    store is set aside) and 6 single-GPU nodes, a lead and a follower each: 12 trials would keep
    ~11 GB of drivers and Train controllers on the head."""
    from vidtune.tune.running.cluster import (
        HEAD_RESERVE_GB,
        TRIAL_ON_HEAD_GB,
        ClusterCapacity,
        NodeType,
        fit_to_cluster,
    )

    head = (4.0, 0.0)
    cluster = lambda memory: ClusterCapacity((head,), head, (NodeType("gpu", 8.0, 1.0, 6),),   # noqa: E731
                                            head_memory_gb=memory)
    opts = _opts("--num-samples", "20", "--gpus-per-trial", "1")
    free = fit_to_cluster(opts, cluster(None))               # memory unknown: as before
    assert free.concurrency == 12 and free.note is None
    held = int((10.5 - HEAD_RESERVE_GB) // TRIAL_ON_HEAD_GB)
    fit = fit_to_cluster(opts, cluster(10.5))
    assert fit.concurrency == held < 12
    assert fit.note.startswith(f"{held} trials at a time, not 12: the head node's 10.5 GB")
    assert "head_cpu InstanceType" in fit.note
    assert fit_to_cluster(opts, cluster(64.0)).concurrency == 12   # a bigger head holds them all
    # --max-concurrent-trials is the user's: kept, with a warning
    explicit = _opts("--num-samples", "20", "--gpus-per-trial", "1", "--max-concurrent-trials", "12")
    asked = fit_to_cluster(explicit, cluster(10.5))
    assert asked.concurrency == 12 and asked.note.startswith("warning: --max-concurrent-trials 12")
