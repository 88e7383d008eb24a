"""The one place that decides numeric precision and device backend flags.

`choose_precision` runs once per worker, and `trial_precision` makes the ranks of a run agree
(and a resumed run keep its checkpoint's); the loop then uses `policy.autocast()` and
`policy.make_scaler()` with no precision branches: a disabled GradScaler is a no-op, and
autocast is disabled for fp32. This is also the only module that names the CUDA device type;
others ask it (`is_cuda`, `synchronize`, `peak_allocated_mb`, ...).

Choices (`auto | fp32 | fp16 | bf16`):
- auto: CUDA compute capability >= 8.0 (A100, H100, RTX 30xx+) -> bf16 autocast, no scaler;
  older CUDA GPUs (T4) -> fp16 autocast + GradScaler; CPU and other devices -> fp32
  (bf16 autocast on a CPU is often slower; measured 28 vs 32 clips/s for tiny on 2 cores).
- bf16 forced on CUDA below 8.0 -> error (no native bf16 there; cuBLAS would emulate it slowly).
- fp16 forced on the CPU -> honoured: CPU fp16 autocast and `GradScaler("cpu")` both exist in
  torch >= 2.3 and are numerically correct, so a CPU run exercises the same scaler path as an
  old GPU; it is slow on CPUs without native fp16 arithmetic, which is why auto never picks it.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vidtune.trainer.training.config import PRECISIONS  # one list, beside the --precision flag

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_CUDA = "cuda"
BF16_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Mixed-precision decision for one device: autocast dtype (float32 = autocast off) and
    whether fp16 gradients need loss scaling."""

    requested: str              # what the user asked: auto | fp32 | fp16 | bf16
    dtype: torch.dtype          # torch.float32 | torch.float16 | torch.bfloat16
    use_scaler: bool            # True only for fp16
    device_type: str            # "cpu", "cuda", ... (torch.device.type)

    @property
    def name(self) -> str:
        """Resolved precision: fp32 | fp16 | bf16 (what `auto` became)."""
        return {v: k for k, v in _DTYPES.items()}[self.dtype]

    def autocast(self) -> torch.autocast:
        """Context for forward + loss: casts eligible ops to `dtype`; disabled for fp32."""
        enabled = self.dtype != torch.float32
        # autocast rejects float32 as its dtype even when disabled on some devices: pass the
        # device's default low-precision dtype then, it is never applied.
        dtype = self.dtype if enabled else torch.get_autocast_dtype(self.device_type)
        return torch.autocast(self.device_type, dtype=dtype, enabled=enabled)

    def make_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler for fp16, a disabled (pass-through) one otherwise."""
        return torch.amp.GradScaler(self.device_type, enabled=self.use_scaler)


def decide_precision(requested: str, device_type: str,
                     capability: tuple[int, int] | None = None) -> tuple[torch.dtype, bool]:
    """Pure decision: (autocast dtype, use_scaler) for `requested` on a device of type
    `device_type` with CUDA compute `capability` (major, minor), None off CUDA."""
    if requested not in PRECISIONS:
        raise ValueError(f"unknown precision {requested!r}; use one of {', '.join(PRECISIONS)} (--precision)")
    is_cuda = device_type == _CUDA
    if is_cuda and capability is None:
        raise ValueError("a CUDA device needs its compute capability to decide the precision")
    has_bf16 = is_cuda and tuple(capability) >= BF16_MIN_CAPABILITY
    if requested == "auto":
        if not is_cuda:
            return torch.float32, False
        return (torch.bfloat16, False) if has_bf16 else (torch.float16, True)
    if requested == "bf16" and is_cuda and not has_bf16:
        major, minor = capability
        raise ValueError(
            f"--precision bf16 needs a GPU of compute capability >= 8.0 (Ampere or newer); this "
            f"one is {major}.{minor}. Use --precision fp16 (with loss scaling) or auto")
    if requested != "fp32" and not torch.amp.is_autocast_available(device_type):
        raise ValueError(f"--precision {requested}: torch has no autocast for device type "
                         f"{device_type!r}; use --precision fp32")
    dtype = _DTYPES[requested]
    return dtype, dtype == torch.float16


def choose_precision(requested: str, device: torch.device | str) -> PrecisionPolicy:
    """The precision policy for `requested` (auto | fp32 | fp16 | bf16) on `device`."""
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == _CUDA else None
    dtype, use_scaler = decide_precision(requested, device.type, capability)
    return PrecisionPolicy(requested, dtype, use_scaler, device.type)


# The resolved precisions by what they ask of a device: one whose `auto` choice is one of these can
# run every one before it too (an A100, bf16, also runs fp16 and fp32; a T4, fp16, runs fp32).
BY_SUPPORT = ("fp32", "fp16", "bf16")


def trial_precision(requested: str, lowest: str, recorded: str | None = None) -> str:
    """The one precision every rank of a run trains in (fp32 | fp16 | bf16), decided once per run.

    `lowest`: the lowest (`BY_SUPPORT`) of the ranks' own choices for `requested`
    (`choose_precision(...).name`), so that ranks on different GPU types agree: a T4 among A100s
    makes `auto` fp16 for all. `recorded`: the precision a resumed run's checkpoint was trained
    in (None: a fresh run, or a checkpoint that does not say). A forced precision is the same on
    every rank (`choose_precision` refuses one a device cannot run). Under `auto`, a resumed run
    keeps `recorded` wherever every rank can run it (a bf16 checkpoint resumed on A100s, an fp16
    one resumed on H100s); a bf16 checkpoint resumed where a T4 is among the ranks goes on in
    fp16 (with a fresh GradScaler: `trainer.training.checkpointing.restore_training_state`)."""
    if requested != "auto" or recorded not in BY_SUPPORT:
        return lowest
    return recorded if BY_SUPPORT.index(recorded) <= BY_SUPPORT.index(lowest) else lowest


def configure_backends(device: torch.device | str, *, cudnn_benchmark: bool = True) -> None:
    """Speed flags, set once per process. On CUDA: cuDNN autotuning (it re-tunes for every new
    input shape, so keep shapes fixed) and TF32 for float32 matmuls/convolutions (10-bit
    mantissa, ~same accuracy for training, several times faster on Ampere+). No-op elsewhere."""
    if torch.device(device).type != _CUDA:
        return
    torch.backends.cudnn.benchmark = cudnn_benchmark
    # Not `torch.backends.cuda.matmul.fp32_precision = "tf32"`: after it, the legacy getter
    # `torch.get_float32_matmul_precision()` raises ("mix of the legacy and new APIs"), and
    # Inductor calls that getter when it lowers a matmul, so every `--compile` run failed at its
    # first step. This setter is read the same by both APIs (matmul fp32_precision becomes "tf32").
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.conv.fp32_precision = "tf32"


def default_device() -> torch.device:
    """The first CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device(_CUDA, torch.cuda.current_device())
    return torch.device("cpu")


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == _CUDA


def has_cuda_context(device: torch.device | str) -> bool:
    """Whether this process has made its CUDA context on `device`, asked in-process (CUDA's
    primary-context query, through torch) without making one; False off CUDA and before torch
    started CUDA here."""
    device = torch.device(device)
    if not is_cuda(device) or not torch.cuda.is_initialized():
        return False
    # torch's own query (its CUDA-graph and RNG code use it); private, so read in this one place.
    query = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return True if query is None else bool(query(index))


def device_uuid(device: torch.device | str) -> str:
    """NVML's name of a CUDA device, "GPU-<uuid>", from torch's device properties (no context)."""
    return f"GPU-{torch.cuda.get_device_properties(torch.device(device)).uuid}"


def supports_fused_optimizer(device: torch.device | str) -> bool:
    """AdamW(fused=True) runs one kernel for all parameters on CUDA; use it there only."""
    return is_cuda(device)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued GPU work (a CPU-GPU sync point: call once per timed interval, not per
    step). No-op off CUDA."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def free_memory(device: torch.device | str) -> None:
    """Return cached blocks (after an out-of-memory error, before a hand-over), so the next try
    or the next process starts clean."""
    gc.collect()
    if is_cuda(device):
        # cuBLAS keeps a workspace per handle and stream (32 MiB each on sm_90) in torch's
        # allocator, which empty_cache cannot return while it is held; torch's own (private)
        # call releases them, and cuBLAS makes new ones at its next call.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation failure: torch's OutOfMemoryError, the ones cuDNN/cuBLAS report as a plain
    RuntimeError, or the CPU allocator's (also a plain RuntimeError in torch)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "CUDNN_STATUS_ALLOC_FAILED" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text
        or "DefaultCPUAllocator: can't allocate memory" in text)


def reset_peak_memory(device: torch.device | str) -> None:
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated_mb(device: torch.device | str) -> float | None:
    """Peak CUDA memory allocated by tensors since the last reset, in MiB; None off CUDA."""
    if not is_cuda(device):
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def peak_reserved_mb(device: torch.device | str) -> float | None:
    """Peak CUDA memory reserved by torch's caching allocator since the last reset, in MiB (what
    the process took from the GPU: tensors plus cached blocks); None off CUDA."""
    if not is_cuda(device):
        return None
    return torch.cuda.max_memory_reserved(device) / 2**20


def peak_reserved_share(device: torch.device | str) -> float | None:
    """Peak memory reserved by torch's CUDA allocator since the last `reset_peak_memory`, as a
    share of the device's total memory (what an allocation can grow into, fragmentation
    included); None off CUDA."""
    if not is_cuda(device):
        return None
    return torch.cuda.max_memory_reserved(device) / torch.cuda.get_device_properties(device).total_memory


def device_name(device: torch.device | str) -> str | None:
    """The GPU's name ("NVIDIA H100 80GB HBM3"); None off CUDA."""
    return torch.cuda.get_device_name(torch.device(device)) if is_cuda(device) else None


def device_memory_gib(device: torch.device | str) -> float | None:
    """The device's total memory in GiB; None off CUDA."""
    if not is_cuda(device):
        return None
    return torch.cuda.get_device_properties(device).total_memory / 2**30


def collective_device() -> torch.device:
    """Where tensors for the worker's own torch.distributed collectives live: the current CUDA
    device for a NCCL-only group; the CPU for gloo, and for a group that has gloo for CPU tensors
    beside NCCL ("cpu:gloo,cuda:nccl", `trainer.cluster.process_group.GPU_BACKEND`: no GPU memory used)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device(_CUDA, torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def backend_flags(device: torch.device | str, *, cudnn_benchmark: bool):
    """Temporarily set `configure_backends` flags (benchmarks compare settings in one process)."""
    if not is_cuda(device):
        yield
        return
    saved = (torch.backends.cudnn.benchmark, torch.get_float32_matmul_precision(),
             torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    configure_backends(device, cudnn_benchmark=cudnn_benchmark)
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark, legacy, matmul, torch.backends.cudnn.conv.fp32_precision = saved
        torch.set_float32_matmul_precision(legacy)   # both readers as they were
        torch.backends.cuda.matmul.fp32_precision = matmul
