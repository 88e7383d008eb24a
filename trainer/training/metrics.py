"""Classification metrics and throughput, all-reduced across Ray Train workers.

Each worker produces local sums (`EpochStats` from `train_one_epoch`, `EvalOutputs` from
`evaluate`); `reduce_epoch` combines them so every rank returns the same, global numbers
(Ray's TuneReportCallback forwards rank 0's report only).

Definitions (class 1 = violent = positive; predicted positive when P(violent) >= 0.5):
- val_acc: share of clips classified right.
- val_recall: TP / (TP + FN); 0.0 when the labels have no positive (scikit-learn's
  `recall_score`, zero_division=0).
- val_f1: 2 TP / (2 TP + FP + FN); 0.0 when there is no positive label nor prediction
  (`f1_score`, zero_division=0).
- val_auc: ROC AUC (`roc_auc_score`: tied scores count half). NaN when the labels hold one class
  only: AUC is undefined there, and 0.5 would look like a real (useless) score. The data layer
  refuses a validation split without both classes, so only a degenerate set reaches that case;
  Tune and MLflow store NaN as a value (no crash).
- clips_per_s: training clips of all workers / slowest worker's training wall time (data wait
  + steps; evaluation excluded). This is the speed a user waits for; `data_wait_frac` says how
  much of it was the input pipeline (the loader, and JPEG frames decoded on the device):
  data_wait_s / (data_wait_s + step_time_s), all workers.
- compute_clips_per_s: the same clips / the slowest worker's time not spent waiting for data
  (forward, backward, optimizer step): the model's own speed, what a faster input pipeline
  could reach at most.
- Steady-state speed (`steady_state`): the median of an epoch metric over epochs 2 and later
  (epoch 1 holds worker start, cudnn autotuning and the clip-cache fill), or epoch 1's value
  when only one epoch ran. The search ranks and shows trials by it.
- nonfinite_steps: training steps whose loss was inf/NaN, all workers (fp16: steps GradScaler
  skipped; `trainer.training.loop` says when they end a run as diverged).
- peak_mem_mb (`peak_memory_mb`): on a GPU, the most memory torch's caching allocator reserved
  there in the epoch (what no other process could have, and what runs out first);
  peak_allocated_mb beside it, the most its tensors used. On the CPU, the process's peak
  resident set; peak_allocated_mb is NaN there (no allocator to ask).
"""
from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from sklearn.metrics import f1_score, recall_score, roc_auc_score

from vidtune.trainer.training import precision
from vidtune.trainer.training.report_keys import Key

# reduce_epoch's keys, in the report's order (`trainer.training.report_keys`)
METRIC_KEYS = (Key.TRAIN_LOSS, Key.VAL_LOSS, Key.VAL_ACC, Key.VAL_F1, Key.VAL_RECALL, Key.VAL_AUC,
               Key.CLIPS_PER_S, Key.COMPUTE_CLIPS_PER_S, Key.EPOCH_TIME_S, Key.DATA_WAIT_FRAC,
               Key.NONFINITE_STEPS)


@dataclass
class EpochStats:
    """Local (this worker's) sums over one training epoch."""

    loss_sum: float = 0.0        # sum over clips of the per-clip training loss
    clips: int = 0               # clips trained on
    steps: int = 0               # optimizer steps taken
    nonfinite_steps: int = 0     # of which the loss was inf/NaN (fp16: steps GradScaler skipped)
    step_time_s: float = 0.0     # wall time not spent waiting for data (forward/backward/step)
    data_wait_s: float = 0.0     # wall time blocked in next(loader) or decoding a batch on the device
    epoch_time_s: float = 0.0    # wall time of the training epoch (excludes evaluation)


@dataclass
class EvalOutputs:
    """Local validation outputs: `probs` float32 (N,) P(violent) in [0, 1] and `labels` int64
    (N,) in {0, 1}, on the CPU; `loss_sum` sum over clips of the cross-entropy."""

    probs: torch.Tensor
    labels: torch.Tensor
    loss_sum: float
    count: int


def _as_numpy(x, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=dtype).reshape(-1)


def roc_auc(probs, labels) -> float:
    """ROC AUC = P(score of a random positive > a random negative), ties counted 1/2
    (scikit-learn's `roc_auc_score`). NaN when one class is absent, checked here: scikit-learn
    would warn (UndefinedMetricWarning) on every such epoch."""
    p, y = _as_numpy(probs, np.float64), _as_numpy(labels, np.int64)
    if len(np.unique(y)) < 2:
        return float("nan")
    return float(roc_auc_score(y, p))


def classification_metrics(probs, labels, threshold: float = 0.5) -> dict[str, float]:
    """val_acc, val_f1, val_recall, val_auc of P(violent) `probs` (N,) against `labels` (N,)
    in {0, 1}; see the module docstring for the edge cases."""
    p, y = _as_numpy(probs, np.float64), _as_numpy(labels, np.int64)
    if len(p) != len(y):
        raise ValueError(f"probs and labels differ in length: {len(p)} vs {len(y)}")
    if len(y) == 0:
        raise ValueError("no validation clips: cannot compute metrics on an empty set")
    if not np.isin(y, (0, 1)).all():
        raise ValueError(f"labels must be 0 or 1, got values {sorted(set(y.tolist()))[:10]}")
    pred = (p >= threshold).astype(np.int64)
    # labels=[0, 1]: class 1 is the positive one even when a set holds only one class
    return {
        Key.VAL_ACC: float((pred == y).mean()),
        Key.VAL_F1: float(f1_score(y, pred, labels=[0, 1], pos_label=1, zero_division=0.0)),
        Key.VAL_RECALL: float(recall_score(y, pred, labels=[0, 1], pos_label=1, zero_division=0.0)),
        Key.VAL_AUC: roc_auc(p, y),
    }


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("nan")


def all_reduce_floats(values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
    """`values` combined over all workers with `op` (float64; a collective: every rank must
    call it); returned unchanged when torch.distributed is not initialised (one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=precision.collective_device())
    dist.all_reduce(t, op=op)
    return t.tolist()


def reduce_epoch(stats: EpochStats, eval_out: EvalOutputs) -> dict[str, float]:
    """Global metrics of one epoch (keys: METRIC_KEYS) from this worker's local results.

    When torch.distributed is initialised every rank must call this (it runs collectives) and
    every rank gets the same dict; counts and losses are summed, times take the slowest
    worker, and the validation probs/labels of all ranks are gathered before scoring.
    """
    sums = [stats.loss_sum, stats.clips, stats.data_wait_s, stats.step_time_s,
            eval_out.loss_sum, eval_out.count, stats.nonfinite_steps]
    epoch_time = stats.epoch_time_s
    probs = eval_out.probs.detach().reshape(-1).to("cpu", torch.float64)
    labels = eval_out.labels.detach().reshape(-1).to("cpu", torch.float64)
    sums = all_reduce_floats(sums, dist.ReduceOp.SUM)
    epoch_time, slowest_step = all_reduce_floats([epoch_time, stats.step_time_s], dist.ReduceOp.MAX)
    if dist.is_available() and dist.is_initialized():
        probs, labels = _gather_pairs(probs, labels, precision.collective_device())
    loss_sum, clips, wait, step, val_loss_sum, val_count, nonfinite = sums
    out = {
        Key.TRAIN_LOSS: _ratio(loss_sum, clips),
        Key.VAL_LOSS: _ratio(val_loss_sum, val_count),
        **classification_metrics(probs, labels),
        Key.CLIPS_PER_S: _ratio(clips, epoch_time) if clips else 0.0,
        Key.COMPUTE_CLIPS_PER_S: _ratio(clips, slowest_step) if clips else 0.0,
        Key.EPOCH_TIME_S: float(epoch_time),
        Key.DATA_WAIT_FRAC: _ratio(wait, wait + step),
        Key.NONFINITE_STEPS: nonfinite,
    }
    return {k: float(out[k]) for k in METRIC_KEYS}


def steady_state(values_by_epoch: dict[int, float] | list[float]) -> float:
    """Median of a per-epoch value over epochs 2 and later; epoch 1's value when only epoch 1
    ran; NaN when there is none. `values_by_epoch`: {epoch (1-based): value}, or a list in
    epoch order starting at epoch 1. Non-finite values (an epoch without training) are skipped."""
    if not isinstance(values_by_epoch, dict):
        values_by_epoch = {i + 1: v for i, v in enumerate(values_by_epoch)}
    finite = {int(e): float(v) for e, v in values_by_epoch.items() if v is not None and np.isfinite(float(v))}
    later = [v for e, v in finite.items() if e >= 2]
    if later:
        return float(np.median(later))
    return finite.get(1, float("nan"))


def _gather_pairs(probs: torch.Tensor, labels: torch.Tensor,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' (probs, labels), concatenated in rank order. all_gather needs equal shapes,
    so each rank pads to the longest length and the padding is cut off after."""
    world = dist.get_world_size()
    local = torch.stack([probs, labels]).to(device)                     # 2 x n, float64
    n = torch.tensor([local.shape[1]], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes = [int(s.item()) for s in sizes]
    longest = max(sizes)
    padded = torch.zeros(2, longest, dtype=torch.float64, device=device)
    padded[:, : local.shape[1]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    joined = torch.cat([part[:, :size] for part, size in zip(parts, sizes, strict=True)], dim=1).cpu()
    return joined[0], joined[1].round().to(torch.int64)


def peak_memory_mb(device: torch.device | str) -> float:
    """Peak memory of this worker in MiB: on a GPU, the peak reserved by torch's caching
    allocator (reset it with precision.reset_peak_memory each epoch), else the process's peak
    resident set size (since process start; it never goes down)."""
    gpu = precision.peak_reserved_mb(device)
    if gpu is not None:
        return float(gpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024



def peak_allocated_mb(device: torch.device | str) -> float:
    """Peak memory this worker's tensors used on its GPU in MiB, since the last
    precision.reset_peak_memory; NaN off CUDA."""
    gpu = precision.peak_allocated_mb(device)
    return float(gpu) if gpu is not None else float("nan")
