"""Model registry: torchvision video transformers, a `tiny` MViT for the CPU, Hugging Face video
classifiers (`hf:HUB_ID`, `trainer.models.hf_models`) and your own (`module:function`,
`trainer.models.own_models`).

Every model takes `float B x C x T x H x W` (C = 3, normalised with its spec's mean/std) and
returns `B x num_classes` logits. Weights are `none` (random init), `kinetics` (torchvision's
Kinetics-400 checkpoint, downloaded into the torch hub cache) or a path to a local state dict;
the classification head is replaced for `num_classes` after loading. An `hf:` model brings its
own weights, input size and normalisation from its checkpoint (`--weights none` keeps them).
"""
from __future__ import annotations

import functools
import pickle
import re
import socket
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchvision.models import video as tvv
from torchvision.models.video.mvit import MSBlockConfig, MViT

from vidtune.trainer.models import own_models

KINETICS_MEAN = (0.45, 0.45, 0.45)          # torchvision's MViT Kinetics-400 presets
KINETICS_STD = (0.225, 0.225, 0.225)
SWIN_MEAN = (0.485, 0.456, 0.406)           # torchvision's Swin3D Kinetics-400 presets
SWIN_STD = (0.229, 0.224, 0.225)

# A stalled connection (firewalled cluster node) must fail in seconds, not hang a trial.
DOWNLOAD_TIMEOUT_S = 15.0


class WeightsError(ValueError):
    """Weights that cannot be used: the message names the file or source and says what to do."""


def refused_pickle(e: BaseException) -> str | None:
    """What a `torch.load(weights_only=True)` refusal means, in a line; None for other errors.

    The file references a Python callable or class (`posix.system`, `builtins.exec`, a numpy
    type) that the safe loader does not allow: unpickling it could run any code, so vidtune
    never does. (torch's own message advises `weights_only=False`; that is not passed on.)"""
    if not _weights_only_failure(e):
        return None
    found = re.search(r"\bGLOBAL ([\w.]+)", str(e))
    if found is None:
        return None
    return (f"refused: it holds Python objects other than tensors and plain data ({found.group(1)}), "
            "and loading those could run code from the file; vidtune loads only tensors, numbers and "
            "strings (torch.load weights_only=True)")


def load_error_detail(e: BaseException) -> str:
    """The useful line of a `torch.load` error (for a safe-loader failure, its own reason only)."""
    if _weights_only_failure(e):
        for line in str(e).splitlines()[1:]:
            line = line.strip().removeprefix("WeightsUnpickler error:").strip()
            boilerplate = ("(1)", "(2)", "Check the documentation", "Please file an issue")
            if line and not line.startswith(boilerplate):
                return line.split(". Please use", 1)[0][:200]
    return f"{type(e).__name__}: {e}"


def _weights_only_failure(e: BaseException) -> bool:
    return isinstance(e, pickle.UnpicklingError) and str(e).startswith("Weights only load failed")


@dataclass(frozen=True)
class ModelSpec:
    """What a model expects as input: `num_frames x height x width` clips, RGB normalised as
    `(x / 255 - mean) / std`."""

    name: str
    num_frames: int
    height: int
    width: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


@dataclass(frozen=True)
class _Entry:
    spec: ModelSpec
    builder: Callable[..., nn.Module]           # builder(num_classes=...) -> nn.Module
    kinetics: Any | None                        # torchvision weights enum member, or None
    fixed_size: bool                            # MViT: positional embeddings sized for the spec only


def _build_tiny(num_classes: int = 2, last_blocks: int = 1) -> nn.Module:
    """~0.1M-parameter MViT-v2-style model for 8 x 64 x 64 clips: trains in seconds on a CPU.

    The patch embedding turns 8x64x64 into 4x16x16 tokens; three multiscale blocks pool the
    keys/values (cheap attention) and halve the spatial grid once, like mvit_v2_s in miniature.
    """
    blocks = [
        MSBlockConfig(1, 32, 32, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 4, 4]),
        MSBlockConfig(2, 32, 64, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 2, 2]),
        *[MSBlockConfig(2, 64, 64, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 2, 2]) for _ in range(last_blocks)],
    ]
    return MViT(spatial_size=(64, 64), temporal_size=8, block_setting=blocks, residual_pool=True,
                residual_with_cls_embed=False, rel_pos_embed=True, proj_after_attn=True, dropout=0.1,
                num_classes=num_classes)


def _build_tiny_deep(num_classes: int = 2) -> nn.Module:
    """`tiny` with two more blocks on the 4x8x8 grid (~0.24M parameters, about 1.5x its step time
    on a CPU): a second CPU model whose learning curves differ from tiny's, for the search-quality
    tables (BENCHMARKS.md "Search quality")."""
    return _build_tiny(num_classes, last_blocks=3)


_REGISTRY: dict[str, _Entry] = {
    "tiny": _Entry(ModelSpec("tiny", 8, 64, 64, KINETICS_MEAN, KINETICS_STD), _build_tiny, None, True),
    "tiny_deep": _Entry(ModelSpec("tiny_deep", 8, 64, 64, KINETICS_MEAN, KINETICS_STD), _build_tiny_deep,
                        None, True),
    "mvit_v2_s": _Entry(ModelSpec("mvit_v2_s", 16, 224, 224, KINETICS_MEAN, KINETICS_STD),
                        tvv.mvit_v2_s, tvv.MViT_V2_S_Weights.KINETICS400_V1, True),
    "mvit_v1_b": _Entry(ModelSpec("mvit_v1_b", 16, 224, 224, KINETICS_MEAN, KINETICS_STD),
                        tvv.mvit_v1_b, tvv.MViT_V1_B_Weights.KINETICS400_V1, True),
    "swin3d_t": _Entry(ModelSpec("swin3d_t", 16, 224, 224, SWIN_MEAN, SWIN_STD),
                       tvv.swin3d_t, tvv.Swin3D_T_Weights.KINETICS400_V1, False),
    "swin3d_s": _Entry(ModelSpec("swin3d_s", 16, 224, 224, SWIN_MEAN, SWIN_STD),
                       tvv.swin3d_s, tvv.Swin3D_S_Weights.KINETICS400_V1, False),
    "swin3d_b": _Entry(ModelSpec("swin3d_b", 16, 224, 224, SWIN_MEAN, SWIN_STD),
                       tvv.swin3d_b, tvv.Swin3D_B_Weights.KINETICS400_V1, False),
}

MODEL_NAMES: tuple[str, ...] = tuple(_REGISTRY)
HF_PREFIX = "hf:"       # --model hf:MCG-NJU/videomae-base, or hf:/path/to/a/save_pretrained/folder


def is_hf_model(name: str) -> bool:
    return name.startswith(HF_PREFIX)


def is_own_model(name: str) -> bool:
    return not is_hf_model(name) and own_models.is_factory_name(name)


def _entry(name: str) -> _Entry:
    if is_hf_model(name):
        return _hf_entry(name)
    if is_own_model(name):   # imported (once: sys.modules); OwnModelError is a ValueError
        factory, spec = own_models.load(name)
        return _Entry(ModelSpec(name, **spec), factory, kinetics=None, fixed_size=False)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}, "
                         f"{HF_PREFIX}HUB_ID / {HF_PREFIX}FOLDER for a Hugging Face video classifier, or "
                         f"package.module:function for your own (docs/own-model.md)") from None


@functools.lru_cache(maxsize=8)
def _hf_entry(name: str) -> _Entry:
    """The registry entry of Hugging Face model `name` (`hf:` + hub id or folder), read from its
    checkpoint, fetched into the hub cache on the first call (the driver's, before Ray starts).
    WeightsError naming the checkpoint and the cache when it cannot be had."""
    from vidtune.trainer.models import hf_models  # heavy (transformers, ~2 s): only for an hf: model

    source = name[len(HF_PREFIX):]
    try:
        folder = hf_models.local_checkpoint(source)
        s = hf_models.input_spec(folder, source)
    except hf_models.HFModelError as e:
        raise WeightsError(str(e)) from None
    return _Entry(ModelSpec(name, s.num_frames, s.height, s.width, s.mean, s.std),
                  functools.partial(hf_models.build, folder, source), None, True)


def get_spec(name: str) -> ModelSpec:
    """Input size and normalisation of model `name` (ValueError listing the known names)."""
    return _entry(name).spec


def check_input_size(name: str, num_frames: int, height: int, width: int) -> None:
    """ValueError when model `name` cannot take `num_frames x height x width` clips: the MViT
    models (and tiny) have positional embeddings for exactly their spec's size; Swin3D pads
    windows and takes any size."""
    entry = _entry(name)
    spec = entry.spec
    if entry.fixed_size and (num_frames, height, width) != (spec.num_frames, spec.height, spec.width):
        raise ValueError(
            f"model {name!r} takes clips of exactly {spec.num_frames} frames x {spec.height} x "
            f"{spec.width}, not {num_frames} x {height} x {width}; leave --num-frames/--height/--width "
            f"unset (or set them to that size), or use a swin3d_* model for other sizes")


def build_model(name: str, weights: str = "none", num_classes: int = 2) -> nn.Module:
    """Build model `name` with `weights` (`none`, `kinetics` or a state-dict path) and a fresh
    `num_classes`-way head (a local file whose head already has `num_classes` outputs keeps it,
    so a fine-tuned checkpoint loads as trained). Returns the model on the CPU, in train mode."""
    entry = _entry(name)
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if weights in ("", "none", None):
        return entry.builder(num_classes=num_classes)
    if weights == "kinetics":
        state = _kinetics_state_dict(name, entry)
        source = f"torchvision {entry.kinetics!r}"
    else:
        state = load_state_dict_file(weights)
        source = f"weights file {weights}"
    return _load_into_fresh_model(name, entry, state, source, num_classes)


def kinetics_file(name: str) -> Path:
    """Model `name`'s Kinetics-400 file in this machine's torch hub cache (there or not yet)."""
    if (weights := _entry(name).kinetics) is None:
        raise WeightsError(f"model {name!r} has no Kinetics weights")
    return Path(torch.hub.get_dir()) / "checkpoints" / weights.url.rsplit("/", 1)[-1]


def fetch_kinetics(name: str) -> Path:
    """`kinetics_file`, downloaded (hash checked) if absent: on the driver before Ray starts (and
    trainer.cluster.kinetics copies it to every node). WeightsError naming the file to fill when offline."""
    path = kinetics_file(name)
    if path.is_file():
        return path
    url, match = _entry(name).kinetics.url, torch.hub.HASH_REGEX.search(path.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = socket.getdefaulttimeout()   # process-wide: urllib in torch.hub takes no timeout
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:   # to a temporary file, renamed once whole
        torch.hub.download_url_to_file(url, str(path), hash_prefix=match.group(1) if match else None,
                                       progress=False)
    except (urllib.error.URLError, OSError, TimeoutError, RuntimeError) as e:
        raise WeightsError(f"could not download the Kinetics-400 weights of {name!r} from {url} ({e}). "
                           f"Offline? Download that file on a machine with internet and copy it to {path} "
                           f"(keep --weights kinetics), or pass it: --weights /path/to/{path.name}") from e
    finally:
        socket.setdefaulttimeout(previous)
    return path


def _kinetics_state_dict(name: str, entry: _Entry) -> dict[str, torch.Tensor]:
    if entry.kinetics is None and is_hf_model(name):
        raise WeightsError(f"model {name!r} loads its pretrained weights from its checkpoint; "
                           "leave --weights at none (or pass a state dict / vidtune checkpoint)")
    if entry.kinetics is None:
        raise WeightsError(
            f"model {name!r} has no pretrained weights; use --weights none, or pick one of "
            f"{', '.join(n for n in MODEL_NAMES if _REGISTRY[n].kinetics is not None)} for kinetics")
    # Downloaded here only on a node that joined after the search started. The file may be one a
    # user copied there: weights_only=True, which torch.hub does not default to.
    path = fetch_kinetics(name)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        reason = refused_pickle(e)
        if reason is None:
            raise
        raise WeightsError(f"Kinetics-400 weights file {path} {reason}; delete it to download the "
                           f"real one, or pass a state dict you trust with --weights PATH") from None


_WRAPPER_KEYS = ("model", "state_dict", "model_state_dict", "module")
_KEY_PREFIXES = ("module.", "_orig_mod.")    # DistributedDataParallel, torch.compile
# torch.save writes a zip archive (PK..) since torch 1.6; before, a pickle (protocol opcode 0x80).
_TORCH_FILE_STARTS = (b"PK\x03\x04", b"\x80")


def _file_start(path: Path, n: int = 64) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError as e:
        raise WeightsError(f"weights file {path} cannot be read ({e.strerror or e})") from None


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a `.pth`/`.pt` state dict at `path`, loaded with `weights_only=True` (no code
    runs). Accepts a plain state dict, one wrapped as {"model": ...} / {"state_dict": ...} (a
    vidtune checkpoint file, or its folder), and keys prefixed by DDP (`module.`) or
    torch.compile (`_orig_mod.`)."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / "checkpoint.pt").is_file():   # a vidtune / Ray checkpoint folder
        p = p / "checkpoint.pt"
    if not p.is_file():
        raise WeightsError(
            f"weights file {path} not found; pass --weights none, kinetics, or the path of a "
            f"saved state dict (.pth)")
    head = _file_start(p)
    if not head.startswith(_TORCH_FILE_STARTS):
        shown = head.split(b"\n")[0][:24].decode("utf-8", "replace")
        kind = ("it is empty" if not head else f"it starts with {shown!r}" if shown.isprintable() and shown
                else "it is neither a zip archive nor a pickle")
        raise WeightsError(f"weights file {p} is not a PyTorch checkpoint ({kind}); pass a file written by "
                           "torch.save(model.state_dict(), path), a vidtune checkpoint, or --weights none / "
                           "kinetics")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
        reason = refused_pickle(e)
        if reason is not None:
            raise WeightsError(f"weights file {p} {reason}; save the weights with "
                               f"torch.save(model.state_dict(), path)") from None
        raise WeightsError(f"weights file {p} is not a loadable PyTorch state dict: "
                           f"{load_error_detail(e)}") from e
    for key in _WRAPPER_KEYS:
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(
            f"weights file {p} does not hold a state dict (a dict of parameter name -> tensor); "
            f"save one with torch.save(model.state_dict(), path)")
    state = {}
    for k, v in obj.items():
        for prefix in _KEY_PREFIXES:
            while k.startswith(prefix):
                k = k[len(prefix):]
        state[k] = v
    return state


def _load_into_fresh_model(name: str, entry: _Entry, state: dict[str, torch.Tensor], source: str,
                           num_classes: int) -> nn.Module:
    probe = entry.builder(num_classes=num_classes)
    head_name = _classifier_name(probe, missing_ok=True)   # an own model's may have no nn.Linear
    head_weight = state.get(f"{head_name}.weight")
    saved_classes = head_weight.shape[0] if head_weight is not None and head_weight.dim() == 2 else None
    model = probe if saved_classes in (None, num_classes) else entry.builder(num_classes=saved_classes)
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatch: another architecture or size
        raise WeightsError(
            f"{source} does not fit model {name!r} (different architecture or size?): "
            f"{_first_lines(str(e))}") from e
    head_keys = {f"{head_name}.weight", f"{head_name}.bias"}
    missing = [k for k in result.missing_keys if k not in head_keys]
    if missing or result.unexpected_keys:
        raise WeightsError(
            f"{source} does not fit model {name!r}: {len(missing)} missing key(s) "
            f"{missing[:5]}, {len(result.unexpected_keys)} unexpected key(s) "
            f"{result.unexpected_keys[:5]}; was it saved from another model?")
    if head_name and saved_classes != num_classes:
        replace_head(model, num_classes)
    return model


def _first_lines(text: str, n: int = 4) -> str:
    lines = text.strip().splitlines()
    return " ".join(s.strip() for s in lines[:n]) + (" ..." if len(lines) > n else "")


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DistributedDataParallel and/or torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return model


def _classifier_name(model: nn.Module, missing_ok: bool = False) -> str:
    """Dotted name of the final nn.Linear: `head` (Swin3D), `head.1` (MViT), the model's own
    `classifier_name` (`hf.classifier`: trainer.models.hf_models.HFVideoClassifier), else (an own model)
    its last nn.Linear; TypeError, or "" when `missing_ok`, for a model with none."""
    named = getattr(model, "classifier_name", None)
    if isinstance(named, str):
        return named
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        return "head"
    if isinstance(head, nn.Sequential) and isinstance(head[-1], nn.Linear):
        return f"head.{len(head) - 1}"
    if (linears := [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]) or missing_ok:
        return linears[-1] if linears else ""
    raise TypeError(f"{type(model).__name__} has no `head` ending in nn.Linear, and no nn.Linear at all")


def classifier(model: nn.Module) -> nn.Linear:
    """The final nn.Linear of a registry model (also through DDP / torch.compile wrappers)."""
    inner = unwrap(model)
    return inner.get_submodule(_classifier_name(inner))


def replace_head(model: nn.Module, num_classes: int) -> nn.Linear:
    """Swap the final Linear for a freshly initialised `num_classes`-way one (same dtype/device)."""
    inner = unwrap(model)
    name = _classifier_name(inner)
    old = inner.get_submodule(name)
    new = nn.Linear(old.in_features, num_classes, device=old.weight.device, dtype=old.weight.dtype)
    nn.init.trunc_normal_(new.weight, std=0.02)   # torchvision's own head init for these models
    nn.init.zeros_(new.bias)
    parent_name, _, child = name.rpartition(".")
    setattr(inner.get_submodule(parent_name) if parent_name else inner, child, new)
    return new


def head_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of the classification head (the part trained while the backbone is frozen)."""
    return list(classifier(model).parameters())


def set_backbone_trainable(model: nn.Module, trainable: bool) -> None:
    """Freeze (False) or unfreeze (True) everything but the head; the head always trains.

    Under DistributedDataParallel, frozen parameters produce no gradient: wrap with
    `find_unused_parameters=True`, or freeze before wrapping and re-wrap after unfreezing.
    """
    head = {id(p) for p in head_parameters(model)}
    for p in unwrap(model).parameters():
        p.requires_grad_(trainable or id(p) in head)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


class ChannelsLast3d(nn.Module):
    """`B x C x T x H x W` float -> same values in channels_last_3d memory layout, which the
    cuDNN Conv3d kernels of the patch embedding run faster on (tensor cores)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last_3d)


def prepare_model_memory_format(model: nn.Module, channels_last: bool) -> nn.Module:
    """Model's Conv3d layers in channels_last_3d layout when asked (in place; returns the model): the
    layout is for 5-D tensors only, `model.to` raises on any 4-D weight (a Conv2d patch embedding)."""
    for conv in (m for m in model.modules() if channels_last and isinstance(m, nn.Conv3d)):
        conv.to(memory_format=torch.channels_last_3d)
    return model


def prepare_input_transform(transform: nn.Module, channels_last: bool) -> nn.Module:
    """The clip transform, followed by a channels_last_3d conversion when asked, so the
    training loop has no memory-format branch."""
    return nn.Sequential(transform, ChannelsLast3d()) if channels_last else transform


def maybe_compile(model: nn.Module, enabled: bool, **kwargs: Any) -> nn.Module:
    """`torch.compile(model)` when enabled. The first steps are slow while it compiles, and a new
    input shape recompiles: keep batch and clip shapes fixed (drop_last)."""
    return torch.compile(model, **kwargs) if enabled else model


def has_kinetics_weights(name: str) -> bool:
    return _entry(name).kinetics is not None
