"""gpu_precision's MFU inputs: one forward's FLOPs per clip (counted with FlopCounterMode) and the
device's peak dense FLOP/s per precision (`PEAK_TFLOPS`, or --peak-tflops)."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from vidtune.trainer.training import precision as prec

# Peak dense (no sparsity) tensor-core TFLOP/s from NVIDIA's datasheets, per autocast precision;
# "tf32" is what fp32 rows use (TF32 on), "fp32" the plain CUDA-core rate. Matched as a substring
# of torch.cuda.get_device_name(), longest key first ("H200 NVL" before "H200", "H100 PCIe"
# before "H100"). The NVL (PCIe) cards run at a lower clock and power than the SXM ones: their
# datasheets give 1,671 bf16 TFLOP/s with sparsity, so 835 dense, against the SXM's 989.
PEAK_TFLOPS = {
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
}


def forward_flops_per_clip(model_cpu: torch.nn.Module, spec: Any, device: torch.device) -> float:
    """FLOPs of one forward of one clip (matmuls, convolutions, attention; FlopCounterMode)."""
    model = copy.deepcopy(model_cpu).to(device).eval()
    x = torch.zeros(1, 3, spec.num_frames, spec.height, spec.width, device=device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    del model, x
    prec.free_memory(device)
    return float(counter.get_total_flops())


def peak_flops(device: torch.device, precision: str,
               override_tflops: float | None) -> tuple[float | None, str]:
    """(peak FLOP/s for `precision` rows, where it came from); None when unknown (MFU not shown)."""
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    if not prec.is_cuda(device):
        return None, "no peak for a CPU (pass --peak-tflops)"
    name = torch.cuda.get_device_name(device)
    key = next((k for k in sorted(PEAK_TFLOPS, key=len, reverse=True) if k in name), None)
    if key is None:
        return None, f"{name} not in PEAK_TFLOPS (pass --peak-tflops)"
    kind = "tf32" if precision == "fp32" else precision
    return PEAK_TFLOPS[key][kind] * 1e12, f"PEAK_TFLOPS[{key!r}][{kind!r}]"
