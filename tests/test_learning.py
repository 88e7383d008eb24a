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

from bench.learning_check import LEARNED_ACC, fit_tiny, learning_index
from vidtune.datasets.cache import FrameCache

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """200 videos (160 train / 40 val), as `make gpu-check`'s learning step makes them."""
    return learning_index(tmp_path_factory.mktemp("learn"))


@pytest.fixture(scope="module")
def clip_cache(tmp_path_factory):
    """The clip cache as a search uses it (jpeg, the default): the first epoch decodes each
    video once, later epochs read the stored frames, so this also checks that training on
    cached (lossy) frames still learns."""
    return FrameCache(tmp_path_factory.mktemp("clip-cache"))


def test_tiny_learns_synthetic_violence(index, clip_cache):
    assert len(index.val) == 40 and len(index.train) == 160
    curve = fit_tiny(index.train, index.val, cache=clip_cache)
    accuracies = curve.accuracies
    print("val_acc per epoch, true labels:", accuracies)
    assert curve.precision == "fp32" and curve.skipped_steps == 0
    assert accuracies[-1] >= LEARNED_ACC, accuracies          # chance is 0.5 (balanced val set)
    assert max(accuracies) > accuracies[0] or accuracies[0] >= 0.8, accuracies


def test_tiny_does_not_learn_shuffled_labels(index, clip_cache):
    labels = [v.label for v in index.train]
    random.Random(0).shuffle(labels)
    shuffled = [dataclasses.replace(v, label=y) for v, y in zip(index.train, labels, strict=True)]
    assert sum(labels) == sum(v.label for v in index.train)   # still balanced
    accuracies = fit_tiny(shuffled, index.val, cache=clip_cache).accuracies
    print("val_acc per epoch, shuffled train labels:", accuracies)
    assert 0.3 <= accuracies[-1] <= 0.7, accuracies
