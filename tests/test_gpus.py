"""vidtune.trainer.gpus: simulated GPUs, and the device a worker that Ray gave a GPU trains on."""
from __future__ import annotations

import pytest
import torch

from vidtune.flags import ConfigError
from vidtune.trainer import gpus


def test_simulated_gpus_is_a_whole_number_or_refused_naming_the_variable(monkeypatch):
    monkeypatch.delenv(gpus.SIMULATE_ENV, raising=False)
    assert gpus.simulated_gpus() == 0
    monkeypatch.setenv(gpus.SIMULATE_ENV, "4")
    assert gpus.simulated_gpus() == 4
    for bad in ("four", "-1", "1.5"):
        monkeypatch.setenv(gpus.SIMULATE_ENV, bad)
        with pytest.raises(ConfigError) as e:
            gpus.simulated_gpus()
        assert e.value.flag == gpus.SIMULATE_ENV and repr(bad) in str(e.value)


def test_the_device_is_the_gpu_ray_gave_by_its_place_in_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv(gpus.SIMULATE_ENV, raising=False)
    monkeypatch.setattr(gpus, "physical_gpu_ids", lambda: ["3"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")        # Ray Train: one list for a run's workers
    assert gpus.train_device() == torch.device("cuda", 1)
    monkeypatch.setenv(gpus.SIMULATE_ENV, "4")
    assert gpus.train_device() == torch.device("cpu")        # simulated: placement only, CPU training
    monkeypatch.setattr(gpus, "physical_gpu_ids", lambda: [])
    monkeypatch.delenv(gpus.SIMULATE_ENV)
    assert gpus.train_device() == torch.device("cpu")        # no GPU from Ray


def test_a_gpu_that_torch_cannot_use_fails_with_what_to_check(monkeypatch):
    import ray

    class Context:
        def get_node_id(self):
            return "node-a"

    monkeypatch.delenv(gpus.SIMULATE_ENV, raising=False)
    monkeypatch.setattr(gpus, "physical_gpu_ids", lambda: ["0"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Context())
    with pytest.raises(RuntimeError) as e:
        gpus.train_device()
    message = str(e.value)
    assert "GPU 0 on node node-a" in message and "nvidia-smi" in message and gpus.SIMULATE_ENV in message
