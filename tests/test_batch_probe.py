"""Batch-size probe: doubling then bisection against a simulated memory threshold, keeping
headroom."""
from __future__ import annotations

import pytest
import torch

from vidtune.trainer.commands import batch_probe_cli
from vidtune.trainer.training import batch_probe
from vidtune.trainer.training.batch_probe import find_max_batch_size, is_out_of_memory, probe_batch_size


class FakeMemory:
    """A try_batch that 'runs out of memory' above `threshold` with torch's real OOM error."""

    def __init__(self, threshold: int):
        self.threshold = threshold
        self.tried: list[int] = []

    def __call__(self, batch_size: int) -> None:
        self.tried.append(batch_size)
        if batch_size > self.threshold:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch_size} GiB")


@pytest.mark.parametrize("threshold", [2, 3, 64, 255])
def test_bisection_lands_exactly_on_the_threshold(threshold):
    fake = FakeMemory(threshold)
    assert find_max_batch_size("tiny", device="cpu", try_batch=fake) == threshold
    assert len(fake.tried) == len(set(fake.tried)) <= 16          # no size tried twice


def test_search_order_doubles_then_bisects():
    fake = FakeMemory(37)
    find_max_batch_size("tiny", device="cpu", try_batch=fake)
    assert fake.tried == [2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]


def test_stops_at_the_limit_when_everything_fits():
    fake = FakeMemory(10_000)
    assert find_max_batch_size("tiny", device="cpu", try_batch=fake, limit=100) == 100
    assert fake.tried == [2, 4, 8, 16, 32, 64, 100]


def test_memory_is_freed_after_each_out_of_memory(monkeypatch):
    freed = []
    monkeypatch.setattr(batch_probe.prec, "free_memory", lambda device: freed.append(device))
    fake = FakeMemory(5)
    find_max_batch_size("tiny", device="cpu", try_batch=fake)
    assert fake.tried == [2, 4, 8, 6, 5]
    # before each of the 5 tries (a clean allocator), and after 8 and 6 failed
    assert freed == [torch.device("cpu")] * 7


def test_cudnn_allocation_failure_counts_as_out_of_memory():
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert is_out_of_memory(torch.OutOfMemoryError("x"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_other_errors_are_not_swallowed():
    def broken(batch_size: int) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        find_max_batch_size("tiny", device="cpu", try_batch=broken)


def test_even_the_smallest_batch_does_not_fit():
    with pytest.raises(ValueError,
                       match=r"even batch size 2 runs out of memory for tiny at 8x64x64.*--num-frames"):
        find_max_batch_size("tiny", device="cpu", try_batch=FakeMemory(1))


@pytest.mark.parametrize("kwargs, match", [
    (dict(start=0), "need 1 <= start <= limit"),
    (dict(start=8, limit=4), "start=8, limit=4"),
    (dict(height=32), r"exactly 8 frames x 64 x 64"),
    (dict(precision="half"), "unknown precision 'half'"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        find_max_batch_size("tiny", device="cpu", try_batch=FakeMemory(8), **kwargs)


def test_real_training_step_on_cpu_reaches_the_limit(capsys):
    """The default try: a real tiny forward/backward/AdamW step at batch 1 and 2 (CLI path)."""
    assert batch_probe_cli.main(["--model", "tiny", "--device", "cpu", "--start", "1", "--limit", "2"]) == 0
    assert capsys.readouterr().out.strip() == "2"


def test_cli_reports_bad_input():
    assert batch_probe_cli.main(["--model", "tiny", "--device", "cpu", "--height", "32"]) == 2


class SharedMemory(FakeMemory):
    """A device of 100 clips: a step of b clips uses b% of its memory; above 100 it runs out."""

    def __init__(self):
        super().__init__(threshold=100)

    def __call__(self, batch_size: int) -> float:
        super().__call__(batch_size)
        return batch_size / 100


def test_headroom_keeps_a_share_of_the_memory_free():
    """By default a size fits only when its step leaves 10% free: 90 of the 100 that would run.
    The probe says what it kept and the smallest size it turned down for it."""
    fake = SharedMemory()
    probe = probe_batch_size("tiny", device="cpu", try_batch=fake)
    assert (probe.batch_size, probe.peak_share, probe.tight, probe.headroom) == (90, 0.90, 91, 0.10)
    assert fake.tried == [2, 4, 8, 16, 32, 64, 128, 96, 80, 88, 92, 90, 91]
    assert "at most 90 clips per GPU fit with 10% of its memory kept free" in probe.describe()
    assert "91 ran but would leave less" in probe.describe()
    assert find_max_batch_size("tiny", device="cpu", try_batch=SharedMemory()) == 90     # the int, as before
    assert find_max_batch_size("tiny", device="cpu", try_batch=SharedMemory(), headroom=0.0) == 100
    assert find_max_batch_size("tiny", device="cpu", try_batch=SharedMemory(), headroom=0.25) == 75


def test_a_trial_on_half_a_gpu_is_probed_against_half_its_memory():
    """--gpus-per-trial 0.5: two trials train side by side, each in half the memory; a step must
    peak below 0.5 x 90% of it: 45 of the 100 clips that would run alone."""
    probe = probe_batch_size("tiny", device="cpu", try_batch=SharedMemory(), share=0.5)
    assert (probe.batch_size, probe.tight, probe.share) == (45, 46, 0.5)
    assert "at most 45 clips per trial fit in 0.5 of a GPU's memory (--gpus-per-trial)" in probe.describe()
    with pytest.raises(ValueError, match=r"even batch size 2 leaves less than 10% of its 0.01 of the memory"):
        probe_batch_size("tiny", device="cpu", try_batch=SharedMemory(), share=0.01)
    with pytest.raises(ValueError, match=r"share must be a part of the device in \(0, 1\]"):
        probe_batch_size("tiny", device="cpu", try_batch=SharedMemory(), share=1.5)


def test_even_the_smallest_batch_leaves_too_little_headroom():
    with pytest.raises(ValueError, match=r"even batch size 2 leaves less than 10% of the memory free"):
        probe_batch_size("tiny", device="cpu", try_batch=lambda b: 0.95)
    with pytest.raises(ValueError, match=r"headroom must be a share of the memory in \[0, 1\)"):
        probe_batch_size("tiny", device="cpu", try_batch=SharedMemory(), headroom=1.0)


@pytest.mark.parametrize("flag, value", [("--headroom", "1"), ("--start", "0"), ("--height", "-8")])
def test_cli_bounds_name_the_flag(capsys, flag, value):
    assert batch_probe_cli.main(["--model", "tiny", "--device", "cpu", flag, value]) == 2
    assert f"{flag}: got" in capsys.readouterr().err


def test_the_clis_default_headroom_is_the_probes():
    assert batch_probe_cli.DEFAULT_HEADROOM == batch_probe.HEADROOM


def test_cli_refuses_an_unknown_model_listing_the_known_ones(capsys):
    assert batch_probe_cli.main(["--model", "mvit_xxl", "--device", "cpu"]) == 2
    assert "unknown model 'mvit_xxl'" in capsys.readouterr().err


def test_each_size_is_measured_from_a_clean_allocator(monkeypatch):
    """A caching allocator keeps the blocks a try reserved until emptied, so a try's peak can
    only grow from the last one's: unless the probe empties it first, a "tight" 40 makes every
    smaller size look tight too, and bisection settles on the last power of two (32)."""
    allocator = {"reserved": 0.0}      # the share of the device the (fake) allocator holds

    def try_batch(batch_size: int) -> float:
        need = batch_size / 42         # a step of b clips needs b/42 of the device
        if need > 1.0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        allocator["reserved"] = max(allocator["reserved"], need)
        return allocator["reserved"]

    monkeypatch.setattr(batch_probe.prec, "free_memory", lambda device: allocator.update(reserved=0.0))
    probe = probe_batch_size("tiny", device="cpu", try_batch=try_batch)
    assert probe.batch_size == 37 and probe.tight == 38    # 37/42 = 0.88 <= 0.9 < 38/42
