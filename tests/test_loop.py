"""train_one_epoch / evaluate on small random problems; accumulation, clipping order, schedule,
stopping at a non-finite loss; an fp16 overflow GradScaler skips is no divergence (run_epoch's judgement)."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from vidtune.datasets.transforms import ClipTransform
from vidtune.trainer.models.registry import build_model, get_spec
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.loop import (
    NONFINITE_STEPS_TO_DIVERGE,
    evaluate,
    finite_parameters,
    make_optimizer,
    make_scheduler,
    train_one_epoch,
)
from vidtune.trainer.training.precision import choose_precision
from vidtune.trainer.training.run import DIVERGED, TRAINED, Run, run_epoch

MEAN, STD = (0.45, 0.45, 0.45), (0.225, 0.225, 0.225)
FP32 = choose_precision("fp32", "cpu")


class SmallNet(nn.Module):
    """Conv patch embedding + mean pool + linear: deterministic (no dropout), fast."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv3d(3, 8, kernel_size=(1, 4, 4), stride=(1, 4, 4))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # float B x 3 x T x H x W -> B x 2
        return self.head(torch.relu(self.embed(x)).mean(dim=(2, 3, 4)))


def _data(n: int, t: int = 4, size: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 n x t x size x size x 3 noise clips; label 1 clips have a bright red centre."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    clips = torch.randint(0, 120, (n, t, size, size, 3), dtype=torch.uint8, generator=g)
    lo, hi = size // 4, 3 * size // 4
    clips[labels == 1, :, lo:hi, lo:hi, 0] = 250
    return clips, labels


def _constant_lr(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _epoch(model, loader, optimizer, **kw):
    kw.setdefault("scheduler", _constant_lr(optimizer))
    kw.setdefault("scaler", FP32.make_scaler())
    return train_one_epoch(model, loader, transform=ClipTransform(MEAN, STD, train=False),
                           optimizer=optimizer, policy=FP32, device="cpu", **kw)


def _learn(device, policy) -> tuple[list[float], float, object]:
    """4 epochs of SmallNet on the red-centre problem on `device` under `policy`: the mean train
    loss of each epoch, the accuracy on 16 new clips, and their EvalOutputs."""
    torch.manual_seed(0)
    clips, labels = _data(32)
    loader = DataLoader(TensorDataset(clips, labels), batch_size=4, shuffle=True, drop_last=True)
    model = SmallNet().to(device)
    optimizer = make_optimizer(model, lr=0.03, weight_decay=0.01, device=device)
    scheduler = make_scheduler(optimizer, total_steps=4 * len(loader), warmup_frac=0.1)
    transform = ClipTransform(MEAN, STD, train=False).to(device)
    losses = []
    for _ in range(4):
        stats = train_one_epoch(model, loader, transform=transform, optimizer=optimizer, scheduler=scheduler,
                                scaler=policy.make_scaler(), policy=policy, device=device)
        assert (stats.clips, stats.steps) == (32, 8)
        losses.append(stats.loss_sum / stats.clips)
    out = evaluate(model, DataLoader(TensorDataset(*_data(16, seed=1)), batch_size=8), transform=transform,
                   policy=policy, device=device)
    accuracy = ((out.probs >= 0.5).long() == out.labels).float().mean().item()
    return losses, accuracy, out


def test_loop_learns_a_small_problem():
    losses, accuracy, out = _learn("cpu", FP32)
    assert losses[-1] < 0.5 * losses[0], losses
    assert out.count == 16 and accuracy >= 0.9
    assert out.loss_sum / out.count < losses[0]


@pytest.mark.gpu
def test_loop_learns_a_small_problem_on_the_gpu_under_the_auto_policy():
    """The same problem on CUDA: autocast (bf16, or fp16 with a live GradScaler on older GPUs),
    fused AdamW, on-device transform; the outputs come back to the CPU as float32 / int64."""
    device = torch.device("cuda", torch.cuda.current_device())
    policy = choose_precision("auto", device)
    assert policy.dtype != torch.float32 and make_optimizer(SmallNet().to(device), lr=0.1, weight_decay=0.0,
                                                            device=device).param_groups[0]["fused"]
    losses, accuracy, out = _learn(device, policy)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.5 * losses[0], losses
    assert out.count == 16 and accuracy >= 0.9
    assert (out.probs.device.type == "cpu" and out.probs.dtype == torch.float32
            and out.labels.dtype == torch.int64)


def test_tiny_model_epoch_and_eval_with_augmentation():
    torch.manual_seed(0)
    spec = get_spec("tiny")
    clips, labels = _data(4, t=spec.num_frames, size=spec.height)
    loader = DataLoader(TensorDataset(clips, labels), batch_size=2)
    model = build_model("tiny")
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.05, device="cpu")
    stats = train_one_epoch(model, loader, transform=ClipTransform(spec.mean, spec.std, train=True),
                            optimizer=optimizer, scheduler=_constant_lr(optimizer), scaler=FP32.make_scaler(),
                            policy=FP32, device="cpu", label_smoothing=0.1)
    assert (stats.clips, stats.steps) == (4, 2) and math.isfinite(stats.loss_sum)
    assert stats.epoch_time_s >= stats.step_time_s > 0
    out = evaluate(model, loader, transform=ClipTransform(spec.mean, spec.std, train=False), policy=FP32,
                   device="cpu")
    assert out.probs.shape == (4,) and out.labels.tolist() == labels.tolist()
    assert ((out.probs >= 0) & (out.probs <= 1)).all() and math.isfinite(out.loss_sum)
    assert not model.training                     # evaluate leaves eval mode; the next epoch resets it


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_low_precision_epoch_and_eval_on_cpu(name):
    """The same loop under bf16 autocast, and fp16 with a real GradScaler("cpu")."""
    torch.manual_seed(0)
    policy = choose_precision(name, "cpu")
    clips, labels = _data(8)
    loader = DataLoader(TensorDataset(clips, labels), batch_size=4)
    model = SmallNet()
    optimizer = make_optimizer(model, lr=1e-2, weight_decay=0.0, device="cpu")
    stats = train_one_epoch(model, loader, transform=ClipTransform(MEAN, STD, train=False),
                            optimizer=optimizer, scheduler=_constant_lr(optimizer),
                            scaler=policy.make_scaler(), policy=policy, device="cpu")
    assert stats.steps == 2 and math.isfinite(stats.loss_sum)
    out = evaluate(model, loader, transform=ClipTransform(MEAN, STD, train=False), policy=policy,
                   device="cpu")
    assert out.probs.dtype == torch.float32 and out.labels.dtype == torch.int64
    assert out.count == 8 and math.isfinite(out.loss_sum)


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_grad_accumulation_matches_the_big_batch(clip):
    """k=2 micro-batches of 4 step like one batch of 8, and a last lone micro-batch steps like
    a batch of its own (its gradient is a mean, not half of one)."""
    clips, labels = _data(12)
    torch.manual_seed(0)
    small, big = SmallNet(), SmallNet()
    big.load_state_dict(small.state_dict())
    micro = [(clips[i:i + 4], labels[i:i + 4]) for i in (0, 4, 8)]
    merged = [(clips[:8], labels[:8]), (clips[8:], labels[8:])]
    opt_small = torch.optim.SGD(small.parameters(), lr=0.5)
    opt_big = torch.optim.SGD(big.parameters(), lr=0.5)
    stats_small = _epoch(small, micro, opt_small, grad_accum_steps=2, clip_grad_norm=clip)
    stats_big = _epoch(big, merged, opt_big, grad_accum_steps=1, clip_grad_norm=clip)
    assert stats_small.steps == stats_big.steps == 2
    assert stats_small.loss_sum == pytest.approx(stats_big.loss_sum, rel=1e-5)
    for a, b in zip(small.parameters(), big.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _CountingDDP(nn.Module):
    """Stands in for DistributedDataParallel: counts micro-batches run under no_sync()."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.unsynced = 0
        self._in_no_sync = False

    @contextlib.contextmanager
    def no_sync(self):
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def forward(self, x):
        self.unsynced += self._in_no_sync
        return self.module(x)


def test_no_sync_for_all_but_the_last_micro_batch_of_each_step():
    clips, labels = _data(10)
    batches = [(clips[i:i + 2], labels[i:i + 2]) for i in range(0, 10, 2)]   # 5 micro-batches
    model = _CountingDDP(SmallNet())
    stats = _epoch(model, batches, torch.optim.SGD(model.parameters(), lr=0.1), grad_accum_steps=2)
    assert stats.steps == 3               # 2 + 2 + a last lone one
    assert model.unsynced == 2            # micro-batches 1 and 3; 2, 4 and the last one sync


def test_clipping_sees_unscaled_gradients(monkeypatch):
    clips, labels = _data(4)
    torch.manual_seed(0)
    model, reference = SmallNet(), SmallNet()
    reference.load_state_dict(model.state_dict())
    transform = ClipTransform(MEAN, STD, train=False)
    nn.functional.cross_entropy(reference(transform(clips)), labels).backward()
    true_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])).item()

    events = []
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=True)
    real_unscale, real_clip = scaler.unscale_, torch.nn.utils.clip_grad_norm_

    def unscale(optimizer):
        events.append(("unscale", None))
        return real_unscale(optimizer)

    def clip(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters)
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in parameters])).item()
        events.append(("clip", norm))
        return real_clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(scaler, "unscale_", unscale)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    _epoch(model, [(clips, labels)], torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler,
           clip_grad_norm=1e-3)
    assert [name for name, _ in events] == ["unscale", "clip"]
    assert events[1][1] == pytest.approx(true_norm, rel=1e-4)     # not 1024 x the true norm


class _FakeClock:
    """Stands in for trainer.training.loop's `time`: perf_counter() moves only when the test says so."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class _ClockedNet(SmallNet):
    """Each forward pass takes `step_s` on the fake clock: the step's share of the epoch."""

    def __init__(self, clock: _FakeClock, step_s: float):
        super().__init__()
        self.clock, self.step_s = clock, step_s

    def forward(self, x):
        self.clock.now += self.step_s
        return super().forward(x)


def test_data_wait_is_timed_apart_from_the_step(monkeypatch):
    """4 batches, each 0.5 s in next(loader) and 0.125 s in the step: the wait is the loader's
    time alone (read-ahead included, compute excluded), and the epoch is the sum of both."""
    clips, labels = _data(8)
    clock = _FakeClock()
    monkeypatch.setattr("vidtune.trainer.training.loop.time", clock)

    def slow_loader():
        for i in range(0, 8, 2):
            clock.now += 0.5
            yield clips[i:i + 2], labels[i:i + 2]

    model = _ClockedNet(clock, step_s=0.125)
    stats = _epoch(model, slow_loader(), torch.optim.SGD(model.parameters(), lr=0.1))
    assert stats.steps == 4
    assert stats.data_wait_s == 4 * 0.5
    assert stats.epoch_time_s == 4 * 0.5 + 4 * 0.125
    assert stats.step_time_s == 4 * 0.125


def test_bad_grad_accum_steps():
    model = SmallNet()
    with pytest.raises(ValueError, match="grad_accum_steps must be >= 1, got 0"):
        _epoch(model, [], torch.optim.SGD(model.parameters(), lr=0.1), grad_accum_steps=0)


def test_scheduler_warmup_then_cosine():
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = make_scheduler(optimizer, total_steps=10, warmup_frac=0.2)
    lrs = []
    for _ in range(12):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)      # 2 warmup steps
    assert lrs[2] == pytest.approx(1.0)                                       # cosine starts at the peak
    assert lrs[6] == pytest.approx(0.5)                                       # halfway through 8 decay steps
    assert lrs[9] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert lrs[10] == pytest.approx(0.0) and lrs[11] == pytest.approx(0.0)    # stays at the minimum
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:], strict=False))


def test_scheduler_min_lr_and_no_warmup():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = make_scheduler(optimizer, total_steps=4, warmup_frac=0.0, min_lr_ratio=0.1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)


@pytest.mark.parametrize("total, warmup, match", [(0, 0.1, "total_steps must be >= 1"),
                                                  (10, 1.0, r"warmup_frac must be in \[0, 1\)")])
def test_scheduler_bad_arguments(total, warmup, match):
    with pytest.raises(ValueError, match=match):
        make_scheduler(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), total, warmup)


def test_optimizer_groups_skip_decay_for_biases_and_norms():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.05, device="cpu")
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and [p.dim() for p in decay["params"]] == [2]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3
    assert not decay["fused"]                       # fused AdamW only on CUDA


# ---------------------------------------------------------------- divergence

def _batches(n: int = 16, size: int = 2) -> list:
    clips, labels = _data(n)
    return [(clips[i:i + size], labels[i:i + size]) for i in range(0, n, size)]


def test_a_non_finite_loss_stops_the_epoch_at_the_next_check():
    """One NaN weight makes every loss NaN: the epoch stops at the first check (after step 3 of
    8) with a NaN loss_sum, and finite_parameters sees the weight; without checks (0) the epoch
    trains on to the end, and only its loss_sum tells."""
    torch.manual_seed(0)
    model = SmallNet()
    assert finite_parameters(model)
    with torch.no_grad():
        model.head.bias[0] = float("nan")
    assert not finite_parameters(model)
    stats = _epoch(model, _batches(), torch.optim.SGD(model.parameters(), lr=0.1), finite_check_every=3)
    assert (stats.steps, stats.clips) == (3, 6) and math.isnan(stats.loss_sum)
    stats = _epoch(model, _batches(), torch.optim.SGD(model.parameters(), lr=0.1), finite_check_every=0)
    assert (stats.steps, stats.clips) == (8, 16) and math.isnan(stats.loss_sum)


def test_a_learning_rate_of_1e6_diverges_and_the_epoch_stops_early():
    """The real failure: AdamW at lr 1e6 (weight decay 0.05) blows the weights up within a few
    steps; the loop stops at the first non-finite loss instead of training on NaN weights."""
    torch.manual_seed(0)
    model = SmallNet()
    optimizer = make_optimizer(model, lr=1e6, weight_decay=0.05, device="cpu")
    stats = _epoch(model, _batches(32), optimizer, finite_check_every=1)
    assert not math.isfinite(stats.loss_sum) and stats.steps < 16, stats
    assert not finite_parameters(model)


# the skipped steps
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()` before:UserWarning")
def test_fp16_gradient_overflow_is_skipped_not_divergence():
    """fp16 with a GradScaler whose scale overflows every gradient: the scaler skips those steps
    (and lowers its scale), the loss stays finite and the weights unchanged: no divergence."""
    torch.manual_seed(0)
    policy = choose_precision("fp16", "cpu")
    model = SmallNet()
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = train_one_epoch(model, _batches(8), transform=ClipTransform(MEAN, STD, train=False),
                            optimizer=optimizer, scheduler=_constant_lr(optimizer), scaler=scaler,
                            policy=policy, device="cpu", finite_check_every=1)
    assert stats.steps == 4 and math.isfinite(stats.loss_sum)
    assert scaler.get_scale() < 2.0 ** 40                                  # it saw inf gradients
    assert finite_parameters(model) and all(torch.equal(a, b)
                                            for a, b in zip(before, model.parameters(), strict=True))


# ---------------------------------------------------------------- fp16 overflow is not divergence

FP16 = choose_precision("fp16", "cpu")     # CPU fp16 autocast + GradScaler("cpu"): the GPU's scaler path


class Overflowing(nn.Module):
    """SmallNet whose input is multiplied by `factor` on the forward calls `at` (0-based, one per
    batch): by 1e6, its fp16 convolution overflows (past 65504) as on an outlier batch and the
    loss is NaN; by inf, the loss is NaN in any precision. `spare`: a parameter the loss never
    reads (a weight gone NaN that no loss shows)."""

    def __init__(self, at=(), factor: float = 1e6):
        super().__init__()
        self.net, self.at, self.factor, self.calls = SmallNet(), set(at), factor, 0
        self.spare = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        overflow = self.calls in self.at
        self.calls += 1
        return self.net(x * self.factor if overflow else x)


def _fp16_epoch(model, batches, **kw):
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = FP16.make_scaler()
    stats = train_one_epoch(model, batches, transform=ClipTransform(MEAN, STD, train=False),
                            optimizer=optimizer, scheduler=_constant_lr(optimizer), scaler=scaler,
                            policy=FP16, device="cpu", **kw)
    return stats, scaler


def test_one_fp16_overflow_is_a_skipped_step_and_the_epoch_trains_on():
    """One batch overflows fp16 in the forward pass (loss NaN): GradScaler skips that step and
    halves its scale, the epoch runs to its end with a finite loss, and the weights end where
    training without that batch puts them. Before, the NaN loss stopped the epoch at the next
    check and the run ended as DIVERGED."""
    batches = _batches(16)
    torch.manual_seed(0)
    model = Overflowing(at={2})
    stats, scaler = _fp16_epoch(model, batches, finite_check_every=1)
    assert (stats.steps, stats.nonfinite_steps) == (8, 1) and math.isfinite(stats.loss_sum)
    assert scaler.get_scale() == 2.0 ** 15                      # 2^16, halved once: it skipped one step
    torch.manual_seed(0)
    without = Overflowing()
    reference, _ = _fp16_epoch(without, batches[:2] + batches[3:], finite_check_every=1)
    for a, b in zip(model.parameters(), without.parameters(), strict=True):
        torch.testing.assert_close(a, b)                         # the skipped step changed nothing
    # the train loss is the mean over the steps that counted
    assert stats.loss_sum / stats.clips == pytest.approx(reference.loss_sum / reference.clips, rel=1e-4)


@pytest.mark.parametrize("run", [NONFINITE_STEPS_TO_DIVERGE - 1, NONFINITE_STEPS_TO_DIVERGE])
def test_fp16_overflows_diverge_only_when_they_come_in_a_row_of_the_limit(run):
    """`run` overflowing steps in a row from step 2: one short of NONFINITE_STEPS_TO_DIVERGE the
    epoch trains on (loss finite); at the limit it stops at that step's check with a NaN loss_sum,
    which run_epoch reads as divergence. Isolated overflows, as many in all, do not add up."""
    torch.manual_seed(0)
    stats, _ = _fp16_epoch(Overflowing(at=range(1, 1 + run)), _batches(32), finite_check_every=1)
    if run < NONFINITE_STEPS_TO_DIVERGE:
        assert (stats.steps, stats.nonfinite_steps) == (16, run) and math.isfinite(stats.loss_sum)
    else:
        assert (stats.steps, stats.nonfinite_steps) == (1 + run, run) and math.isnan(stats.loss_sum)
    torch.manual_seed(0)
    spread = range(1, 3 * NONFINITE_STEPS_TO_DIVERGE, 2)         # every other step
    stats, _ = _fp16_epoch(Overflowing(at=spread), _batches(32), finite_check_every=0)
    assert stats.nonfinite_steps == len(spread) and math.isfinite(stats.loss_sum)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()` before:UserWarning")
def test_an_epoch_whose_every_step_overflowed_diverged_even_when_shorter_than_the_limit():
    """Fewer steps than the limit, all skipped: nothing was learnt, so the epoch diverged."""
    torch.manual_seed(0)
    stats, _ = _fp16_epoch(Overflowing(at=range(3)), _batches(6), finite_check_every=1)
    assert (stats.steps, stats.nonfinite_steps) == (3, 3) and math.isnan(stats.loss_sum)


def _run(model: nn.Module, policy) -> Run:
    """A Run of `model` on 16 red-centre clips (batches of 2, 8 steps) without Ray or files, as
    trainer.training.run.build_run would make it for one worker."""

    class Clips(TensorDataset):
        def set_epoch(self, epoch: int) -> None:   # the clip windows' seed; nothing to draw here
            pass

    train, val = Clips(*_data(16)), Clips(*_data(8, seed=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    transform = ClipTransform(MEAN, STD, train=False)
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=False)
    return Run(cfg=TrainConfig(), spec=get_spec("tiny"), device=torch.device("cpu"), policy=policy,
               class_names={0: "NonFight", 1: "Fight"},
               train_loader=DataLoader(train, batch_size=2, sampler=sampler),
               val_loader=DataLoader(val, batch_size=4), train_transform=transform, val_transform=transform,
               model=model, optimizer=optimizer, scheduler=_constant_lr(optimizer),
               scaler=policy.make_scaler())


def _spare_nan() -> Overflowing:
    model = Overflowing()
    with torch.no_grad():
        model.spare[0] = float("nan")
    return model


@pytest.mark.parametrize("precision, model, outcome", [
    ("fp16", lambda: Overflowing(at={2}), TRAINED),                              # skipped: weights fine
    ("fp16", lambda: Overflowing(at=range(2, 2 + NONFINITE_STEPS_TO_DIVERGE)), DIVERGED),
    ("fp16", _spare_nan, DIVERGED),                                              # judged by the weights
    ("fp32", lambda: Overflowing(at={2}, factor=math.inf), DIVERGED),            # no scaler: NaN reaches
    ("bf16", lambda: Overflowing(at={2}, factor=math.inf), DIVERGED),            # the weights at once
], ids=["fp16-one-overflow", "fp16-overflows-in-a-row", "fp16-nan-weight", "fp32-one-nan", "bf16-one-nan"])
def test_run_epoch_judges_divergence_by_the_weights_or_repeated_non_finite_losses(precision, model, outcome):
    """The worker's judgement (trainer.training.run.run_epoch, as trainer.cluster.worker calls it): an fp16
    step
    GradScaler skipped is no divergence; a run of them, or a NaN weight, is. In fp32 and bf16
    nothing skips a step, so one non-finite loss already is."""
    torch.manual_seed(0)
    run = _run(model(), choose_precision(precision, "cpu"))
    result = run_epoch(run, 1)
    assert result.outcome == outcome, result
    if outcome == TRAINED:
        assert math.isfinite(result.stats.loss_sum) and result.stats.nonfinite_steps == 1
        assert result.eval_out.count == 8 and math.isfinite(result.eval_out.loss_sum)
    else:
        assert result.eval_out is None


def test_under_compile_validation_runs_the_compiled_model(monkeypatch):
    """--compile: validation scores with a compiled model too (not the eager one inside the
    training wrapper), its own graph for eval mode under no_grad (torch.compile recompiles on that
    change, as expected), the plain model out of any DDP-like wrapper (`wrap`), and its numbers are
    the eager model's."""
    from torch._dynamo.utils import counters

    from vidtune.trainer.training import run as run_module

    class Wrapper(nn.Module):            # stands in for DDP: the plain model is its `.module`
        def __init__(self, module: nn.Module):
            super().__init__()
            self.module = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

    scored = []

    def spy(model, *args, **kwargs):
        compiled_before = counters["frames"]["ok"]
        out = evaluate(model, *args, **kwargs)
        scored.append((model, counters["frames"]["ok"] - compiled_before, out))
        return out

    monkeypatch.setattr(run_module, "evaluate", spy)
    torch._dynamo.reset()
    torch.manual_seed(0)
    run = _run(SmallNet(), FP32)
    run.cfg = TrainConfig(compile=True)
    run_module.place_model(run, wrap=Wrapper)
    assert isinstance(run.model._orig_mod, Wrapper)
    result = run_epoch(run, 1)
    assert result.outcome == TRAINED
    ((model, compiled, out),) = scored
    assert model is run.eval_model and model._orig_mod is run.model._orig_mod.module   # compiled, plain
    assert compiled >= 1                 # a graph of its own for evaluation
    eager = evaluate(model._orig_mod, run.val_loader, transform=run.val_transform, policy=FP32, device="cpu")
    assert out.count == eager.count == 8
    assert torch.allclose(out.probs, eager.probs, atol=1e-5)
