"""tune.trial.TrialResources: what a trial asks Ray for, so that the next trial can start beside a
training one while the device lease keeps the trainings apart."""
from __future__ import annotations

from tune.trial import TrialResources


def test_one_worker_gpu_trial_asks_ray_for_half_its_share():
    whole = TrialResources(workers=1, cpus_per_worker=2, gpus_per_worker=1.0)
    assert whole.per_worker() == {"CPU": 2, "GPU": 0.5}        # two such trials fit on one GPU
    assert whole.trainings_per_gpu == 1                          # but the lease lets one train
    packed = TrialResources(workers=1, cpus_per_worker=2, gpus_per_worker=0.5)   # --gpus-per-trial 0.5
    assert packed.per_worker()["GPU"] == 0.25 and packed.trainings_per_gpu == 2


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

    from trainer.config import TrainConfig
    from tune.trial import trial_config

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
    from tune.options import parse_options

    return parse_options(["--smoke-test", *argv])


def _fit(opts, **cluster):
    from tune.runner import fit_to_cluster

    return fit_to_cluster(opts, **{"cpus": 2.0, "gpus": 0.0, "cpu_nodes": 1, **cluster})


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
    assert packed == 4                                         # two trainings per GPU, each with one behind
    _, four, local = _fit(_opts("--num-samples", "20", "--address", "auto"), cpus=32.0, gpus=4.0)
    assert four == 8 and not local
    _, capped, _ = _fit(_opts("--num-samples", "3"), cpus=32.0, gpus=4.0)
    assert capped == 3                                         # never more than the trials
    _, asked, _ = _fit(_opts("--max-concurrent-trials", "1"), cpus=32.0, gpus=4.0)
    assert asked == 1


def test_trials_the_cluster_cannot_hold_are_refused_naming_the_flag():
    import pytest

    from datasets.flags import ConfigError

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
    opts, _, _ = _fit(_opts("--gpus-per-trial", "1", "--address", "auto"), may_add_gpus=lambda: True)
    assert opts.resources.gpus_per_worker == 1.0
