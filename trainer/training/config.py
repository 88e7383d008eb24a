"""Typed configuration of one training run (a trial). Turned into a dict only at the Ray boundary:
`TorchTrainer(train_loop_config=cfg.to_dict())`, and back with `TrainConfig.from_dict`.

Each field is declared once with its flag, help and bounds (`vidtune.flags.option`); both
`vidtune train` and `vidtune search` generate their training flags from it, so
every training option is reachable from the search under the same flag name.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from vidtune.datasets.config import DataConfig
from vidtune.flags import option

PRECISIONS = ("auto", "fp32", "fp16", "bf16")
# hf: models' attention (transformers' attn_implementation): PyTorch's fused kernel, or plain matmuls.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
# Beside `to_dict()`'s keys in a worker's train_loop_config: the driver's datasets.index.VideoIndex.
INDEX_CONFIG_KEY = "video_index"
MODEL_CHOICES_HELP = ("tiny, tiny_deep (CPU), mvit_v2_s, mvit_v1_b, swin3d_t, swin3d_s, swin3d_b, a "
                      "Hugging Face video classifier (VideoMAE, TimeSformer, ViViT): hf:HUB_ID or "
                      "hf:/path/to/folder, or your own: package.module:function or path/to/file.py:function "
                      "(a factory with an input spec, docs/own-model.md)")


@dataclass(frozen=True)
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: str = option("tiny", flag="--model", metavar="NAME", help=f"model: {MODEL_CHOICES_HELP}")
    weights_cache: str | None = option(None, flag="--weights-cache", metavar="PATH",
                                       help="folder the driver downloads hf: hub checkpoints into and "
                                       "every worker loads them from (the Hugging Face hub cache, "
                                       "HF_HUB_CACHE): on a cluster, one every node sees (default: "
                                       "HF_HUB_CACHE, else $HF_HOME/hub)")
    weights: str = option("none", flag="--weights", metavar="W",
                          help="none (random init; an hf: model keeps its checkpoint's weights), kinetics "
                          "(torchvision's pretrained), or a state-dict / vidtune checkpoint file")
    epochs: int = option(3, flag="--epochs", metavar="N", ge=1,
                         help="training epochs (per trial in a search)")
    batch_size: int = option(8, flag="--batch-size", metavar="B", ge=1,
                             help="clips per optimizer step, per worker")
    lr: float = option(3e-4, flag="--lr", metavar="LR", gt=0, help="AdamW peak learning rate (after warmup)")
    weight_decay: float = option(0.05, flag="--weight-decay", metavar="WD", ge=0,
                                 help="AdamW weight decay (in a search: its value when not searched)")
    warmup_frac: float = option(0.1, flag="--warmup-frac", metavar="F", ge=0, lt=1,
                                help="share of all optimizer steps spent in linear warmup")
    label_smoothing: float = option(0.0, flag="--label-smoothing", metavar="S", ge=0, lt=1,
                                    help="cross-entropy label smoothing")
    grad_accum_steps: int = option(1, flag="--grad-accum", metavar="N", ge=1,
                                   help="batches accumulated per optimizer step (effective batch = batch "
                                   "size x this x workers)")
    clip_grad_norm: float = option(1.0, flag="--clip-grad-norm", metavar="N", ge=0,
                                   help="gradient norm limit, applied after unscaling (0 disables)")
    precision: str = option("auto", flag="--precision", choices=PRECISIONS,
                            help="autocast precision; auto = bf16 on recent GPUs, fp16 on older ones, fp32 "
                            "on CPU (default auto)")
    channels_last: bool = option(False, flag="--channels-last",
                                 help="channels_last_3d memory format (faster convolutions on CUDA)")
    compile: bool = option(False, flag="--compile", help="torch.compile the model (slow first steps)")
    gradient_checkpointing: bool = option(False, flag="--gradient-checkpointing",
                                          help="hf: models: recompute each layer's activations in the "
                                          "backward pass instead of keeping them (far less memory, so a "
                                          "larger batch fits; each step runs the forward pass twice)")
    attn_implementation: str = option("sdpa", flag="--attn-implementation", choices=ATTN_IMPLEMENTATIONS,
                                      help="hf: models: attention kernel, sdpa (PyTorch's fused "
                                      "scaled_dot_product_attention) or eager; a model without sdpa "
                                      "(TimeSformer) trains with eager and says so (default sdpa)")
    cpu_threads: int | None = option(None, flag="--cpu-threads", metavar="N", ge=1,
                                     help="torch threads per worker (default: training on the CPU, the "
                                     "node's cores shared by its workers while the trial trains; else the "
                                     "CPUs Ray reserved per worker)")
    freeze_backbone_epochs: int = option(0, flag="--freeze-backbone-epochs", metavar="N", ge=0,
                                         help="train only the classification head for the first N epochs")
    max_failures: int = option(1, flag="--max-failures", metavar="N", ge=0,
                               help="times a run restarts from its last checkpoint after a worker dies "
                               "(Ray Train's FailureConfig), and times a search reruns a trial whose node "
                               "was lost (Tune's); a trial's own error, out of memory or a full disk is "
                               "never retried")
    # How long a rank of a multi-worker run waits in a collective (all-reduce, broadcast) before
    # its run fails. NCCL's own default, 30 minutes, is how long the other ranks hang when one
    # fails mid-step (out of memory inside DDP's backward, a lost node). 10 minutes stays far
    # above the ranks' honest skew (a first step's cudnn.benchmark or torch.compile, the
    # validation tail, a cache-filling first epoch: seconds to a few minutes).
    collective_timeout_min: float = option(10.0, flag="--collective-timeout-min", metavar="MIN", gt=0,
                                           help="runs of several workers: minutes a worker waits for the "
                                           "others in a collective (all-reduce) before the run fails; NCCL's "
                                           "own default is 30 (default 10)")
    seed: int = option(0, flag="--seed", metavar="N", help="seed of training (init, shuffling, augmentation) "
                       "and of a search's Optuna sampler")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown training option(s) {sorted(unknown)}; known: {sorted(known)}")
        data = d.pop("data", {})
        data = data if isinstance(data, DataConfig) else DataConfig.from_dict(data)
        return cls(data=data, **d)

    def with_overrides(self, **changes: Any) -> TrainConfig:
        return replace(self, **changes)
