"""Model registry, weights loading (local file, Kinetics offline) and backbone freezing."""
from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import re
import shlex
import socket
import urllib.error
import zipfile

import pytest
import torch
from torch import nn
from torchvision.models.video.swin_transformer import SwinTransformer3d

from vidtune.trainer.models import registry as models
from vidtune.trainer.models.registry import (
    MODEL_NAMES,
    WeightsError,
    build_model,
    check_input_size,
    classifier,
    get_spec,
    head_parameters,
    prepare_input_transform,
    prepare_model_memory_format,
    set_backbone_trainable,
)


@pytest.fixture(scope="module")
def tiny() -> nn.Module:
    torch.manual_seed(0)
    return build_model("tiny")


def _clips(batch: int, name: str = "tiny") -> torch.Tensor:
    spec = get_spec(name)
    return torch.randn(batch, 3, spec.num_frames, spec.height, spec.width)


def test_registry_lists_all_models():
    assert set(MODEL_NAMES) == {"tiny", "tiny_deep", "mvit_v2_s", "mvit_v1_b", "swin3d_t", "swin3d_s",
                                "swin3d_b"}
    for name in MODEL_NAMES:
        spec = get_spec(name)
        assert spec.name == name and len(spec.mean) == len(spec.std) == 3
        assert models.has_kinetics_weights(name) == (not name.startswith("tiny"))


@pytest.mark.parametrize("call", [get_spec, build_model, lambda n: check_input_size(n, 8, 64, 64)])
def test_unknown_model_lists_known_names(call):
    with pytest.raises(ValueError,
                       match="unknown model 'resnet'.*mvit_v2_s.*tiny|unknown model 'resnet'.*tiny"):
        call("resnet")


def test_tiny_forward_backward_shape_and_size(tiny):
    assert 50_000 < models.count_parameters(tiny) < 1_000_000
    logits = tiny(_clips(3))
    assert logits.shape == (3, 2) and logits.dtype == torch.float32
    logits.sum().backward()
    assert all(p.grad is not None for p in tiny.parameters())
    tiny.zero_grad(set_to_none=True)


def test_tiny_deep_is_a_larger_cpu_model_of_the_same_input():
    torch.manual_seed(0)
    deep = build_model("tiny_deep")
    assert models.count_parameters(build_model("tiny")) < models.count_parameters(deep) < 1_000_000
    assert get_spec("tiny_deep") == dataclasses.replace(get_spec("tiny"), name="tiny_deep")
    assert deep(_clips(2, "tiny_deep")).shape == (2, 2)


@pytest.mark.parametrize("name", ["mvit_v2_s", "swin3d_t"])
def test_spec_normalisation_matches_torchvision_kinetics_preset(name):
    preset = models._REGISTRY[name].kinetics.transforms()
    spec = get_spec(name)
    assert tuple(preset.mean) == pytest.approx(spec.mean) and tuple(preset.std) == pytest.approx(spec.std)
    assert tuple(preset.crop_size) == (spec.height, spec.width)


@pytest.mark.parametrize("name", [n for n in MODEL_NAMES if not n.startswith("tiny")])
def test_torchvision_models_get_two_class_head(name):
    with torch.device("meta"):           # shapes only: no 30-90M-parameter init on the CPU
        model = build_model(name)
        assert classifier(model).out_features == 2
        assert classifier(build_model(name, num_classes=5)).out_features == 5


def test_check_input_size():
    check_input_size("tiny", 8, 64, 64)
    check_input_size("swin3d_t", 8, 112, 112)          # Swin pads windows: any size
    with pytest.raises(ValueError, match=r"exactly 16 frames x 224 x 224.*--height"):
        check_input_size("mvit_v2_s", 16, 112, 112)


# --- weights ---------------------------------------------------------------------------------

def test_missing_weights_file_names_it(tmp_path):
    path = tmp_path / "nope.pth"
    with pytest.raises(WeightsError, match=f"weights file {path} not found.*--weights"):
        build_model("tiny", weights=str(path))


def test_weights_round_trip_keeps_trained_head(tiny, tmp_path):
    path = tmp_path / "tiny.pth"
    torch.save(tiny.state_dict(), path)
    loaded = build_model("tiny", weights=str(path))
    for (k, a), b in zip(tiny.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_weights_wrapped_and_prefixed_like_a_ddp_checkpoint(tiny, tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"epoch": 3, "model": {f"module.{k}": v for k, v in tiny.state_dict().items()}}, path)
    loaded = build_model("tiny", weights=str(path))
    assert torch.equal(loaded.conv_proj.weight, tiny.conv_proj.weight)
    assert torch.equal(classifier(loaded).weight, classifier(tiny).weight)


def test_weights_without_head_get_fresh_head(tiny, tmp_path):
    state = {k: v for k, v in tiny.state_dict().items() if not k.startswith("head.")}
    path = tmp_path / "backbone.pth"
    torch.save(state, path)
    loaded = build_model("tiny", weights=str(path))
    assert torch.equal(loaded.conv_proj.weight, tiny.conv_proj.weight)
    assert classifier(loaded).out_features == 2


def test_weights_with_kinetics_sized_head_are_replaced(tmp_path):
    torch.manual_seed(1)
    source = models._build_tiny(num_classes=400)         # a "pretrained" 400-class model
    path = tmp_path / "k400.pth"
    torch.save(source.state_dict(), path)
    loaded = build_model("tiny", weights=str(path))
    assert classifier(loaded).out_features == 2
    assert torch.equal(loaded.blocks[2].mlp[0].weight, source.blocks[2].mlp[0].weight)
    assert loaded(_clips(1)).shape == (1, 2)


def test_weights_of_another_architecture_name_file_and_model(tmp_path):
    path = tmp_path / "other.pth"
    block = models.MSBlockConfig(1, 16, 16, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 4, 4])
    other = models.MViT(spatial_size=(64, 64), temporal_size=8, residual_pool=True,
                        residual_with_cls_embed=False, rel_pos_embed=True, proj_after_attn=True,
                        num_classes=2, block_setting=[block] * 2)
    torch.save(other.state_dict(), path)
    with pytest.raises(WeightsError, match=f"{path}.*does not fit model 'tiny'"):
        build_model("tiny", weights=str(path))
    torch.save(nn.Linear(3, 2).state_dict() | {"foo.weight": torch.zeros(2, 2)}, path)
    with pytest.raises(WeightsError, match=r"does not fit model 'tiny'.*missing key"):
        build_model("tiny", weights=str(path))


@pytest.mark.parametrize("content", [b"not a torch file", None])
def test_weights_file_that_is_not_a_state_dict(tmp_path, content):
    path = tmp_path / "bad.pth"
    if content is None:
        torch.save([1, 2, 3], path)
    else:
        path.write_bytes(content)
    with pytest.raises(WeightsError, match=str(path)):
        build_model("tiny", weights=str(path))


def test_tiny_has_no_kinetics_weights():
    with pytest.raises(WeightsError, match="'tiny' has no pretrained weights.*--weights none"):
        build_model("tiny", weights="kinetics")


def test_kinetics_offline_fails_at_once_with_a_way_out(monkeypatch, tmp_path):
    """No network: torch.hub's download raises URLError; we must not retry and must say how to
    pass a local file. The hub cache is an empty folder, so a real download is attempted."""
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path))
    seen = {}

    def offline(*args, **kwargs):
        seen["calls"] = seen.get("calls", 0) + 1
        seen["timeout"] = socket.getdefaulttimeout()
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(torch.hub, "urlopen", offline)
    before = socket.getdefaulttimeout()
    with pytest.raises(WeightsError) as info:
        build_model("mvit_v2_s", weights="kinetics")
    msg = str(info.value)
    assert "mvit_v2_s-ae3be167.pth" in msg and "--weights /path/to/mvit_v2_s-ae3be167.pth" in msg
    assert "Name or service not known" in msg and str(tmp_path) in msg
    assert seen == {"calls": 1, "timeout": models.DOWNLOAD_TIMEOUT_S}   # one try, bounded wait
    assert socket.getdefaulttimeout() == before


def test_kinetics_uses_the_hub_cache_without_network(monkeypatch, tmp_path):
    """A file already in the torch hub cache loads offline and gets a 2-class head. The swin3d_t
    entry is shrunk to a small SwinTransformer3d of the same kind to keep the test fast."""
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path))
    monkeypatch.setattr(torch.hub, "urlopen", lambda *a, **k: pytest.fail("network used"))
    small = functools.partial(SwinTransformer3d, patch_size=[2, 4, 4], embed_dim=8, depths=[1, 1],
                              num_heads=[1, 1], window_size=[2, 2, 2])
    entry = dataclasses.replace(models._REGISTRY["swin3d_t"], builder=small)
    monkeypatch.setitem(models._REGISTRY, "swin3d_t", entry)
    (tmp_path / "checkpoints").mkdir()
    source = small(num_classes=400)
    torch.save(source.state_dict(), tmp_path / "checkpoints" / entry.kinetics.url.rsplit("/", 1)[-1])
    # check_hash compares the file name's hash prefix with the file: skip that check only.
    monkeypatch.setattr(type(entry.kinetics), "get_state_dict",
                        lambda self, **kw: torch.hub.load_state_dict_from_url(self.url, progress=False))
    model = build_model("swin3d_t", weights="kinetics")
    assert classifier(model).out_features == 2
    assert torch.equal(model.patch_embed.proj.weight, source.patch_embed.proj.weight)


# --- freezing and memory format ---------------------------------------------------------------

class _Wrapper(nn.Module):
    """Stands in for DistributedDataParallel: the model under `.module`."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


def test_freeze_backbone_keeps_head_trainable():
    model = build_model("tiny")
    wrapped = _Wrapper(model)
    head = {id(p) for p in head_parameters(wrapped)}
    assert head == {id(classifier(model).weight), id(classifier(model).bias)}
    set_backbone_trainable(wrapped, False)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable == head
    model(_clips(2)).sum().backward()
    assert model.conv_proj.weight.grad is None and classifier(model).weight.grad is not None
    set_backbone_trainable(wrapped, True)
    assert all(p.requires_grad for p in model.parameters())


def test_channels_last_model_and_input():
    conv = prepare_model_memory_format(nn.Conv3d(3, 4, 3), channels_last=True)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last_3d)
    transform = prepare_input_transform(nn.Identity(), channels_last=True)
    x = torch.randn(2, 3, 4, 8, 8)
    y = transform(x)
    assert y.is_contiguous(memory_format=torch.channels_last_3d) and torch.equal(x, y)
    plain = nn.Identity()
    assert prepare_input_transform(plain, channels_last=False) is plain


# --- untrusted files: torch.load(weights_only=True) runs no code -----------------------------

class _Payload:
    """Unpickling this calls `fn(*args)`: what a malicious .pth does (here, it creates a marker)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _malicious_files(tmp_path):
    """(path, marker, refused) triples: files whose loading without weights_only would create
    `marker`; `refused`: the safe loader names the forbidden callable (else it reads as damaged)."""
    out = []
    # a zip-format torch file that looks like a state dict, the payload next to the tensors
    m1 = tmp_path / "marker-system"
    torch.save({"weight": torch.zeros(2), "bias": _Payload(os.system, f"touch {shlex.quote(str(m1))}")},
               tmp_path / "system.pth")
    out.append((tmp_path / "system.pth", m1, True))
    # plain (legacy-format) pickle files: protocol 2 (torch's), and 4, whose framing the safe
    # loader rejects before it gets to the payload
    for protocol in (2, 4):
        marker = tmp_path / f"marker-exec-{protocol}"
        with open(tmp_path / f"exec-{protocol}.pth", "wb") as f:
            pickle.dump({"model": _Payload(exec, f"open({str(marker)!r}, 'w').close()")}, f,
                        protocol=protocol)
        out.append((tmp_path / f"exec-{protocol}.pth", marker, protocol == 2))
    # a vidtune checkpoint folder (--weights accepts one) holding a payload
    m3 = tmp_path / "marker-ckpt"
    (tmp_path / "ckpt").mkdir()
    torch.save({"format": "vidtune-checkpoint", "model": {"w": torch.zeros(1)},
                "metrics": _Payload(os.mkdir, str(m3))}, tmp_path / "ckpt" / "checkpoint.pt")
    out.append((tmp_path / "ckpt", m3, True))
    return out


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4:UserWarning")
def test_a_malicious_weights_file_is_refused_and_runs_no_code(tmp_path):
    for path, marker, refused in _malicious_files(tmp_path):
        with pytest.raises(WeightsError) as info:
            build_model("tiny", weights=str(path))
        msg = str(info.value)
        # "weights_only=False": torch's advice, not passed on
        assert msg.startswith(f"weights file {path}") and "weights_only=False" not in msg
        if refused:
            assert "refused: it holds Python objects other than tensors and plain data (" in msg
            assert "could run code" in msg and re.search(
                r"plain data \((posix\.system|exec|posix\.mkdir)\)", msg)
        else:
            assert msg.endswith("is not a loadable PyTorch state dict: Unsupported operand 149")
        assert not marker.exists(), f"loading {path} ran its payload"
        # The payload is live: an unsafe load would have run it.
        file = path / "checkpoint.pt" if path.is_dir() else path
        if zipfile.is_zipfile(file):
            torch.load(file, weights_only=False)
        else:
            pickle.loads(file.read_bytes())
        assert marker.exists()


def test_a_malicious_file_in_the_hub_cache_is_refused_for_kinetics(monkeypatch, tmp_path):
    """`--weights kinetics` reads torch hub's cached file, whose hash is checked on download only
    (and the offline message invites copying a file there): it is loaded with weights_only too."""
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    monkeypatch.setattr(torch.hub, "urlopen", lambda *a, **k: pytest.fail("network used"))
    url = models._REGISTRY["mvit_v2_s"].kinetics.url
    cached = tmp_path / "hub" / "checkpoints" / url.rsplit("/", 1)[-1]
    cached.parent.mkdir(parents=True)
    marker = tmp_path / "marker"
    torch.save({"head.1.weight": _Payload(os.system, f"touch {shlex.quote(str(marker))}")}, cached)
    with pytest.raises(WeightsError, match=rf"Kinetics-400 weights file {cached} refused: .*delete it"):
        build_model("mvit_v2_s", weights="kinetics")
    assert not marker.exists()
