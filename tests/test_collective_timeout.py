"""--collective-timeout-min: a multi-worker run whose rank fails or stops ends after the timeout,
not after NCCL's 30 minutes (`TorchConfig(timeout_s=...)`,
trainer.cluster.build_trainer.build_torch_trainer)."""
from __future__ import annotations

import time

import pytest

from vidtune.trainer.cluster.build_trainer import build_torch_trainer
from vidtune.trainer.training.config import TrainConfig


def test_the_timeout_reaches_the_torch_config_of_every_run(monkeypatch):
    from vidtune.trainer.training.gpus import SIMULATE_ENV

    monkeypatch.delenv(SIMULATE_ENV, raising=False)
    assert build_torch_trainer(TrainConfig(), num_workers=2).backend_config.timeout_s == 600   # 10 minutes
    trainer = build_torch_trainer(TrainConfig(collective_timeout_min=0.5), num_workers=2)
    assert trainer.backend_config.timeout_s == 30
    assert trainer.backend_config.backend == "gloo"            # CPU workers: Train's own choice
    monkeypatch.setenv(SIMULATE_ENV, "2")
    simulated = build_torch_trainer(TrainConfig(collective_timeout_min=1), num_workers=2, use_gpu=True)
    assert (simulated.backend_config.backend, simulated.backend_config.timeout_s) == ("gloo", 60)


def test_the_flag_is_in_both_clis_and_in_a_runs_config():
    from vidtune.trainer.commands import train
    from vidtune.tune.config.options import parse_options

    args = train.build_parser().parse_args(["--data", "d", "--collective-timeout-min", "2.5"])
    cfg = train.config_from_args(args)
    assert cfg.collective_timeout_min == 2.5
    assert cfg.to_dict()["collective_timeout_min"] == 2.5      # train_loop_config, checkpoints, best_config
    assert parse_options(["--smoke-test", "--collective-timeout-min", "3"]).train.collective_timeout_min == 3
    assert train.main(["--data", "d", "--collective-timeout-min", "0"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_that_stops_ends_a_two_worker_run_within_the_timeout(ray_session, tmp_path):
    """2 workers on gloo with a 6 s timeout: rank 0's all-reduce fails after 6 s and Train ends
    the run (stopping rank 1), instead of waiting out the sleep (or NCCL's 30 minutes)."""
    import ray.train

    def one_rank_stops(config):   # defined here: pickled by value, the workers cannot import tests/
        """Rank 1 never reaches the all-reduce (as a rank stuck after a failure); rank 0 waits."""
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:
            time.sleep(600)
        dist.all_reduce(torch.ones(1))

    cfg = TrainConfig(collective_timeout_min=0.1, max_failures=0)
    trainer = build_torch_trainer(cfg, num_workers=2, resources_per_worker={"CPU": 0.5}, name="stops",
                                  storage_path=str(tmp_path), train_loop=one_rank_stops)
    started = time.monotonic()
    with pytest.raises(ray.train.TrainingFailedError) as e:
        trainer.fit()
    took = time.monotonic() - started
    assert took < 60, took                                      # start-up (~10 s) + 6 s, not 600 s
    assert "timed out" in str(e.value).lower() or "timeout" in str(e.value).lower(), str(e.value)[-2000:]
