"""bench/gpu_decode.py, gpu-check's comparison of GPU-decoded and CPU-decoded clip-cache entries, run
on the CPU (both sides decode there: a dry run that must agree exactly) and with the device side's
frames corrupted in the training loop, as an overwrite by the decoder would (it must disagree)."""
from __future__ import annotations

import math

import pytest
import torch

from bench import gpu_decode


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """2 batches of 4 tiny-sized clips (8 JPEG frames of 64 x 64 each) from a jpeg clip cache."""
    out = gpu_decode.cache_batches(tmp_path_factory.mktemp("decode"), videos=8, batch_size=4, model="tiny",
                                   size=64)
    assert len(out) == 2 and all(isinstance(clips[0], list) and len(clips[0]) == 8 for clips, _ in out)
    return out


@pytest.mark.slow   # generates videos (worker processes) and trains the tiny model four times
def test_a_dry_run_on_the_cpu_agrees_exactly_and_reports_its_figures(batches):
    figures = gpu_decode.compare_decoding(batches, torch.device("cpu"), model="tiny")
    assert gpu_decode.problems(figures) == []
    assert (figures["frames"], figures["frames_per_batch"], figures["batches"]) == (64, 32, 2)
    assert figures["frame_mean_abs_levels_max"] == 0.0
    assert figures["step_input_mean_abs_levels_max"] == [0.0, 0.0]
    assert figures["step_losses_device_decoded"] == figures["step_losses_cpu_decoded"]
    assert all(math.isfinite(x) for x in figures["step_losses_cpu_decoded"])
    assert figures["tolerance"] == {"frame_mean_abs_levels": 2.0, "loss": 0.05}
    assert "64 frames" in gpu_decode.summary(figures) and "2 seeded tiny steps" in gpu_decode.summary(figures)


@pytest.mark.slow
def test_inputs_overwritten_in_the_loop_fail_the_check(batches, monkeypatch):
    """The device side's first clip of each batch turned to zeros where the loop decodes it (what
    a decoder writing into memory a queued kernel still reads does to a step's input): the
    check names each step's input."""
    from vidtune.trainer.training import loop

    decode = loop.clips_to_device

    def overwritten(clips, device, **kw):
        out = decode(clips, device, **kw)
        if isinstance(clips, list):        # the device side: JPEG frames decoded in the loop
            out[0] = 0
        return out

    monkeypatch.setattr(loop, "clips_to_device", overwritten)
    figures = gpu_decode.compare_decoding(batches, torch.device("cpu"), model="tiny")
    found = gpu_decode.problems(figures)
    assert [line.split(":")[0] for line in found if "model input" in line] == ["step 1", "step 2"], found
    assert figures["frame_mean_abs_levels_max"] == 0.0      # the decoder itself agreed


def test_problems_name_frames_and_losses_out_of_tolerance():
    figures = {"frame_mean_abs_levels_max": 2.5, "step_input_mean_abs_levels_max": [0.4, 1.9],
               "step_losses_device_decoded": [0.69, math.nan, 0.70],
               "step_losses_cpu_decoded": [0.70, 0.69, 0.80]}
    found = gpu_decode.problems(figures)
    assert len(found) == 3 and found[0].startswith("decoded frames: a frame differs from the CPU's by 2.50")
    assert found[1].startswith("step 2: loss nan") and found[2].startswith("step 3: loss 0.7000")
