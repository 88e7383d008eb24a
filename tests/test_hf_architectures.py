"""TimeSformer and ViViT through vidtune's `hf:/folder` path as VideoMAE goes, without a network:
tiny random checkpoints (2 layers, hidden 32, 8 frames) written with `save_pretrained`, loaded by
name, their input from their own config and image processor, a two-class head with the labels'
names, and a training step and an evaluation through the loop's own functions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_hf_models import save_tiny
from vidtune.datasets.transforms import ClipTransform
from vidtune.trainer.models import registry as models
from vidtune.trainer.models.hf_models import HFVideoClassifier
from vidtune.trainer.training.loop import evaluate, make_optimizer, make_scheduler, train_one_epoch
from vidtune.trainer.training.precision import choose_precision

transformers = pytest.importorskip("transformers")

# Each architecture's tiny checkpoint: TimeSformer at 48 px (so the size can only come from its
# config: its default is 224, vidtune's tiny 64), ViViT at 32 px with 8 frames (its default: 32).
SIZES = {"timesformer": 48, "vivit": 32, "videomae": 32}
HUB_CLASSES = {"timesformer": "TimesformerForVideoClassification", "vivit": "VivitForVideoClassification",
               "videomae": "VideoMAEForVideoClassification"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{kind: folder} of every architecture's tiny checkpoint with its image processor."""
    torch.manual_seed(0)
    return {kind: save_tiny(kind, tmp_path_factory.mktemp(kind), image_size=size)
            for kind, size in SIZES.items()}


def clips(n: int, size: int, seed: int = 0) -> torch.Tensor:
    """uint8 `n x 8 x size x size x 3` clips, as the data loader gives them."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, 8, size, size, 3), dtype=np.uint8))


@pytest.mark.parametrize("kind", ["timesformer", "vivit"])
def test_the_input_spec_comes_from_the_config_and_the_processor(kind, folders):
    folder = folders[kind]
    spec = models.get_spec(f"hf:{folder}")
    assert (spec.num_frames, spec.height, spec.width) == (8, SIZES[kind], SIZES[kind])
    # Not ImageNet's mean/std (vidtune's fallback without a processor): the processor's, folded
    # with its rescale (and ViViT's offset: x / 127.5 - 1) into vidtune's (x / 255 - mean) / std.
    assert spec.mean != (0.485, 0.456, 0.406)
    clip = clips(1, SIZES[kind])
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    theirs = processor(list(clip[0].numpy()), return_tensors="pt").pixel_values     # B x T x C x H x W
    ours = ClipTransform(spec.mean, spec.std, train=False)(clip)                     # B x C x T x H x W
    torch.testing.assert_close(ours.transpose(1, 2), theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["timesformer", "vivit"])
def test_the_head_is_two_class_with_the_labels_names_and_the_backbone_is_the_checkpoints(kind, folders):
    model = models.build_model(f"hf:{folders[kind]}")
    saved = transformers.AutoModelForVideoClassification.from_pretrained(folders[kind])
    assert type(model) is HFVideoClassifier and type(model.hf).__name__ == HUB_CLASSES[kind]
    assert models.classifier(model).out_features == 2 and saved.classifier.out_features == 5
    assert model.hf.config.id2label == {0: "non-violent", 1: "violent"}
    assert model.hf.config.label2id == {"non-violent": 0, "violent": 1}
    ours, theirs = model.hf.state_dict(), saved.state_dict()
    backbone = [k for k in theirs if not k.startswith("classifier.")]
    assert len(backbone) > 10 and all(torch.equal(ours[k], theirs[k]) for k in backbone)
    models.set_backbone_trainable(model, False)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"hf.classifier.weight",
                                                                         "hf.classifier.bias"}


@pytest.mark.parametrize("kind", ["timesformer", "vivit"])
def test_a_training_step_through_the_loop_changes_the_weights_with_a_finite_loss(kind, folders):
    name = f"hf:{folders[kind]}"
    spec, model = models.get_spec(name), models.build_model(name)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.05, device="cpu")
    batches = [(clips(2, SIZES[kind], seed), torch.tensor([0, 1])) for seed in range(2)]
    stats = train_one_epoch(model, batches, transform=ClipTransform(spec.mean, spec.std, train=True),
                            optimizer=optimizer, scheduler=make_scheduler(optimizer, 2, 0.0),
                            scaler=torch.amp.GradScaler("cpu", enabled=False),
                            policy=choose_precision("fp32", "cpu"), device="cpu")
    assert stats.steps == 2 and stats.clips == 4 and stats.nonfinite_steps == 0
    assert np.isfinite(stats.loss_sum) and stats.loss_sum > 0
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert {"hf.classifier.weight", "hf.classifier.bias"} <= changed
    assert len(changed) > len(before) // 2                       # the backbone trains too, not only the head


@pytest.mark.parametrize("kind", ["timesformer", "vivit", "videomae"])
def test_the_logits_are_read_as_videomaes_are(kind, folders):
    """One reading for every architecture: the transformers output's `.logits` of the clips in its
    `B x T x C x H x W` layout, softmaxed to P(violent) by the loop's evaluation."""
    name = f"hf:{folders[kind]}"
    spec, model = models.get_spec(name), models.build_model(name).eval()
    batch = clips(3, SIZES[kind])
    x = ClipTransform(spec.mean, spec.std, train=False)(batch)
    with torch.no_grad():
        theirs = model.hf(pixel_values=x.transpose(1, 2)).logits
    assert theirs.shape == (3, 2)
    out = evaluate(model, [(batch, torch.tensor([0, 1, 1]))], transform=ClipTransform(spec.mean, spec.std,
                   train=False), policy=choose_precision("fp32", "cpu"), device="cpu")
    torch.testing.assert_close(out.probs, theirs.softmax(dim=1)[:, 1])
    assert out.count == 3 and len(set(out.probs.tolist())) == 3
