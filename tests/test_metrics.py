"""Classification metrics against hand-computed values, and the cross-worker reduction."""
from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vidtune.trainer.training import precision
from vidtune.trainer.training.metrics import (
    METRIC_KEYS,
    EpochStats,
    EvalOutputs,
    classification_metrics,
    peak_memory_mb,
    reduce_epoch,
    roc_auc,
    steady_state,
)


def _pairwise_auc(probs, labels) -> float:
    pos = [p for p, y in zip(probs, labels, strict=True) if y == 1]
    neg = [p for p, y in zip(probs, labels, strict=True) if y == 0]
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_metrics_by_hand():
    probs = [0.9, 0.8, 0.3, 0.6, 0.2, 0.5]
    labels = [1, 1, 0, 0, 1, 0]
    # predictions (>= 0.5): 1 1 0 1 0 1 -> TP 2, FP 2, FN 1, TN 1
    m = classification_metrics(probs, labels)
    assert m["val_acc"] == pytest.approx(3 / 6)
    assert m["val_recall"] == pytest.approx(2 / 3)
    assert m["val_f1"] == pytest.approx(2 * 2 / (2 * 2 + 2 + 1))
    # positive-negative pairs won: 0.9 beats 3, 0.8 beats 3, 0.2 beats 0 -> 6 of 9
    assert m["val_auc"] == pytest.approx(6 / 9)


def test_auc_counts_ties_as_half():
    assert roc_auc([0.8, 0.5, 0.5, 0.2], [1, 1, 0, 0]) == pytest.approx(3.5 / 4)
    assert roc_auc([0.5] * 4, [1, 0, 1, 0]) == pytest.approx(0.5)
    assert roc_auc([0.1, 0.9], [1, 0]) == 0.0


def test_auc_matches_pairwise_count_with_many_ties():
    rng = np.random.default_rng(0)
    probs = rng.integers(0, 5, size=60) / 4          # only 5 distinct scores: lots of ties
    labels = rng.integers(0, 2, size=60)
    assert roc_auc(torch.tensor(probs), torch.tensor(labels)) == pytest.approx(_pairwise_auc(probs, labels))


def test_one_class_only():
    m = classification_metrics([0.2, 0.7], [0, 0])
    assert math.isnan(m["val_auc"])
    assert m["val_recall"] == 0.0 and m["val_f1"] == 0.0 and m["val_acc"] == 0.5
    m = classification_metrics([0.2, 0.7], [1, 1])
    assert math.isnan(m["val_auc"]) and m["val_recall"] == 0.5 and m["val_f1"] == pytest.approx(2 / 3)


def _by_counts(probs, labels) -> tuple[float, float]:
    """(F1, recall) from the confusion counts, 0.0 where a denominator is 0."""
    pred = [int(p >= 0.5) for p in probs]
    tp = sum(a == 1 and b == 1 for a, b in zip(pred, labels, strict=True))
    fp = sum(a == 1 and b == 0 for a, b in zip(pred, labels, strict=True))
    fn = sum(a == 0 and b == 1 for a, b in zip(pred, labels, strict=True))
    return (2 * tp / (2 * tp + fp + fn) if 2 * tp + fp + fn else 0.0), (tp / (tp + fn) if tp + fn else 0.0)


@pytest.mark.filterwarnings("error")     # scikit-learn's UndefinedMetricWarning included
@pytest.mark.parametrize("seed", range(20))
def test_scikit_learns_metrics_equal_the_definitions(seed):
    """F1, recall and AUC (scikit-learn's) against the counts and the pairwise AUC, on small sets
    with many ties, some of one class only (AUC NaN) or with no positive prediction."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    probs = (rng.integers(0, 5, size=n) / 4).tolist()
    labels = ([seed % 2] * n if seed % 5 == 0 else rng.integers(0, 2, size=n).tolist())
    if seed % 7 == 3:
        probs = [p * 0.4 for p in probs]                 # nothing predicted positive
    m = classification_metrics(probs, labels)
    f1, recall = _by_counts(probs, labels)
    assert m["val_f1"] == pytest.approx(f1) and m["val_recall"] == pytest.approx(recall)
    if len(set(labels)) < 2:
        assert math.isnan(m["val_auc"])
    else:
        assert m["val_auc"] == pytest.approx(_pairwise_auc(probs, labels))


@pytest.mark.parametrize("probs, labels, match", [
    ([], [], "no validation clips"),
    ([0.1, 0.2], [1], "differ in length: 2 vs 1"),
    ([0.1, 0.2], [1, 2], r"labels must be 0 or 1, got values \[1, 2\]"),
])
def test_bad_inputs(probs, labels, match):
    with pytest.raises(ValueError, match=match):
        classification_metrics(probs, labels)


def test_reduce_epoch_single_process():
    stats = EpochStats(loss_sum=6.0, clips=12, steps=3, step_time_s=3.0, data_wait_s=1.0, epoch_time_s=4.0)
    out = EvalOutputs(torch.tensor([0.9, 0.1, 0.6, 0.4]), torch.tensor([1, 0, 0, 1]), loss_sum=2.0, count=4)
    m = reduce_epoch(stats, out)
    assert tuple(m) == METRIC_KEYS and all(isinstance(v, float) for v in m.values())
    assert m["train_loss"] == 0.5 and m["val_loss"] == 0.5
    assert m["clips_per_s"] == 3.0 and m["epoch_time_s"] == 4.0 and m["data_wait_frac"] == 0.25
    assert m["val_acc"] == 0.5 and m["val_auc"] == 0.75


def _proc_status_mib(field: str) -> float:
    """A memory figure of this process from /proc/self/status (the kernel writes kB), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux only)")
def test_peak_memory_on_cpu_is_the_process_peak_rss_in_mib():
    before = peak_memory_mb("cpu")
    assert before >= _proc_status_mib("VmHWM") - 1          # at least the kernel's high-water mark
    # Grow the resident set to `extra` MiB past the old peak with a written (so resident) block.
    # An anonymous mmap, not a tensor: malloc may hand back memory an earlier test freed but
    # kept resident, which grows nothing (CI read a growth of 0.0 that way); fresh pages must.
    extra = 96
    size = int((before - _proc_status_mib("VmRSS") + extra) * 2**20)
    block = mmap.mmap(-1, size)
    np.frombuffer(block, dtype=np.uint8)[:: mmap.PAGESIZE] = 1   # one write per page
    grown = peak_memory_mb("cpu")
    block.close()
    assert grown - before == pytest.approx(extra, abs=12)    # MiB, not KiB or bytes
    assert _proc_status_mib("VmRSS") < grown - extra / 2     # the block went back to the OS ...
    assert peak_memory_mb("cpu") >= grown                    # ... but a peak never goes down


@pytest.mark.gpu
def test_peak_memory_on_the_gpu_is_the_tensor_peak_not_the_process():
    device = torch.device("cuda", torch.cuda.current_device())
    precision.synchronize(device)
    precision.reset_peak_memory(device)
    base = torch.cuda.memory_allocated(device) / 2**20
    block = torch.ones(16 * 2**20, dtype=torch.uint8, device=device)     # 16 MiB
    assert peak_memory_mb(device) == pytest.approx(base + 16, abs=0.5)
    del block


# --- two workers: a real gloo process group ------------------------------------------------

SHARDS = {  # rank -> (EpochStats kwargs, probs, labels); different lengths on purpose
    0: (dict(loss_sum=4.0, clips=8, steps=2, step_time_s=2.0, data_wait_s=2.0, epoch_time_s=4.0),
        [0.9, 0.2, 0.6], [1, 0, 0]),
    1: (dict(loss_sum=2.0, clips=8, steps=2, step_time_s=5.0, data_wait_s=1.0, epoch_time_s=6.0),
        [0.7, 0.4, 0.5, 0.1, 0.8], [1, 1, 0, 0, 1]),
}


def _worker(rank: int, world: int, store_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)   # a forked child must not reuse the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        kwargs, probs, labels = SHARDS[rank]
        out = EvalOutputs(torch.tensor(probs), torch.tensor(labels), loss_sum=float(len(probs)),
                          count=len(probs))
        metrics = reduce_epoch(EpochStats(**kwargs), out)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(metrics, f)
    finally:
        dist.destroy_process_group()


def test_two_process_gloo_reduce_gives_every_rank_the_global_metrics(tmp_path):
    # fork: the children inherit the imported torch (spawn re-imports it: ~10 s more on 2 cores).
    mp.start_processes(_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1]
    probs = SHARDS[0][1] + SHARDS[1][1]
    labels = SHARDS[0][2] + SHARDS[1][2]
    expected = classification_metrics(probs, labels)
    for key, value in expected.items():
        assert got[0][key] == pytest.approx(value), key
    assert got[0]["train_loss"] == pytest.approx(6.0 / 16)
    assert got[0]["val_loss"] == pytest.approx(1.0)
    assert got[0]["epoch_time_s"] == 6.0                       # slowest worker
    assert got[0]["clips_per_s"] == pytest.approx(16 / 6.0)    # all clips / slowest wall time
    assert got[0]["data_wait_frac"] == pytest.approx(3.0 / 10.0)


def test_steady_state_is_the_median_of_epochs_2_and_later():
    # epoch 1 (worker start, autotuning, cache fill) is left out however slow it was
    assert steady_state({1: 3.0, 2: 40.0, 3: 10.0, 4: 30.0}) == 30.0
    assert steady_state([3.0, 40.0, 10.0, 30.0, 20.0]) == 25.0        # list in epoch order, even count
    assert steady_state({1: 7.0}) == 7.0                                # only one epoch: that one
    assert steady_state({1: 7.0, 2: float("nan"), 3: 9.0}) == 9.0       # epochs without a figure skipped
    assert math.isnan(steady_state({}))


def test_compute_speed_leaves_out_the_wait_for_data():
    stats = EpochStats(loss_sum=8.0, clips=12, steps=3, step_time_s=2.0, data_wait_s=4.0, epoch_time_s=6.0)
    m = reduce_epoch(stats, EvalOutputs(torch.tensor([0.9, 0.1]), torch.tensor([1, 0]), 0.4, 2))
    assert m["clips_per_s"] == pytest.approx(2.0)            # 12 clips / 6 s end to end
    assert m["compute_clips_per_s"] == pytest.approx(6.0)    # 12 clips / 2 s not waiting for data
