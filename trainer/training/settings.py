"""What a Train worker actually trained with, read back from torch in the worker's own process.

The configuration says what was asked (`--precision auto`); only the worker knows what that
became on its device (bf16 on an A100, fp16 with a gradient scaler on a T4), which TF32 and
cuDNN autotuning flags torch ended up with, and which GPU, driver and CUDA build it ran on. A
check in another process (`make gpu-check`'s own) proves nothing about the workers. Each worker
reads these once it holds its device (`worker_settings`); the ranks' views are merged
(`merge_settings`) and reported with every epoch, and the search puts them on the trial's MLflow
run as tags (`tune.tracking.runs.setting_tags`).
"""
from __future__ import annotations

import platform
from pathlib import Path

import torch
from torch import nn

from vidtune.trainer.models.registry import unwrap
from vidtune.trainer.training.gpus import nvml
from vidtune.trainer.training.precision import PrecisionPolicy
from vidtune.trainer.training.report_keys import SETTING_KEYS, Key


def worker_settings(device: torch.device, policy: PrecisionPolicy,
                    model: nn.Module | None = None) -> dict[str, str]:
    """This worker's settings as torch has them now (call it after `configure_backends`, once the
    worker holds its device: on a GPU, naming it makes a CUDA context):

    - precision_used: the autocast dtype the run trains in (bf16 | fp16 | fp32), "+scaler" with
      fp16's gradient scaler;
    - tf32: torch's float32 precision on CUDA for matmuls and cuDNN convolutions, both named
      ("matmul=tf32,conv=tf32"; `ieee` where TF32 is off), "-" on the CPU;
    - cudnn_benchmark: "on" | "off" on CUDA, "-" on the CPU;
    - device_name: the GPU's name, or the CPU's model name;
    - compute_capability: "8.6"; "" on the CPU;
    - cuda_version: the CUDA version torch was built for, "" on the CPU (a CUDA build of torch
      training on the CPU used none, so its run is not tagged with one);
    - driver_version: the NVIDIA driver's version (NVML), "" without one;
    - torch_version;
    - attn_implementation: the attention `model` (an hf: one) runs, sdpa or eager; "" for other
      models, or without `model`;
    - gradient_checkpointing: "on" | "off", as the model has it.
    """
    cuda = device.type == "cuda"
    precision = policy.name + ("+scaler" if policy.use_scaler else "")
    attention, checkpointing = training_options(model) if model is not None else ("", False)
    # Plain str each: they go into checkpoints too, which load with weights_only=True, and
    # torch.__version__ is a str subclass (TorchVersion) that such a load refuses.
    return {key: str(value) for key, value in {
        Key.PRECISION_USED: precision,
        Key.TF32: tf32_setting() if cuda else "-",
        Key.CUDNN_BENCHMARK: ("on" if torch.backends.cudnn.benchmark else "off") if cuda else "-",
        Key.DEVICE_NAME: torch.cuda.get_device_name(device) if cuda else cpu_name(),
        Key.COMPUTE_CAPABILITY: ".".join(map(str, torch.cuda.get_device_capability(device))) if cuda else "",
        Key.CUDA_VERSION: (torch.version.cuda or "") if cuda else "",
        Key.DRIVER_VERSION: nvidia_driver_version() if cuda else "",
        Key.TORCH_VERSION: torch.__version__,
        Key.ATTN_IMPLEMENTATION: attention,
        Key.GRADIENT_CHECKPOINTING: "on" if checkpointing else "off",
    }.items()}


def tf32_setting() -> str:
    """The float32 precision of CUDA matmuls and cuDNN convolutions: "matmul=tf32,conv=tf32"."""
    return (f"matmul={torch.backends.cuda.matmul.fp32_precision},"
            f"conv={torch.backends.cudnn.conv.fp32_precision}")


def merge_settings(views: list[dict[str, str]]) -> dict[str, str]:
    """One value per key for a run of several workers: the distinct values in rank order, joined
    by ", " (workers on two GPU models say both)."""
    merged = {}
    for key in SETTING_KEYS:
        values = list(dict.fromkeys(view.get(key, "") for view in views))
        merged[key] = ", ".join(v for v in values if v) if len(values) > 1 else values[0] if values else ""
    return merged


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def nvidia_driver_version() -> str:
    """The NVIDIA driver's version through NVML (`trainer.training.gpus.nvml`; it makes no CUDA context),
    "" when NVML cannot be asked."""
    with nvml() as lib:
        if lib is None:
            return ""
        try:
            version = lib.nvmlSystemGetDriverVersion()
        except Exception:      # an NVML error: say nothing rather than guess
            return ""
    return version.decode() if isinstance(version, bytes) else str(version)


def training_options(model: nn.Module) -> tuple[str, bool]:
    """(attention implementation, gradient checkpointing) `model` trains with, as the model says:
    ("", False) for a model without that choice."""
    plain = unwrap(model)
    if not hasattr(plain, "use_training_options"):
        return "", False
    return plain.attn_implementation(), plain.gradient_checkpointing()
