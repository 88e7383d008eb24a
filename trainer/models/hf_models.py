"""Hugging Face video classifiers (VideoMAE, TimeSformer, ViViT, ...) as vidtune models.

`--model hf:MCG-NJU/videomae-base` (a hub id) or `--model hf:/path/to/folder` (what
`save_pretrained` wrote). The checkpoint is resolved to a local folder once (`local_checkpoint`:
the hub cache is read first, so a filled cache, or `HF_HUB_OFFLINE=1`, needs no network), and
everything else reads that folder: the input size and frames per clip from its `config.json`, the
mean and std from its image processor (`preprocessor_config.json`), the weights with
`AutoModelForVideoClassification` and a fresh head.

This module imports transformers (about 2 s): `trainer.models.registry` imports it only for an `hf:` model,
so a search with a torchvision model never pays for it.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import torch
import transformers
from huggingface_hub import constants as hub_constants
from huggingface_hub import errors as hub_errors
from torch import nn
from transformers import AutoConfig, AutoImageProcessor, AutoModelForVideoClassification

# A checkpoint's weights: safetensors, or a PyTorch .bin that transformers loads with
# weights_only=True; sharded too.
WEIGHT_FILES = ("*.safetensors", "*.bin")
# Written by `save_pretrained(weights=False)`: this folder's weights are in the vidtune checkpoint
# beside it, so `build` may give the bare architecture. Any other folder without weights is refused.
WEIGHTS_ELSEWHERE = "vidtune_weights_elsewhere.txt"
# What a video classifier needs from a hub repository: config, image processor, weights.
CHECKPOINT_FILES = ("*.json", *WEIGHT_FILES)
# transformers' IMAGENET_DEFAULT_MEAN/STD: what its video processors default to, used when a
# folder has no preprocessor_config.json (a bare `model.save_pretrained`).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class HFModelError(ValueError):
    """A Hugging Face checkpoint that cannot be used; one line naming it and what to do."""


@dataclass(frozen=True)
class InputSpec:
    """A checkpoint's input: `num_frames x height x width` RGB clips normalised as
    `(x / 255 - mean) / std` (its image processor's rescale and normalisation in one)."""

    num_frames: int
    height: int
    width: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def is_folder(source: str) -> bool:
    """Whether `source` (the part after `hf:`) names a local folder rather than a hub id."""
    return source.startswith(("/", ".", "~")) or Path(source).expanduser().is_dir()


def cache_home() -> str:
    """Where hub checkpoints are cached: `HF_HUB_CACHE` as this process has it now (`--weights-cache`
    sets it, perhaps after huggingface_hub read it at import), else huggingface_hub's (`$HF_HOME/hub`)."""
    return os.environ.get("HF_HUB_CACHE") or hub_constants.HF_HUB_CACHE


def local_checkpoint(source: str) -> Path:
    """The local folder of checkpoint `source`: the folder itself, or the hub cache's snapshot
    of a hub id, downloaded on the first call only (config, image processor, weights). Raises
    HFModelError naming the source and the cache (`HF_HOME`) when it is neither."""
    if is_folder(source):
        folder = Path(source).expanduser()
        if not (folder / "config.json").is_file():
            raise HFModelError(f"Hugging Face model folder {folder} has no config.json; pass a folder "
                               "written by save_pretrained, or a hub id (hf:MCG-NJU/videomae-base)")
        check_weights(folder, source)
        return folder
    fetch = dict(allow_patterns=list(CHECKPOINT_FILES), cache_dir=cache_home())
    with contextlib.suppress(hub_errors.LocalEntryNotFoundError, ValueError):
        return Path(huggingface_hub.snapshot_download(source, local_files_only=True, **fetch))
    try:
        return Path(huggingface_hub.snapshot_download(source, **fetch))
    except Exception as e:  # noqa: BLE001 - network, auth, a malformed id: all end the same way
        raise HFModelError(_fetch_failure(source, e)) from None


def _fetch_failure(source: str, e: BaseException) -> str:
    where = (f"the cache {cache_home()} (--weights-cache, else HF_HUB_CACHE or "
             f"HF_HOME={os.environ.get('HF_HOME', hub_constants.HF_HOME)})")
    if isinstance(e, hub_errors.GatedRepoError):
        why = "it is gated: accept its terms on huggingface.co and log in (hf auth login, or HF_TOKEN)"
    elif isinstance(e, hub_errors.RepositoryNotFoundError):
        why = "no such repository, or a private one: check the id, or log in (hf auth login, or HF_TOKEN)"
    elif hub_constants.HF_HUB_OFFLINE or isinstance(e, hub_errors.LocalEntryNotFoundError):
        why = ("the hub cannot be reached (offline, or HF_HUB_OFFLINE=1): download it on a machine with "
               "a network and pass that cache with --weights-cache (or point HF_HOME at it), or pass "
               "hf:/path/to/folder")
    else:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return f"Hugging Face model {source!r} is not in {where} and could not be downloaded; {why}"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' load report and progress bars off: vidtune states what it loaded itself."""
    logging = transformers.utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _pair(value: int | list[int] | tuple[int, ...]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def input_spec(folder: Path, source: str) -> InputSpec:
    """Frames per clip and frame size from `folder`'s config (what its position embeddings are
    sized for), mean and std from its image processor, folded with the processor's rescale
    (`x * rescale_factor`, minus 1 with ViViT's `offset`) into vidtune's `(x / 255 - mean) / std`."""
    with _quiet():
        try:
            config = AutoConfig.from_pretrained(folder)
        except (OSError, ValueError, KeyError) as e:
            raise HFModelError(f"Hugging Face model {source!r}: its config cannot be read ({e})") from None
    num_frames, image_size = getattr(config, "num_frames", None), getattr(config, "image_size", None)
    if num_frames is None or image_size is None:
        raise HFModelError(f"Hugging Face model {source!r} ({config.model_type}) is not a video classifier "
                           "with a fixed clip size (its config has no num_frames / image_size); use "
                           "VideoMAE, TimeSformer or ViViT")
    height, width = _pair(image_size)
    mean, std, scale, offset = IMAGENET_MEAN, IMAGENET_STD, 1 / 255, 0.0
    if (folder / "preprocessor_config.json").is_file():
        with _quiet():
            processor = AutoImageProcessor.from_pretrained(folder)
        if getattr(processor, "do_normalize", True):
            mean, std = tuple(processor.image_mean), tuple(processor.image_std)
        else:
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        scale = processor.rescale_factor if getattr(processor, "do_rescale", True) else 1.0
        offset = 1.0 if getattr(processor, "offset", False) else 0.0
    # (x * scale - offset - m) / s == (x / 255 - (m + offset) / (255 scale)) / (s / (255 scale))
    k = 255 * scale
    return InputSpec(int(num_frames), height, width, tuple((m + offset) / k for m in mean),
                     tuple(s / k for s in std))


def class_labels(num_classes: int) -> dict[int, str]:
    """The head's label names in the saved config: vidtune's label 1 is the violent class."""
    if num_classes == 2:
        return {0: "non-violent", 1: "violent"}
    return {i: f"class_{i}" for i in range(num_classes)}


# Files of an image/video processor that `save_pretrained` output carries beside the model.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")


class HFVideoClassifier(nn.Module):
    """A transformers video classifier behind vidtune's model interface: float
    `B x C x T x H x W` in, `B x num_classes` logits out (transformers takes `pixel_values`
    `B x T x C x H x W` and returns an output object). `classifier_name` names the head for
    `trainer.models.registry` (backbone freezing, head replacement); `checkpoint` is the folder it was
    built from (its image processor's)."""

    classifier_name = "hf.classifier"

    def __init__(self, hf: nn.Module, checkpoint: Path):
        super().__init__()
        self.hf = hf
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(pixel_values=x.transpose(1, 2)).logits

    def use_training_options(self, *, attn_implementation: str, gradient_checkpointing: bool) -> str | None:
        """Train with `attn_implementation` (sdpa | eager) where the model class has it, else
        with what it has (TimeSformer: eager only), and with gradient checkpointing on or off
        (transformers' `activation_checkpointing_enable`, 5.x's name for gradient checkpointing;
        non-reentrant, which works under DDP with
        frozen parameters and under autocast). Returns the line saying the attention differs
        from what was asked, or None."""
        with _quiet():   # transformers warns in its own words; the returned line says it once
            try:
                self.hf.set_attn_implementation(attn_implementation)
            except (ValueError, ImportError):   # this class (or this torch) has no such kernel
                pass
        if gradient_checkpointing:
            self.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif self.hf.is_activation_checkpointing:
            self.hf.activation_checkpointing_disable()
        used = self.attn_implementation()
        if used == attn_implementation:
            return None
        return (f"{type(self.hf).__name__} has no {attn_implementation} attention (transformers "
                f"{transformers.__version__}): it trains with {used} attention (--attn-implementation)")

    def attn_implementation(self) -> str:
        """The attention implementation the model runs (transformers keeps it in its config)."""
        return str(self.hf.config._attn_implementation)

    def gradient_checkpointing(self) -> bool:
        return bool(self.hf.is_activation_checkpointing)

    def save_pretrained(self, folder: str | Path, *, weights: bool = True) -> Path:
        """The model as transformers writes it, for use outside vidtune: its config (with the
        head's labels), its checkpoint's image processor and, unless `weights` is False, its
        weights (without them the folder builds the architecture, `build`, and vidtune's MLflow
        model loads its trained weights from its own checkpoint)."""
        out = Path(folder)
        if weights:
            self.hf.save_pretrained(out)
        else:
            self.hf.config.save_pretrained(out)
            (out / WEIGHTS_ELSEWHERE).write_text("The trained weights are in the vidtune checkpoint beside "
                                                 "this folder (checkpoint.pt), not here.\n")
        for file in PROCESSOR_FILES:
            if (self.checkpoint / file).is_file():
                (out / file).write_bytes((self.checkpoint / file).read_bytes())
        return out


def check_weights(folder: Path, source: str) -> None:
    """HFModelError naming `folder` when it has no weights and is not vidtune's own weightless copy
    (`WEIGHTS_ELSEWHERE`): fine-tuning random weights unawares is worse than one line."""
    if not has_weights(folder) and not (folder / WEIGHTS_ELSEWHERE).is_file():
        raise HFModelError(f"Hugging Face model {source!r}: the folder {folder} has a config.json but no "
                           "weights (model.safetensors or pytorch_model.bin); pass the folder that "
                           "model.save_pretrained() wrote, or a hub id")


def has_weights(folder: Path) -> bool:
    return any(any(folder.glob(pattern)) for pattern in WEIGHT_FILES)


def build(folder: Path, source: str, num_classes: int = 2) -> HFVideoClassifier:
    """The checkpoint in `folder` with a freshly initialised `num_classes`-way head (kept when
    the checkpoint's head already has that many outputs), float32 on the CPU, in train mode. A
    folder that `HFVideoClassifier.save_pretrained(weights=False)` wrote gives its architecture
    randomly initialised, for a caller that loads trained weights; any other folder without
    weights is refused (HFModelError), rather than fine-tuned from random weights unawares."""
    weighted = has_weights(folder)
    check_weights(folder, source)
    labels = class_labels(num_classes)
    label_names = dict(id2label=labels, label2id={v: k for k, v in labels.items()})
    with _quiet():
        try:
            if weighted:
                hf = AutoModelForVideoClassification.from_pretrained(
                    folder, ignore_mismatched_sizes=True, dtype=torch.float32, **label_names)
            else:
                hf = AutoModelForVideoClassification.from_config(
                    AutoConfig.from_pretrained(folder, **label_names), dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise HFModelError(f"Hugging Face model {source!r} cannot be loaded as a video classifier: "
                               f"{str(e).splitlines()[0][:300]}") from None
    if not isinstance(getattr(hf, "classifier", None), nn.Linear):
        raise HFModelError(f"Hugging Face model {source!r} ({type(hf).__name__}) has no nn.Linear "
                           "`classifier` head")
    return HFVideoClassifier(hf, folder).train()


def export_pretrained(weights: dict[str, torch.Tensor], source: str, folder: str | Path) -> Path:
    """Write the trained model `weights` (a vidtune checkpoint's `model` state dict) of checkpoint
    `source` (the part after `hf:`) as `save_pretrained` does into `folder`: config with the
    head's labels, weights, and the source's image processor, so that
    `AutoModelForVideoClassification.from_pretrained(folder)` loads it outside vidtune."""
    head = weights[f"{HFVideoClassifier.classifier_name}.weight"]
    model = build(local_checkpoint(source), source, num_classes=head.shape[0])
    model.load_state_dict(weights)
    return model.save_pretrained(folder)
