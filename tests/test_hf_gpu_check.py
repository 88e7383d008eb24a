"""`make gpu-check`'s hub-architecture step, on the CPU: the step itself runs, with the training
faked where the GPU would do it (tests/test_hf_learning.py trains the same model for real in fp32);
the tiny VideoMAE it writes is a real save_pretrained folder that vidtune reads as `hf:`."""
from __future__ import annotations

import argparse

import pytest
import torch

from bench import gpu_check, gpu_check_steps, learning_check
from bench.gpu_check_results import CheckFailed
from vidtune.trainer.models.registry import get_spec

pytest.importorskip("transformers")


def test_the_tiny_videomae_folder_is_a_model_vidtune_reads(tmp_path):
    folder = learning_check.save_tiny_videomae(tmp_path / "videomae")
    spec = get_spec(f"hf:{folder}")
    assert (spec.num_frames, spec.height, spec.width) == (8, 32, 32)


def test_the_hub_architecture_step_needs_learning_speed_and_memory(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(learning_check, "learning_index",
                        lambda folder, workers=None: argparse.Namespace(train=["t"] * 160, val=["v"] * 40))
    monkeypatch.setattr(gpu_check_steps, "reset_peak_memory", lambda device: None)
    peak = {"mib": 300.0}
    monkeypatch.setattr(gpu_check_steps, "peak_reserved_mb", lambda device: peak["mib"])
    finals, asked = {"fp16": 0.9, "bf16": 0.95}, []

    def fit(train, val, *, precision, model, lr, epochs, **kw):
        asked.append((model, lr, epochs))
        return learning_check.Curve(precision, [0.5, finals[precision]], 0, 10.0)

    monkeypatch.setattr(learning_check, "fit_tiny", fit)
    check = gpu_check_steps.GpuCheck(gpu_check.build_parser().parse_args([]), tmp_path)
    line = check.hub_architecture()
    assert line == ("fp16 val_acc 0.900, 40 clips/s (train + val), peak 300 MiB; "
                    "bf16 val_acc 0.950, 40 clips/s (train + val), peak 300 MiB")
    assert asked[0] == (f"hf:{tmp_path / 'tiny-videomae'}", learning_check.HF_LR, learning_check.HF_EPOCHS)
    assert (tmp_path / "tiny-videomae" / "config.json").is_file()
    assert [r["precision"] for r in check.figures["hub_architecture"]] == ["fp16", "bf16"]
    finals["bf16"] = 0.6
    with pytest.raises(CheckFailed, match=r"tiny VideoMAE did not learn: bf16: val_acc 0.600"):
        check.hub_architecture()
    finals["bf16"], peak["mib"] = 0.95, 0.0
    with pytest.raises(CheckFailed, match=r"no speed or peak memory reported for \['fp16', 'bf16"):
        check.hub_architecture()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "hub architecture (VideoMAE)" in [name for name, _ in check.steps()]
