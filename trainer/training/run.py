"""One training run without Ray: build what it holds, then train and score it epoch by epoch.

    run = build_run(cfg, index, device=device)          # data, model, optimizer, scaler: on the CPU
    place_model(run)                                     # the model on its device
    for epoch in range(1, cfg.epochs + 1):
        result = run_epoch(run, epoch)                   # trained | diverged | out of memory
        metrics = reduce_epoch(result.stats, result.eval_out)
        save_run_checkpoint(run, folder, epoch=epoch, metrics=metrics)

The Ray Train worker (`trainer.cluster.worker`) wires this to Ray: its rank and world size, DDP through
`place_model(wrap=ray.train.torch.prepare_model)`, checkpoints, reports and the device lease.
`bench/search_overhead.py` runs it plainly in one process, and `trainer.training.batch_probe` shares its
optimizer and input transform. Under torch.distributed the epoch's collectives (`all_reduce_floats`)
combine the ranks; in one process they are no-ops.

Precondition: each of the `world` workers gets at least one full batch of training videos
(`trainer.ray_setup.launch.check_batch_sizes`, the one check, run on the driver before any worker starts).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from vidtune.datasets.cache import FrameCache
from vidtune.datasets.index import VideoIndex
from vidtune.datasets.transforms import ClipTransform
from vidtune.datasets.video import VideoClipDataset, build_loader
from vidtune.trainer.models.registry import (
    ModelSpec,
    build_model,
    get_spec,
    maybe_compile,
    prepare_input_transform,
    prepare_model_memory_format,
    set_backbone_trainable,
    unwrap,
)
from vidtune.trainer.training.checkpointing import restore_training_state, save_checkpoint, saved_precision
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.loop import (
    evaluate,
    finite_parameters,
    make_optimizer,
    make_scheduler,
    train_one_epoch,
)
from vidtune.trainer.training.metrics import EpochStats, EvalOutputs, all_reduce_floats
from vidtune.trainer.training.precision import (
    BY_SUPPORT,
    PrecisionPolicy,
    choose_precision,
    configure_backends,
    is_cuda,
    is_out_of_memory,
    reset_peak_memory,
    trial_precision,
)

TRAINED, DIVERGED, OUT_OF_MEMORY = "trained", "diverged", "out of memory"   # how an epoch ended
_CPU = torch.device("cpu")   # where build_run builds everything
T = TypeVar("T")


@dataclass
class Run:
    """What one worker of a training run holds. The model starts on the CPU (`place_model` moves
    it); the loaders give `(clips uint8 B x T x H x W x C, labels int64 B)` on the host."""

    cfg: TrainConfig
    spec: ModelSpec
    device: torch.device
    policy: PrecisionPolicy              # the run's, the same on every rank once `place_model` ran
    class_names: dict[int, str]          # label -> class folder name, saved with each checkpoint
    train_loader: DataLoader             # this rank's shard, shuffled per epoch, full batches only
    val_loader: DataLoader               # this rank's shard, in order, every clip once over the ranks
    train_transform: nn.Module           # uint8 B x T x H x W x C -> float32 B x C x T x H x W, augmented
    val_transform: nn.Module             # the same without augmentation
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler         # disabled (a no-op) unless fp16
    rank: int = 0
    world: int = 1
    # What validation runs (`place_model`): the plain model, out of DDP (whose forward may sync
    # buffers, a collective, while ranks hold different numbers of validation batches), compiled
    # under --compile. None: `unwrap(model)`.
    eval_model: nn.Module | None = None


@dataclass(frozen=True)
class EpochResult:
    """How an epoch ended, the same on every rank."""

    outcome: str                         # TRAINED, DIVERGED (not scored) or OUT_OF_MEMORY
    stats: EpochStats | None = None      # this rank's training pass (None when out of memory)
    eval_out: EvalOutputs | None = None  # this rank's validation pass (TRAINED only)


class ShardSampler(Sampler[int]):
    """Indices `rank, rank + world, ...` of a dataset, in order, without padding: every
    validation video is scored exactly once across the workers (DistributedSampler would pad
    with duplicates so that every rank gets the same count)."""

    def __init__(self, length: int, rank: int, world: int):
        self.indices = list(range(rank, length, world))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def clip_datasets(cfg: TrainConfig, spec: ModelSpec, index: VideoIndex,
                  device: torch.device) -> tuple[VideoClipDataset, VideoClipDataset]:
    """The (train, val) datasets of a run: the model's clip size unless `cfg.data` overrides it,
    read through the clip cache `cfg.data` asks for (its `auto` format resolved for `device`)."""
    d = cfg.data
    size = dict(num_frames=d.num_frames or spec.num_frames, frame_stride=d.frame_stride,
                height=d.height or spec.height, width=d.width or spec.width)
    cache = FrameCache.from_config(d, on_gpu=is_cuda(device))
    # JPEG frames are decoded on the GPU in batches (decode_jpeg(device=...)), not by the loader.
    encoded = cache is not None and cache.format == "jpeg" and is_cuda(device)
    common = dict(seed=cfg.seed, cache=cache, encoded=encoded, **size)
    return (VideoClipDataset(index.train, train=True, **common),
            VideoClipDataset(index.val, train=False, **common))


MIN_LOADER_WORKERS = 2   # decode in parallel with training even on a worker of one CPU


def loader_workers(asked: int | None, cpus: float) -> int:
    """DataLoader processes of a training worker holding `cpus` CPUs: `asked` (--loader-workers)
    when given, else all its CPUs but the one the training process keeps, at least
    MIN_LOADER_WORKERS (a GPU worker with 8 CPUs decodes on 7: with 2, a big GPU waits for data)."""
    if asked is not None:
        return asked
    return max(MIN_LOADER_WORKERS, int(cpus) - 1)


def build_loaders(cfg: TrainConfig, spec: ModelSpec, index: VideoIndex, device: torch.device, *,
                  rank: int = 0, world: int = 1) -> tuple[DataLoader, DataLoader]:
    """(train, val) loaders of this rank, each built once. Train: sharded by a DistributedSampler
    (the same batch count on every rank, so DDP steps stay in lockstep), even for one worker: its
    order depends only on (seed, epoch), so a resumed run sees the batches an uninterrupted one
    does. Val: sharded without duplicates (`ShardSampler`)."""
    train_set, val_set = clip_datasets(cfg, spec, index, device)
    common = dict(batch_size=cfg.batch_size, num_workers=loader_workers(cfg.data.loader_workers, 1),
                  pin_memory=device.type != "cpu", seed=cfg.seed)
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    return (build_loader(train_set, train=True, sampler=train_sampler, **common),
            build_loader(val_set, train=False, sampler=ShardSampler(len(val_set), rank, world), **common))


def input_transform(spec: ModelSpec, device: torch.device, *, train: bool, channels_last: bool) -> nn.Module:
    """The model's input transform on `device`: uint8 B x T x H x W x C -> float32 B x C x T x H x W,
    normalised with the model's mean and std (augmented when `train`)."""
    return prepare_input_transform(ClipTransform(spec.mean, spec.std, train=train).to(device), channels_last)


def build_run(cfg: TrainConfig, index: VideoIndex, *, device: torch.device, rank: int = 0,
              world: int = 1) -> Run:
    """Everything one worker of a run of `cfg` needs, on the videos of `index`: precision (this
    rank's choice for `device`; `place_model` makes the ranks agree), loaders (`build_loaders`),
    transforms, the model with `cfg.weights` and the optimizer, scheduler and scaler, all on the
    CPU: nothing touches `device` until `place_model` (in a search, a trial waiting for its GPU
    holds no memory there). Runs no collective (a rank that runs out of memory here must not
    leave the others waiting in one). `rank` / `world`: this worker's place among the run's
    workers (0 / 1 in one process)."""
    policy = choose_precision(cfg.precision, device)
    configure_backends(device)
    spec = get_spec(cfg.model)
    train_loader, val_loader = build_loaders(cfg, spec, index, device, rank=rank, world=world)
    torch.manual_seed(cfg.seed)  # same initial head on every rank and for every worker count
    model = prepare_model_memory_format(build_model(cfg.model, weights=cfg.weights), cfg.channels_last)
    note = use_training_options(model, attn_implementation=cfg.attn_implementation,
                                gradient_checkpointing=cfg.gradient_checkpointing)
    if note and rank == 0:
        print(f"vidtune: {note}", flush=True)
    # Built on the CPU parameters: `module.to(device)` keeps the same Parameter objects, and
    # the optimizer has no state yet (a checkpoint's is restored after the move).
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, device)
    # The loop steps the optimizer (and scheduler) after every group of grad_accum_steps
    # batches and after a last, shorter group.
    steps_per_epoch = math.ceil(len(train_loader) / cfg.grad_accum_steps)
    scheduler = make_scheduler(optimizer, cfg.epochs * steps_per_epoch, cfg.warmup_frac)
    return Run(cfg=cfg, spec=spec, device=device, policy=policy, class_names=dict(index.class_names),
               train_loader=train_loader, val_loader=val_loader,
               train_transform=input_transform(spec, _CPU, train=True, channels_last=cfg.channels_last),
               val_transform=input_transform(spec, _CPU, train=False, channels_last=cfg.channels_last),
               model=model, optimizer=optimizer, scheduler=scheduler, scaler=policy.make_scaler(),
               rank=rank, world=world)


def use_training_options(model: nn.Module, *, attn_implementation: str,
                         gradient_checkpointing: bool) -> str | None:
    """`--attn-implementation` and `--gradient-checkpointing` on `model` where it has them (an
    hf: model, `trainer.models.hf_models.HFVideoClassifier.use_training_options`): the line to
    print when its attention differs from what was asked, else None. Other models have one
    attention of their own and no gradient checkpointing (the driver refuses the flag for them:
    `trainer.training.model_checks`)."""
    apply = getattr(unwrap(model), "use_training_options", None)
    if apply is None:
        return None
    return apply(attn_implementation=attn_implementation, gradient_checkpointing=gradient_checkpointing)


def place_model(run: Run, state: dict[str, Any] | None = None, *,
                wrap: Callable[[nn.Module], nn.Module] | None = None) -> None:
    """Put the model and the input transforms on `run.device`, `wrap` the model (the Ray worker
    passes Ray's `prepare_model`: DDP, a collective that broadcasts rank 0's weights), compile it
    and the model validation runs when `cfg.compile`, settle the run's precision
    (`agree_precision`, a collective), then restore a checkpoint's training `state` (the
    optimizer's state follows the parameters to their device as it loads)."""
    for transform in (run.train_transform, run.val_transform):
        transform.to(run.device)   # in place: a module's buffers (the mean and std) move
    model = run.model.to(run.device)
    if wrap is not None:
        model = wrap(model)
    run.model = maybe_compile(model, run.cfg.compile)
    # A wrapper of its own around the same weights: torch.compile traces eval mode under no_grad as
    # graphs of their own, at the first validation (and once more for a smaller last batch).
    run.eval_model = maybe_compile(unwrap(run.model), run.cfg.compile)
    agree_precision(run, state)
    if state is not None:
        restore_training_state(state, model=run.model, optimizer=run.optimizer, scaler=run.scaler,
                               scheduler=run.scheduler)


def agree_precision(run: Run, state: dict[str, Any] | None = None) -> None:
    """Decide the run's precision once for all its ranks (a collective when distributed): the
    lowest of the ranks' own choices, or the precision a resumed run's checkpoint `state` trained
    in where every rank can run it (`trainer.training.precision.trial_precision`). A changed decision gets
    its own, fresh GradScaler (before any state is restored into it)."""
    mine = float(BY_SUPPORT.index(run.policy.name))
    lowest = BY_SUPPORT[int(all_reduce_floats([mine], dist.ReduceOp.MIN)[0])]
    recorded = saved_precision(state)
    name = trial_precision(run.cfg.precision, lowest, recorded)
    if recorded is not None and name != recorded and run.rank == 0:
        print(f"vidtune: this run's checkpoint trained in {recorded}, which not every device of the run "
              f"can run; it goes on in {name}", flush=True)
    if name != run.policy.name:
        run.policy = replace(choose_precision(name, run.device), requested=run.cfg.precision)
        run.scaler = run.policy.make_scaler()


def unless_out_of_memory(step: Callable[..., T], *args: Any) -> T | None:
    """`step(*args)`, or None when it ran out of memory (torch.OutOfMemoryError is a
    RuntimeError). The error is dropped on return, so its traceback's tensors can be freed."""
    try:
        return step(*args)
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
    return None


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on any rank (a collective: all ranks must call it)."""
    return bool(all_reduce_floats([float(flag)], dist.ReduceOp.MAX)[0])


def run_epoch(run: Run, epoch: int) -> EpochResult:
    """Train epoch `epoch` (1-based) and score it, unless it diverged or ran out of memory on
    any rank. Seeds the data order, the clip windows and the augmentation by (seed, rank, epoch),
    so a resumed run continues exactly."""
    cfg = run.cfg
    run.train_loader.sampler.set_epoch(epoch)
    for loader in (run.train_loader, run.val_loader):
        loader.dataset.set_epoch(epoch)
    # Augmentation draws from the global generator: seed it per (rank, epoch) so a resumed run
    # continues exactly and ranks augment independently.
    torch.manual_seed(cfg.seed + 7919 * run.rank + epoch)
    reset_peak_memory(run.device)
    if cfg.freeze_backbone_epochs > 0:
        set_backbone_trainable(run.model, trainable=epoch > cfg.freeze_backbone_epochs)
    stats = unless_out_of_memory(lambda: train_one_epoch(
        run.model, run.train_loader, transform=run.train_transform, optimizer=run.optimizer,
        scheduler=run.scheduler, scaler=run.scaler, policy=run.policy, device=run.device,
        grad_accum_steps=cfg.grad_accum_steps, clip_grad_norm=cfg.clip_grad_norm,
        label_smoothing=cfg.label_smoothing))
    # Diverged: the weights are not finite, or the loop's loss rule broke (its loss_sum is then
    # inf/NaN): one non-finite loss in fp32/bf16, NONFINITE_STEPS_TO_DIVERGE in a row in fp16,
    # where GradScaler skips the steps whose gradients (or loss) overflow and the weights stay
    # as they were, so a skipped step alone is no divergence.
    diverged = stats is not None and not (math.isfinite(stats.loss_sum) and finite_parameters(run.model))
    out_of_memory, diverged = all_reduce_floats([float(stats is None), float(diverged)], dist.ReduceOp.MAX)
    if out_of_memory:
        return EpochResult(OUT_OF_MEMORY)
    if diverged:
        return EpochResult(DIVERGED, stats)
    scoring = run.eval_model if run.eval_model is not None else unwrap(run.model)   # out of DDP (`Run`)
    eval_out = unless_out_of_memory(lambda: evaluate(scoring, run.val_loader,
                                                     transform=run.val_transform, policy=run.policy,
                                                     device=run.device))
    if any_rank(eval_out is None):
        return EpochResult(OUT_OF_MEMORY)
    return EpochResult(TRAINED, stats, eval_out)


def data_counts(run: Run) -> tuple[int, int, int, int]:
    """(clip reads, clip-cache hits, failed reads, clip-cache repairs) of this rank's two
    datasets so far, their DataLoader processes included (cumulative: subtract an earlier call's
    for an epoch's)."""
    sets = (run.train_loader.dataset, run.val_loader.dataset)
    return (sum(d.reads for d in sets), sum(d.cache_hits for d in sets), sum(d.failures for d in sets),
            sum(d.cache_repairs for d in sets))


def current_lr(run: Run) -> float:
    """The largest learning rate of the optimizer's groups now."""
    return float(max(group["lr"] for group in run.optimizer.param_groups))


def save_run_checkpoint(run: Run, directory: str | Path, *, epoch: int,
                        metrics: dict[str, Any] | None = None) -> None:
    """`checkpoint.pt` of the run after `epoch` in `directory` (`trainer.training.checkpointing`)."""
    save_checkpoint(directory, model=run.model, optimizer=run.optimizer, scaler=run.scaler,
                    scheduler=run.scheduler, epoch=epoch, config=run.cfg.to_dict(), spec=run.spec,
                    class_names=run.class_names, metrics=metrics, precision=run.policy.name)
