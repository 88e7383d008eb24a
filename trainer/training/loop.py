"""One training epoch and one evaluation pass: plain functions, no Ray, no precision branches.

Batches are `(clips, labels)`: clips `uint8 B x T x H x W x C` as the DataLoader gives them
(pinned on the host), labels int64 (B,). They are moved to the device as uint8 (4x fewer bytes
than float) and turned into `float B x C x T x H x W` there by `transform`.

Divergence (a learning rate that blows the weights up to inf/NaN) is not an error here: the
epoch stops at the first check that sees the loss rule below broken and returns a NaN/inf
`loss_sum`; the caller judges the epoch by it and by `finite_parameters` (the weights).

The loss rule: without a GradScaler (fp32, bf16) one non-finite loss is divergence, since nothing
skips that step and its NaN/inf gradients reach the weights. With one (fp16) a non-finite loss is
a step the scaler skips, weights untouched: only `NONFINITE_STEPS_TO_DIVERGE` of them in a row is.
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
from vidtune.trainer.training import precision
from vidtune.trainer.training.metrics import EpochStats, EvalOutputs, all_reduce_floats
from vidtune.trainer.training.precision import PrecisionPolicy

# Optimizer steps between two reads of the running loss. Each read is a CPU-GPU sync point (the
# GPU idles while the next step is queued) plus a one-float all-reduce under DDP, so it is not
# done every step; a diverged run wastes at most this many steps of its epoch.
FINITE_CHECK_EVERY = 20

# fp16 (GradScaler on): optimizer steps in a row with an inf/NaN loss that make the epoch diverged.
# The scaler skips such a step (its gradients are non-finite) and halves its scale; the weights are
# untouched, so one batch whose forward pass overflows fp16 (activations past 65504) is no divergence.
# A loss that stays non-finite is: the scale acts on gradients only, so it cannot bring back a loss
# that overflows in the forward pass, and every later step is skipped too (nothing is learnt). Why 5:
# isolated overflows on even 2% of the batches give 5 in a row about once in 3e8 steps (0.02^5),
# while a run whose every step overflows reaches 5 in 5 steps, so a finite check (above) stops it
# at most one check later than a first NaN would; and 5 skips leave the scale 32x lower (2^16 ->
# 2^11), far from gradients underflowing.
NONFINITE_STEPS_TO_DIVERGE = 5


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


def _to_device(batch, transform: nn.Module, device: torch.device,
               stats: EpochStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's model input and labels on `device`. A tensor is copied; JPEG frames from an
    encoded loader (datasets.video.collate_clips) are decoded there, which is the input
    pipeline's work done in this process: its time goes to `stats.data_wait_s`, not the step's."""
    clips, labels = batch
    t0 = time.perf_counter()
    clips = clips_to_device(clips, device, non_blocking=True)
    if stats is not None and not isinstance(batch[0], torch.Tensor):   # decoded here
        stats.data_wait_s += time.perf_counter() - t0
    labels = torch.as_tensor(labels).to(device, non_blocking=True)
    return transform(clips), labels


def train_one_epoch(model: nn.Module, loader: Iterable, *, transform: nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler, scaler: torch.amp.GradScaler,
                    policy: PrecisionPolicy, device: torch.device | str, grad_accum_steps: int = 1,
                    clip_grad_norm: float = 1.0, label_smoothing: float = 0.0,
                    finite_check_every: int = FINITE_CHECK_EVERY,
                    nonfinite_steps_to_diverge: int = NONFINITE_STEPS_TO_DIVERGE) -> EpochStats:
    """Train `model` for one pass over `loader`; returns this worker's local sums.

    The optimizer (and the scheduler, once) step every `grad_accum_steps` micro-batches and
    after a last, shorter group (its gradient rescaled to a mean over the micro-batches it
    had). Under DDP the non-final micro-batches of a group skip the gradient all-reduce.
    Gradients are clipped to `clip_grad_norm` (0 = off) after unscaling.

    The loss rule (module doc): a step whose loss is inf or NaN on this worker is non-finite;
    the epoch diverged when `nonfinite_steps_to_diverge` steps in a row were (1 when `scaler` is
    disabled: fp32, bf16), or when none of its steps was finite. Every `finite_check_every`
    optimizer steps (0: never) the rule is checked: when it is broken on any worker, every
    worker stops the epoch there. The check sits on a step boundary, which every DDP rank
    reaches at the same step, so no rank is left waiting in a gradient all-reduce.

    `stats.loss_sum` is non-finite exactly when the rule is broken on this worker (the sum of
    every step's loss). Otherwise it sums the finite steps' losses, scaled to all `stats.clips`
    (a skipped step counts at the mean of the others), and `stats.nonfinite_steps` says how many
    steps GradScaler skipped for a non-finite loss.
    """
    if grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
    if nonfinite_steps_to_diverge < 1:
        raise ValueError(f"nonfinite_steps_to_diverge must be >= 1, got {nonfinite_steps_to_diverge}")
    device = torch.device(device)
    model.train()
    criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
    stats = EpochStats()
    losses = _LossTally(device, nonfinite_steps_to_diverge if scaler.is_enabled() else 1)
    pending = 0
    optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for batch, is_last in _timed_batches(loader, stats):
        x, y = _to_device(batch, transform, device, stats)
        pending += 1
        step_now = pending == grad_accum_steps or is_last
        sync = contextlib.nullcontext() if step_now or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with policy.autocast():
                loss = criterion(model(x), y)
            scaler.scale(loss / grad_accum_steps).backward()
        losses.add(loss, y.shape[0])
        stats.clips += y.shape[0]
        if step_now:
            _optimizer_step(model, optimizer, scaler, clip_grad_norm, grad_accum_steps / pending)
            scheduler.step()
            losses.end_step()
            stats.steps += 1
            pending = 0
            if (finite_check_every and stats.steps % finite_check_every == 0
                    and _diverged_anywhere(losses)):
                break   # nothing more is learnt: the weights are NaN, or every step is skipped
    precision.synchronize(device)  # sync point: queued GPU work belongs to this epoch's time
    stats.epoch_time_s = time.perf_counter() - start
    stats.step_time_s = max(0.0, stats.epoch_time_s - stats.data_wait_s)
    stats.loss_sum, stats.nonfinite_steps = losses.result(stats.clips)
    return stats


class _LossTally:
    """The epoch's training loss and the loss rule's state, kept on the device: adding a loss
    or ending a step queues a few scalar kernels and never waits for the GPU."""

    def __init__(self, device: torch.device, limit: int):
        self.limit = limit   # non-finite steps in a row that make the epoch diverged
        zero = lambda: torch.zeros((), dtype=torch.float64, device=device)  # noqa: E731
        self.step_sum = zero()      # this step's loss x clips, over its micro-batches
        self.step_clips = 0
        self.every_sum = zero()     # every step's (non-finite once one step was)
        self.finite_sum = zero()    # the finite steps' only
        self.finite_clips = zero()
        self.run = zero()           # non-finite steps in a row, up to the last step
        self.longest_run = zero()
        self.nonfinite = zero()     # non-finite steps in all

    def add(self, loss: torch.Tensor, clips: int) -> None:
        self.step_sum += loss.detach().double() * clips
        self.step_clips += clips

    def end_step(self) -> None:
        finite = torch.isfinite(self.step_sum)
        self.every_sum += self.step_sum
        # where, not a product: inf * 0 is NaN
        self.finite_sum += torch.where(finite, self.step_sum, 0.0)
        self.finite_clips += finite * float(self.step_clips)
        self.run = torch.where(finite, 0.0, self.run + 1)
        torch.maximum(self.longest_run, self.run, out=self.longest_run)
        self.nonfinite += ~finite
        self.step_sum.zero_()
        self.step_clips = 0

    def diverged(self, *, epoch_over: bool = False) -> torch.Tensor:
        """The loss rule broken on this worker (bool, on the device): `limit` non-finite steps in
        a row; once the epoch is over, also steps taken and none of them finite (an epoch
        shorter than `limit` steps that learnt nothing)."""
        broken = self.longest_run >= self.limit
        if epoch_over:
            broken |= (self.nonfinite > 0) & (self.finite_clips == 0)
        return broken

    def result(self, clips: int) -> tuple[float, int]:
        """(loss_sum, non-finite steps) for EpochStats (`train_one_epoch` says what they hold);
        `clips`: all the clips trained on. A sync point."""
        if bool(self.diverged(epoch_over=True).item()):
            return float(self.every_sum.item()), int(self.nonfinite.item())
        finite_clips = float(self.finite_clips.item())
        loss_sum = float(self.finite_sum.item()) * clips / finite_clips if finite_clips else 0.0
        return loss_sum, int(self.nonfinite.item())


def _diverged_anywhere(losses: _LossTally) -> bool:
    """Whether the loss rule is broken on any worker (a sync point, and a collective when
    distributed: every rank must call it at the same step)."""
    local = float(losses.diverged().item())
    return all_reduce_floats([local], dist.ReduceOp.MAX)[0] > 0.0


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
