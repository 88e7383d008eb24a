"""What each worker trained with, on record: read back from torch in the worker's process
(`trainer.training.settings`), merged over ranks, and put on the trial's MLflow run as tags."""
from __future__ import annotations

import torch

from vidtune.trainer.training import settings
from vidtune.trainer.training.precision import choose_precision
from vidtune.tune.tracking.runs import setting_tags
from vidtune.tune.tracking.schema import SETTING_TAGS


def test_a_cpu_worker_says_what_it_trains_with():
    policy = choose_precision("auto", torch.device("cpu"))
    got = settings.worker_settings(torch.device("cpu"), policy)
    assert set(got) == set(settings.SETTING_KEYS)
    assert got["precision_used"] == policy.name and got["torch_version"] == torch.__version__
    assert got["tf32"] == got["cudnn_benchmark"] == "-"          # CUDA flags: not on the CPU
    # plain str, not torch's TorchVersion: they go into checkpoints, loaded with weights_only=True
    assert all(type(v) is str for v in got.values())
    assert got["device_name"] and got["compute_capability"] == "" and got["driver_version"] == ""
    # no CUDA on the CPU, even from a CUDA build of torch: the run gets no vidtune.cuda tag
    assert got["cuda_version"] == "" and SETTING_TAGS["cuda_version"] not in setting_tags(got)


def test_a_gpu_worker_reads_its_flags_back_from_torch(monkeypatch):
    """The device facts come from torch's CUDA calls (faked here), the flags from torch's
    backends as they are now, so a flag a worker never set shows as it really was."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A10G")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(settings, "nvidia_driver_version", lambda: "580.65.06")
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    policy = type("Policy", (), {"name": "fp16", "use_scaler": True})()
    got = settings.worker_settings(torch.device("cuda", 0), policy)
    assert got["precision_used"] == "fp16+scaler" and got["cudnn_benchmark"] == "on"
    assert got["tf32"] == (f"matmul={torch.backends.cuda.matmul.fp32_precision},"
                           f"conv={torch.backends.cudnn.conv.fp32_precision}")
    assert (got["device_name"], got["compute_capability"], got["driver_version"]) == \
        ("NVIDIA A10G", "8.6", "580.65.06")
    assert got["cuda_version"] == (torch.version.cuda or "")


def test_ranks_that_differ_say_both_and_tags_skip_what_is_unknown():
    a = dict.fromkeys(settings.SETTING_KEYS, "x") | {"device_name": "NVIDIA A10G"}
    b = dict(a, device_name="NVIDIA L4")
    merged = settings.merge_settings([a, b, a])
    assert merged["device_name"] == "NVIDIA A10G, NVIDIA L4" and merged["tf32"] == "x"
    tags = setting_tags({**merged, "driver_version": "", "epoch": 1})
    assert tags[SETTING_TAGS["device_name"]] == "NVIDIA A10G, NVIDIA L4"
    assert SETTING_TAGS["driver_version"] not in tags and "epoch" not in tags
