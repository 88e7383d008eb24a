"""Hugging Face video classifiers (`--model hf:...`), without a network: tiny random VideoMAE /
ViViT checkpoints written with `save_pretrained` into a temporary folder."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import VideoIndex
from vidtune.datasets.records import VideoInfo
from vidtune.datasets.transforms import ClipTransform
from vidtune.flags import ConfigError
from vidtune.trainer.models import registry as models
from vidtune.trainer.ray_setup.launch import validate_config
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.run import clip_datasets

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_frames=8,
             image_size=32, num_labels=5)


def save_tiny(kind: str, folder, **config):
    """A random 2-layer checkpoint of `kind` (videomae, timesformer, vivit) with a 5-way head and
    its image processor (TimeSformer's hub checkpoints use VideoMAE's, with Kinetics' mean/std);
    `config` overrides `SMALL`."""
    config = {**SMALL, **config}
    crop = {"height": config["image_size"], "width": config["image_size"]}
    size = {"shortest_edge": config["image_size"]}
    if kind == "videomae":
        model = transformers.VideoMAEForVideoClassification(
            transformers.VideoMAEConfig(patch_size=8, tubelet_size=2, **config))
        processor = transformers.VideoMAEImageProcessor(size=size, crop_size=crop, image_mean=[0.4, 0.5, 0.6],
                                                        image_std=[0.2, 0.25, 0.3])
    elif kind == "timesformer":
        model = transformers.TimesformerForVideoClassification(
            transformers.TimesformerConfig(patch_size=8, **config))
        processor = transformers.VideoMAEImageProcessor(size=size, crop_size=crop, image_mean=[0.45] * 3,
                                                        image_std=[0.225] * 3)
    elif kind == "vivit":
        model = transformers.VivitForVideoClassification(
            transformers.VivitConfig(tubelet_size=[2, 8, 8], **config))
        processor = transformers.VivitImageProcessor(size=size, crop_size=crop)
    else:
        raise ValueError(kind)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def fill_hub_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """`cache` laid out as huggingface_hub writes its hub cache, holding `folder`'s files as hub
    model `repo_id` (models--ORG--NAME/refs/main -> snapshots/COMMIT/); returns the snapshot."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in Path(folder).iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    return snapshot


@pytest.fixture(scope="module")
def videomae(tmp_path_factory):
    return save_tiny("videomae", tmp_path_factory.mktemp("videomae"))


def test_hf_names_are_models_and_unknown_names_point_at_them(videomae):
    assert models.is_hf_model(f"hf:{videomae}") and not models.is_hf_model("tiny")
    cfg = TrainConfig.from_dict({"model": f"hf:{videomae}"})
    assert cfg.model == f"hf:{videomae}"
    with pytest.raises(ValueError, match="unknown model 'resnet'.*hf:HUB_ID"):
        models.get_spec("resnet")


@pytest.mark.parametrize("kind", ["videomae", "vivit"])
def test_input_spec_comes_from_the_config_and_normalises_as_the_processor_does(kind, tmp_path):
    folder = save_tiny(kind, tmp_path)
    spec = models.get_spec(f"hf:{folder}")
    assert (spec.num_frames, spec.height, spec.width) == (8, 32, 32)
    clip = np.random.default_rng(0).integers(0, 256, (8, 32, 32, 3), dtype=np.uint8)
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    theirs = processor(list(clip), return_tensors="pt").pixel_values          # B x T x C x H x W
    ours = ClipTransform(spec.mean, spec.std, train=False)(torch.from_numpy(clip)[None])   # B x C x T x H x W
    torch.testing.assert_close(ours.transpose(1, 2), theirs, atol=1e-5, rtol=0)


def test_head_is_replaced_with_two_labels_and_freezing_leaves_it_training(videomae):
    name = f"hf:{videomae}"
    model = models.build_model(name)
    saved = transformers.AutoModelForVideoClassification.from_pretrained(videomae)
    head = models.classifier(model)
    assert head.out_features == 2 and saved.classifier.out_features == 5
    assert model.hf.config.id2label == {0: "non-violent", 1: "violent"}
    torch.testing.assert_close(model.hf.videomae.embeddings.patch_embeddings.projection.weight,
                               saved.videomae.embeddings.patch_embeddings.projection.weight)
    logits = model(torch.randn(2, 3, 8, 32, 32))          # B x C x T x H x W, as the loop gives it
    assert logits.shape == (2, 2)
    models.set_backbone_trainable(model, False)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {"hf.classifier.weight",
                                                                         "hf.classifier.bias"}
    models.set_backbone_trainable(model, True)
    assert all(p.requires_grad for p in model.parameters())


def test_a_folder_without_weights_is_refused_unless_vidtune_wrote_it_so(videomae, tmp_path):
    """A config alone (`config.save_pretrained`) would fine-tune random weights unawares: refused,
    naming the folder. vidtune's own weightless copy (an MLflow model's hf_config, whose weights
    are in its checkpoint) builds the architecture."""
    from vidtune.trainer.models import hf_models

    bare = tmp_path / "config-only"
    transformers.AutoConfig.from_pretrained(videomae).save_pretrained(bare)
    with pytest.raises(hf_models.HFModelError, match=r"config-only has a config.json but no weights"):
        hf_models.build(bare, str(bare))
    with pytest.raises(ConfigError) as e:                  # on the driver, before Ray starts
        validate_config(TrainConfig(data=DataConfig(root=str(tmp_path)), model=f"hf:{bare}"))
    assert e.value.flag == "--model" and "no weights" in str(e.value)
    model = hf_models.build(videomae, str(videomae))
    copy = model.save_pretrained(tmp_path / "hf_config", weights=False)
    rebuilt = hf_models.build(copy, str(copy))
    assert type(rebuilt.hf) is type(model.hf) and models.classifier(rebuilt).out_features == 2


def test_the_checkpoints_clip_size_reaches_the_datasets_and_the_cache_key(videomae, tmp_path):
    video = tmp_path / "a.mp4"
    video.write_bytes(b"x")           # entry_key stats the file only
    info = VideoInfo(path=video, label=1, split="train", num_frames=30, fps=15.0, width=112, height=112,
                     duration_s=2.0)
    index = VideoIndex(layout="rwf2000", class_names={0: "NonFight", 1: "Fight"}, train=[info], val=[info],
                       dropped=[])
    cfg = TrainConfig(data=DataConfig(root=str(tmp_path), clip_cache_dir=str(tmp_path / "cache")),
                      model=f"hf:{videomae}")
    train, val = clip_datasets(cfg, models.get_spec(cfg.model), index, torch.device("cpu"))
    assert (train.num_frames, train.height, train.width) == (8, 32, 32)
    assert (val.num_frames, val.height, val.width) == (8, 32, 32)
    at_32 = train.cache.entry_path(info, height=train.height, width=train.width)
    assert at_32 != train.cache.entry_path(info, height=64, width=64)     # tiny's size: another entry


def test_the_driver_refuses_another_clip_size_and_a_missing_checkpoint(videomae, tmp_path):
    base = dict(data=DataConfig(root=str(tmp_path)), model=f"hf:{videomae}")
    validate_config(TrainConfig(**base))
    with pytest.raises(ConfigError, match="--num-frames.*exactly 8 frames x 32 x 32"):
        validate_config(TrainConfig(**{**base, "data": DataConfig(root=str(tmp_path), num_frames=16)}))
    with pytest.raises(ConfigError, match="--weights.*no Kinetics weights"):
        validate_config(TrainConfig(**base, weights="kinetics"))
    with pytest.raises(ConfigError, match="--model.*has no config.json"):
        validate_config(TrainConfig(data=base["data"], model=f"hf:{tmp_path}"))


def test_a_hub_id_loads_from_a_filled_cache_offline_and_a_missing_one_is_one_line(videomae, tmp_path,
                                                                                  monkeypatch):
    """The hub path without a network: a cache laid out as huggingface_hub writes it
    (models--ORG--NAME/refs/main -> snapshots/COMMIT/), HF_HUB_OFFLINE on."""
    from huggingface_hub import constants

    fill_hub_cache(tmp_path / "hub", "vidtune-test/tiny-videomae", videomae)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)     # (cache_home reads it first)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = models.get_spec("hf:vidtune-test/tiny-videomae")
    assert (spec.num_frames, spec.height, spec.width) == (8, 32, 32)
    assert models.classifier(models.build_model("hf:vidtune-test/tiny-videomae")).out_features == 2
    with pytest.raises(ConfigError) as refused:
        validate_config(TrainConfig(data=DataConfig(root=str(tmp_path)), model="hf:vidtune-test/missing"))
    line = str(refused.value)
    assert "\n" not in line and line.startswith("--model: Hugging Face model 'vidtune-test/missing'")
    assert str(tmp_path / "hub") in line and "HF_HOME" in line and "HF_HUB_OFFLINE=1" in line


def test_workers_read_the_drivers_hub_cache_offline_as_it_does_and_never_get_the_token(monkeypatch, tmp_path):
    """The driver fetched the checkpoint into HF_HOME (or HF_HUB_CACHE); every Ray worker gets the
    same settings through the runtime env (trainer.ray_setup.launch.worker_env_vars), HF_HUB_OFFLINE with
    them, but not HF_TOKEN: workers only read the cache."""
    from vidtune.trainer.ray_setup.launch import worker_env_vars

    for name in ("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert not {k for k in worker_env_vars() if k.startswith("HF_")}
    monkeypatch.setenv("HF_HOME", str(tmp_path / "shared-hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    env = worker_env_vars()
    assert env["HF_HOME"] == str(tmp_path / "shared-hf") and env["HF_HUB_OFFLINE"] == "1"
    assert "HF_TOKEN" not in env and "hf_secret" not in env.values()
