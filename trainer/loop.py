"""One training epoch and one evaluation pass: plain functions, no Ray, no precision branches.

Batches are `(clips, labels)`: clips `uint8 B x T x H x W x C` as the DataLoader gives them
(pinned on the host), labels int64 (B,). They are moved to the device as uint8 (4x fewer bytes
than float) and turned into `float B x C x T x H x W` there by `transform`.

Divergence (a learning rate that blows the weights up to inf/NaN) is not an error here: the
epoch stops at the first check that sees a non-finite loss and returns its NaN/inf `loss_sum`;
the caller judges the epoch by it and by `finite_parameters`.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vidtune.datasets.video import clips_to_device
from vidtune.trainer import precision
from vidtune.trainer.metrics import EpochStats, EvalOutputs, all_reduce_floats
from vidtune.trainer.precision import PrecisionPolicy

# Optimizer steps between two reads of the running loss. Each read is a CPU-GPU sync point (the
# GPU idles while the next step is queued) plus a one-float all-reduce under DDP, so it is not
# done every step; a diverged run wastes at most this many steps of its epoch.
FINITE_CHECK_EVERY = 20


def make_optimizer(model_or_params: nn.Module | Iterable[nn.Parameter], lr: float,
                   weight_decay: float, device: torch.device | str) -> torch.optim.AdamW:
    """AdamW; fused (one kernel for all tensors) on CUDA. Given a model, biases, norms and
    embeddings (tensors with < 2 dims) get no weight decay, the usual transformer recipe.
    Frozen parameters are kept in the groups so unfreezing later needs no new optimizer."""
    if isinstance(model_or_params, nn.Module):
        params = list(model_or_params.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
    else:
        groups = [{"params": list(model_or_params), "weight_decay": weight_decay}]
    fused = precision.supports_fused_optimizer(device)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, fused=fused or None)


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_frac: float,
                   min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over `round(warmup_frac * total_steps)` optimizer steps (from lr/warmup up
    to lr), then cosine decay to `min_lr_ratio * lr` at `total_steps`. Step it once per
    optimizer step. Beyond total_steps the lr stays at the minimum."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps} (no training batches?)")
    if not 0.0 <= warmup_frac < 1.0:
        raise ValueError(f"warmup_frac must be in [0, 1), got {warmup_frac}")
    warmup = round(warmup_frac * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _timed_batches(loader: Iterable, stats: EpochStats) -> Iterator[tuple[object, bool]]:
    """Yield (batch, is_last), adding the time blocked in next(loader) to stats.data_wait_s.
    Reads one batch ahead so the last micro-batch is known (it must sync gradients)."""
    it = iter(loader)
    t0 = time.perf_counter()
    batch = next(it, None)
    stats.data_wait_s += time.perf_counter() - t0
    while batch is not None:
        t0 = time.perf_counter()
        upcoming = next(it, None)
        stats.data_wait_s += time.perf_counter() - t0
        yield batch, upcoming is None
        batch = upcoming


def _to_device(batch, transform: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    clips, labels = batch
    # A tensor is copied; JPEG frames from an encoded loader (datasets.video.collate_clips) are decoded there.
    clips = clips_to_device(clips, device, non_blocking=True)
    labels = torch.as_tensor(labels).to(device, non_blocking=True)
    return transform(clips), labels


def train_one_epoch(model: nn.Module, loader: Iterable, *, transform: nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler, scaler: torch.amp.GradScaler,
                    policy: PrecisionPolicy, device: torch.device | str, grad_accum_steps: int = 1,
                    clip_grad_norm: float = 1.0, label_smoothing: float = 0.0,
                    finite_check_every: int = FINITE_CHECK_EVERY) -> EpochStats:
    """Train `model` for one pass over `loader`; returns this worker's local sums.

    The optimizer (and the scheduler, once) step every `grad_accum_steps` micro-batches and
    after a last, shorter group (its gradient rescaled to a mean over the micro-batches it
    had). Under DDP the non-final micro-batches of a group skip the gradient all-reduce.
    Gradients are clipped to `clip_grad_norm` (0 = off) after unscaling.

    Every `finite_check_every` optimizer steps (0: never) the loss so far is checked: when it
    is inf or NaN on any worker, every worker stops the epoch there (`stats.loss_sum` is then
    non-finite on at least one of them). The check sits on a step boundary, which every DDP
    rank reaches at the same step, so no rank is left waiting in a gradient all-reduce.
    """
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
    device = torch.device(device)
    model.train()
    criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
    stats = EpochStats()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)   # on device: no per-step sync
    pending = 0
    optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for batch, is_last in _timed_batches(loader, stats):
        x, y = _to_device(batch, transform, device)
        pending += 1
        step_now = pending == grad_accum_steps or is_last
        sync = contextlib.nullcontext() if step_now or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with policy.autocast():
                loss = criterion(model(x), y)
            scaler.scale(loss / grad_accum_steps).backward()
        loss_sum += loss.detach().double() * y.shape[0]
        stats.clips += y.shape[0]
        if step_now:
            _optimizer_step(model, optimizer, scaler, clip_grad_norm, grad_accum_steps / pending)
            scheduler.step()
            stats.steps += 1
            pending = 0
            if (finite_check_every and stats.steps % finite_check_every == 0
                    and not _finite_everywhere(loss_sum)):
                break   # a non-finite loss: the weights are (or soon will be) NaN, so nothing more is learnt
    precision.synchronize(device)  # sync point: queued GPU work belongs to this epoch's time
    stats.epoch_time_s = time.perf_counter() - start
    stats.step_time_s = max(0.0, stats.epoch_time_s - stats.data_wait_s)
    stats.loss_sum = float(loss_sum.item())
    return stats


def _finite_everywhere(loss_sum: torch.Tensor) -> bool:
    """Whether the running loss is finite on every worker (a sync point, and a collective when
    distributed: every rank must call it at the same step)."""
    local_bad = float(not torch.isfinite(loss_sum).item())
    return all_reduce_floats([local_bad], dist.ReduceOp.MAX)[0] == 0.0


def finite_parameters(model: nn.Module) -> bool:
    """Whether every parameter of `model` is finite: the largest |value| over all of them is
    (inf and NaN propagate through the max). One sync point: call it once per epoch."""
    params = [p.detach() for p in model.parameters()]
    if not params:
        return True
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(params, norm_type=math.inf)).item())


def _optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    clip_grad_norm: float, grad_factor: float) -> None:
    if clip_grad_norm > 0 or grad_factor != 1.0:
        scaler.unscale_(optimizer)  # true gradients from here on (no-op when the scaler is off)
    if grad_factor != 1.0:
        for group in optimizer.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, grad_factor)
    if clip_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    scaler.step(optimizer)   # skips the step when fp16 gradients overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, *, transform: nn.Module, policy: PrecisionPolicy,
             device: torch.device | str) -> EvalOutputs:
    """Score every clip of `loader` under the training autocast; returns this worker's local
    P(violent) (float32, CPU), labels (int64, CPU) and summed cross-entropy."""
    device = torch.device(device)
    model.eval()
    probs, labels = [], []
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for batch in loader:
        x, y = _to_device(batch, transform, device)
        with policy.autocast():
            logits = model(x)
        logits = logits.float()
        loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
        probs.append(logits.softmax(dim=1)[:, 1])
        labels.append(y)
    if not probs:
        return EvalOutputs(torch.empty(0), torch.empty(0, dtype=torch.int64), 0.0, 0)
    probs_t = torch.cat(probs).cpu()
    return EvalOutputs(probs_t, torch.cat(labels).to("cpu", torch.int64), float(loss_sum.item()),
                       int(probs_t.numel()))
