"""Does the training loop learn? The `tiny` model trained on generated violence-like videos
(`datasets.synthetic`), without Ray: generated videos -> index -> decord dataset -> clip cache ->
on-device transform -> autocast loop (GradScaler under fp16) -> metrics.

Shared by tests/test_learning.py (the CPU: fp32, and shuffled labels that must not learn) and
`make gpu-check` (a GPU: fp16 with GradScaler, and bf16, each must learn). The bar is the same
everywhere: validation accuracy at the last epoch at least LEARNED_ACC on a balanced validation
set of 40 clips, where chance is 0.5 (Wilson's 95% interval for 32/40 is [0.65, 0.90]).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vidtune.datasets.cache import FrameCache
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import VideoIndex, build_index
from vidtune.datasets.synthetic import generate
from vidtune.datasets.transforms import ClipTransform
from vidtune.datasets.video import VideoClipDataset, build_loader
from vidtune.trainer.models.registry import build_model, get_spec
from vidtune.trainer.training.loop import evaluate, make_optimizer, make_scheduler, train_one_epoch
from vidtune.trainer.training.metrics import classification_metrics
from vidtune.trainer.training.precision import choose_precision

EPOCHS = 8
BATCH_SIZE = 8
LR = 5e-4
VIDEOS = 200          # 160 train / 40 val: enough validation clips for accuracy to mean something
DATA_SEED = 1
LEARNED_ACC = 0.8     # the last epoch's val_acc that counts as learned (chance: 0.5)


@dataclass(frozen=True)
class Curve:
    """One training run: `accuracies[e]` is val_acc after epoch e+1; `skipped_steps` the
    optimizer steps GradScaler skipped for a non-finite loss (0 without a scaler)."""

    precision: str          # what the policy resolved to: fp32 | fp16 | bf16
    accuracies: list[float]
    skipped_steps: int
    seconds: float

    @property
    def final(self) -> float:
        return self.accuracies[-1]


def learning_index(folder: Path, *, workers: int | None = None) -> VideoIndex:
    """VIDEOS generated videos (seed DATA_SEED) in `folder`, indexed."""
    root = generate(folder / "rwf", videos=VIDEOS, seed=DATA_SEED, workers=workers, overwrite=True)
    return build_index(DataConfig(root=str(root)))


def fit_tiny(train_videos: Sequence, val_videos: Sequence, *, device: torch.device | str = "cpu",
             precision: str = "auto", cache: FrameCache | None = None, seed: int = 0,
             epochs: int = EPOCHS, loader_workers: int = 1, model: str = "tiny", lr: float = LR) -> Curve:
    """Train `model` (any registry name, `hf:FOLDER` too) at `lr` from a fixed seed for `epochs`
    on `train_videos` (index entries) and score `val_videos` after each epoch, at `precision`
    (`trainer.training.precision.choose_precision`) on `device`. `cache`: the clip cache as a search uses
    it (its first epoch decodes each video once; later epochs read the stored JPEG frames)."""
    torch.manual_seed(seed)
    device = torch.device(device)
    spec = get_spec(model)
    policy = choose_precision(precision, device)
    clip = dict(num_frames=spec.num_frames, frame_stride=2, height=spec.height, width=spec.width, cache=cache)
    train_ds = VideoClipDataset(list(train_videos), train=True, seed=seed, **clip)
    val_ds = VideoClipDataset(list(val_videos), train=False, seed=seed, **clip)
    pin = device.type == "cuda"
    train_loader = build_loader(train_ds, batch_size=BATCH_SIZE, train=True, num_workers=loader_workers,
                                pin_memory=pin, seed=seed)
    val_loader = build_loader(val_ds, batch_size=BATCH_SIZE, train=False, num_workers=loader_workers,
                              pin_memory=pin, seed=seed)
    net = build_model(model).to(device)
    optimizer = make_optimizer(net, lr, 0.05, device)
    scheduler = make_scheduler(optimizer, epochs * len(train_loader), warmup_frac=0.1)
    scaler = policy.make_scaler()
    train_tf = ClipTransform(spec.mean, spec.std, train=True).to(device)
    val_tf = ClipTransform(spec.mean, spec.std, train=False).to(device)
    accuracies, skipped = [], 0
    started = time.perf_counter()
    for epoch in range(epochs):
        train_ds.set_epoch(epoch)
        stats = train_one_epoch(net, train_loader, transform=train_tf, optimizer=optimizer,
                                scheduler=scheduler, scaler=scaler, policy=policy, device=device)
        skipped += stats.nonfinite_steps
        out = evaluate(net, val_loader, transform=val_tf, policy=policy, device=device)
        accuracies.append(classification_metrics(out.probs, out.labels)["val_acc"])
    return Curve(policy.name, accuracies, skipped, time.perf_counter() - started)


def problems(curve: Curve) -> list[str]:
    """What says `curve` did not learn: a last epoch below LEARNED_ACC; empty when it learned."""
    if curve.final < LEARNED_ACC:
        return [f"{curve.precision}: val_acc {curve.final:.3f} after {len(curve.accuracies)} epochs, "
                f"below {LEARNED_ACC} (chance 0.5); per epoch {[round(a, 3) for a in curve.accuracies]}"]
    return []


def summary(curves: Sequence[Curve]) -> str:
    """One line: each precision's last val_acc, seconds and skipped steps."""
    return "; ".join(f"{c.precision} val_acc {c.final:.3f} in {c.seconds:.0f} s"
                     + (f" ({c.skipped_steps} steps skipped by GradScaler)" if c.precision == "fp16" else "")
                     for c in curves)


# A hub architecture that learns the same videos from random weights: a tiny VideoMAE
# (tests/test_hf_learning.py, and `make gpu-check`'s hub-architecture step). Measured on the CPU in
# fp32 through fit_tiny: val_acc [0.475, 0.5, 0.5, 0.9, 0.95, 0.875, 0.975, 0.975, 1.0, 1.0].
# initializer_range 0.1, not transformers' 0.02: at 0.02 a model this narrow starts with patch
# embeddings ~8x smaller than VideoMAE's fixed sinusoidal position embeddings and sits at chance
# for ~300 optimizer steps before it finds the motion (0.45-0.55 after 25 epochs here).
TINY_VIDEOMAE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                     num_frames=8, image_size=32, patch_size=4, tubelet_size=2, initializer_range=0.1)
HF_EPOCHS = 10
HF_LR = 3e-3


def save_tiny_videomae(folder: Path) -> Path:
    """A random TINY_VIDEOMAE with its image processor, written with save_pretrained into
    `folder` (train it as `hf:` + folder)."""
    import transformers  # optional: only for the hub-architecture checks

    size = TINY_VIDEOMAE["image_size"]
    # Its own seed: the random init decides how soon a model this small learns, and must not
    # depend on what the process drew before (another test's models).
    torch.manual_seed(0)
    transformers.VideoMAEForVideoClassification(transformers.VideoMAEConfig(**TINY_VIDEOMAE)).save_pretrained(folder)
    transformers.VideoMAEImageProcessor(size={"shortest_edge": size},
                                        crop_size={"height": size, "width": size}).save_pretrained(folder)
    return Path(folder)
