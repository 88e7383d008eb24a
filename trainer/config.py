"""Typed configuration of one training run (a trial). Turned into a dict only at the Ray boundary:
`TorchTrainer(train_loop_config=cfg.to_dict())`, and back with `TrainConfig.from_dict`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from datasets.config import DataConfig


@dataclass(frozen=True)
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: str = "tiny"                 # registry name: tiny | mvit_v2_s | mvit_v1_b | swin3d_t | swin3d_s | swin3d_b
    weights: str = "none"               # none | kinetics | path to a local state dict
    epochs: int = 3
    batch_size: int = 8                 # per optimizer step, per worker
    lr: float = 3e-4                    # AdamW peak learning rate (after warmup)
    weight_decay: float = 0.05
    warmup_frac: float = 0.1            # share of all optimizer steps spent in linear warmup
    label_smoothing: float = 0.0
    grad_accum_steps: int = 1           # effective batch = batch_size * grad_accum_steps * workers
    clip_grad_norm: float = 1.0         # 0 disables; applied after scaler.unscale_
    precision: str = "auto"             # auto | fp32 | fp16 | bf16
    channels_last: bool = False         # channels_last_3d memory format (CUDA)
    compile: bool = False               # torch.compile the model
    freeze_backbone_epochs: int = 0     # train only the head for the first N epochs
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        d = dict(d)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown training option(s) {sorted(unknown)}; known: {sorted(known)}")
        data = d.pop("data", {})
        data = data if isinstance(data, DataConfig) else DataConfig.from_dict(data)
        return cls(data=data, **d)

    def with_overrides(self, **changes: Any) -> "TrainConfig":
        return replace(self, **changes)
