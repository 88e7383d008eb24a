"""The `tiny` model learns the synthetic violence dataset, and does not learn shuffled labels.

This is the test that the whole stack (generated videos -> index -> decord Dataset -> on-device
transform -> autocast loop -> metrics) carries a real signal: with the true labels validation
accuracy ends well above chance; with the training labels shuffled (validation labels kept) it
stays near chance, so the first result is learning and not a leak or a constant guess.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from vidtune.datasets.cache import FrameCache
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index
from vidtune.datasets.synthetic import generate
from vidtune.datasets.transforms import ClipTransform
from vidtune.datasets.video import VideoClipDataset, build_loader
from vidtune.trainer.loop import evaluate, make_optimizer, make_scheduler, train_one_epoch
from vidtune.trainer.metrics import classification_metrics
from vidtune.trainer.models import build_model, get_spec
from vidtune.trainer.precision import choose_precision

pytestmark = pytest.mark.slow

EPOCHS = 8
BATCH_SIZE = 8
LR = 5e-4


@pytest.fixture(scope="module")
def learning_index(tmp_path_factory):
    """200 videos (160 train / 40 val): enough validation clips for accuracy to mean something."""
    root = generate(tmp_path_factory.mktemp("learn") / "rwf", videos=200, seed=1)
    return build_index(DataConfig(root=str(root)))


@pytest.fixture(scope="module")
def clip_cache(tmp_path_factory):
    """The clip cache as a search uses it (jpeg, the default): the first epoch decodes each
    video once, later epochs read the stored frames, so this also checks that training on
    cached (lossy) frames still learns."""
    return FrameCache(tmp_path_factory.mktemp("clip-cache"))


def _fit(train_videos, val_videos, *, cache=None, seed: int = 0) -> list[float]:
    """Train `tiny` for EPOCHS on the given videos; validation accuracy after each epoch."""
    torch.manual_seed(seed)
    spec = get_spec("tiny")
    device = torch.device("cpu")
    policy = choose_precision("auto", device)
    clip = dict(num_frames=spec.num_frames, frame_stride=2, height=spec.height, width=spec.width, cache=cache)
    train_ds = VideoClipDataset(train_videos, train=True, seed=seed, **clip)
    val_ds = VideoClipDataset(val_videos, train=False, seed=seed, **clip)
    train_loader = build_loader(train_ds, batch_size=BATCH_SIZE, train=True, num_workers=1,
                                pin_memory=False, seed=seed)
    val_loader = build_loader(val_ds, batch_size=BATCH_SIZE, train=False, num_workers=1,
                              pin_memory=False, seed=seed)
    model = build_model("tiny")
    optimizer = make_optimizer(model, LR, 0.05, device)
    scheduler = make_scheduler(optimizer, EPOCHS * len(train_loader), warmup_frac=0.1)
    scaler = policy.make_scaler()
    train_tf = ClipTransform(spec.mean, spec.std, train=True)
    val_tf = ClipTransform(spec.mean, spec.std, train=False)
    accuracies = []
    for epoch in range(EPOCHS):
        train_ds.set_epoch(epoch)
        train_one_epoch(model, train_loader, transform=train_tf, optimizer=optimizer,
                        scheduler=scheduler, scaler=scaler, policy=policy, device=device)
        out = evaluate(model, val_loader, transform=val_tf, policy=policy, device=device)
        accuracies.append(classification_metrics(out.probs, out.labels)["val_acc"])
    return accuracies


def test_tiny_learns_synthetic_violence(learning_index, clip_cache):
    assert len(learning_index.val) == 40 and len(learning_index.train) == 160
    accuracies = _fit(learning_index.train, learning_index.val, cache=clip_cache)
    print("val_acc per epoch, true labels:", accuracies)
    assert accuracies[-1] >= 0.8, accuracies          # chance is 0.5 (balanced val set)
    assert max(accuracies) > accuracies[0] or accuracies[0] >= 0.8, accuracies


def test_tiny_does_not_learn_shuffled_labels(learning_index, clip_cache):
    labels = [v.label for v in learning_index.train]
    random.Random(0).shuffle(labels)
    shuffled = [dataclasses.replace(v, label=y) for v, y in zip(learning_index.train, labels, strict=True)]
    assert sum(labels) == sum(v.label for v in learning_index.train)   # still balanced
    accuracies = _fit(shuffled, learning_index.val, cache=clip_cache)
    print("val_acc per epoch, shuffled train labels:", accuracies)
    assert 0.3 <= accuracies[-1] <= 0.7, accuracies
