"""Training speed and memory of one model under fp32 / fp16 / bf16, cudnn.benchmark on / off.

Runs the project's own training loop (`trainer.loop.train_one_epoch`: uint8 clips copied to the
GPU, `ClipTransform` there, autocast, GradScaler for fp16, fused AdamW, clipping) for a few
warm-up steps (cuDNN autotuning happens there) and then a few timed ones, with random weights
(no download), and prints clips/s, time per step and peak GPU memory for each setting. fp32
runs with TF32 on, as `configure_backends` sets it for training.

    python bench/gpu_precision.py                         # mvit_v2_s, 16x224x224, batch 8 (< 5 min)
    python bench/gpu_precision.py --model swin3d_t --batch-size 16 --channels-last
    python bench/gpu_precision.py --cpu-smoke             # no GPU: tiny on the CPU, fp32 vs bf16

Without a CUDA device it says so and exits 0 (with --cpu-smoke it first runs the tiny model on
the CPU at a few batch sizes, a table like the GPU one).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from datasets.transforms import ClipTransform  # noqa: E402
from trainer import precision as prec  # noqa: E402
from trainer.batch_probe import is_out_of_memory  # noqa: E402
from trainer.loop import make_optimizer, train_one_epoch  # noqa: E402
from trainer.models import MODEL_NAMES, build_model, get_spec, prepare_input_transform, prepare_model_memory_format  # noqa: E402


@dataclass(frozen=True)
class Setting:
    precision: str            # fp32 | fp16 | bf16
    cudnn_benchmark: bool
    channels_last: bool = False
    compile: bool = False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mvit_v2_s", choices=MODEL_NAMES, help="registry model (default mvit_v2_s)")
    p.add_argument("--batch-size", type=int, default=8, help="clips per step (default 8)")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first: cuDNN autotuning, allocator (default 3)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per setting (default 10)")
    p.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "bf16"], choices=["fp32", "fp16", "bf16"],
                   help="precisions to compare (default fp32 fp16 bf16)")
    p.add_argument("--channels-last", action="store_true",
                   help="also run each precision with channels_last_3d model and input (cudnn.benchmark on)")
    p.add_argument("--compile", action="store_true",
                   help="also run each precision under torch.compile (cudnn.benchmark on; compiling takes minutes)")
    p.add_argument("--device", default=None, help="torch device (default: the first GPU)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the tiny model on the CPU (fp32 vs bf16) before the GPU part; useful without a GPU")
    p.add_argument("--cpu-batch-sizes", type=int, nargs="+", default=[2, 8],
                   help="batch sizes of the --cpu-smoke table (default 2 8)")
    return p


def measure(model_cpu: torch.nn.Module, model_name: str, setting: Setting, device: torch.device, batch_size: int,
            warmup_steps: int, steps: int) -> dict[str, float] | str:
    """clips/s, ms/step, peak MiB of `setting`; the string "OOM" when it does not fit."""
    spec = get_spec(model_name)
    policy = prec.choose_precision(setting.precision, device)
    clips = torch.randint(0, 256, (batch_size, spec.num_frames, spec.height, spec.width, 3), dtype=torch.uint8)
    if prec.is_cuda(device):
        clips = clips.pin_memory()
    labels = torch.arange(batch_size) % 2
    result: dict[str, float] | str = "OOM"
    with prec.backend_flags(device, cudnn_benchmark=setting.cudnn_benchmark):
        try:
            model = prepare_model_memory_format(copy.deepcopy(model_cpu).to(device), setting.channels_last)
            if setting.compile:
                model = torch.compile(model)
            transform = prepare_input_transform(ClipTransform(spec.mean, spec.std, train=True).to(device),
                                                setting.channels_last)
            optimizer = make_optimizer(model, lr=1e-4, weight_decay=0.05, device=device)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            scaler = policy.make_scaler()
            run = dict(transform=transform, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                       policy=policy, device=device)
            prec.reset_peak_memory(device)
            train_one_epoch(model, [(clips, labels)] * warmup_steps, **run)
            stats = train_one_epoch(model, [(clips, labels)] * steps, **run)
            result = {"clips_per_s": stats.clips / stats.epoch_time_s,
                      "ms_per_step": 1000 * stats.epoch_time_s / steps,
                      "peak_mib": prec.peak_allocated_mb(device) or float("nan")}
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
    model = optimizer = scaler = None  # noqa: F841 - release before the next setting
    prec.free_memory(device)
    return result


def print_table(title: str, rows: list[tuple[Setting, dict[str, float] | str]], batch_size: int) -> None:
    print(f"\n{title}")
    header = f"{'precision':<9} {'cudnn.bench':<11} {'ch_last':<7} {'compile':<7} {'batch':>5} {'clips/s':>9} {'ms/step':>9} {'peak MiB':>9}"
    print(header)
    print("-" * len(header))
    for s, r in rows:
        flags = f"{s.precision:<9} {str(s.cudnn_benchmark):<11} {str(s.channels_last):<7} {str(s.compile):<7} {batch_size:>5}"
        if isinstance(r, str):
            print(f"{flags} {r:>9} {'-':>9} {'-':>9}")
        else:
            print(f"{flags} {r['clips_per_s']:>9.1f} {r['ms_per_step']:>9.1f} {r['peak_mib']:>9.0f}")
    sys.stdout.flush()


def cpu_smoke(batch_sizes: list[int]) -> None:
    """tiny on the CPU, fp32 vs bf16: checks the loop runs, and shows what bf16 costs there."""
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = build_model("tiny")
    spec = get_spec("tiny")
    print(f"\nCPU smoke test: tiny ({spec.num_frames}x{spec.height}x{spec.width}), {torch.get_num_threads()} threads")
    header = f"{'precision':<9} {'batch':>5} {'clips/s':>9} {'ms/step':>9}"
    print(header)
    print("-" * len(header))
    for batch_size in batch_sizes:
        for name in ("fp32", "bf16"):
            r = measure(model, "tiny", Setting(name, False), device, batch_size, warmup_steps=1, steps=3)
            print(f"{name:<9} {batch_size:>5} {r['clips_per_s']:>9.1f} {r['ms_per_step']:>9.1f}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, value in (("--batch-size", args.batch_size), ("--steps", args.steps)):
        if value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    if args.cpu_smoke:
        cpu_smoke(args.cpu_batch_sizes)
    device = torch.device(args.device) if args.device else prec.default_device()
    if not prec.is_cuda(device):
        print(f"\nno CUDA device here ({device}): nothing to measure on a GPU"
              + ("" if args.cpu_smoke else " (run with --cpu-smoke for a CPU check)"))
        return 0
    settings = [Setting(p, bench) for p in args.precisions for bench in (True, False)]
    settings += [Setting(p, True, channels_last=True) for p in args.precisions if args.channels_last]
    settings += [Setting(p, True, compile=True) for p in args.precisions if args.compile]
    spec = get_spec(args.model)
    torch.manual_seed(0)
    model = build_model(args.model)
    capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
    title = (f"{args.model} ({spec.num_frames}x{spec.height}x{spec.width}), random weights, "
             f"{torch.cuda.get_device_name(device)} (sm {capability}), torch {torch.__version__}, "
             f"{args.warmup_steps} warm-up + {args.steps} timed steps per row")
    rows = []
    started = time.perf_counter()
    for setting in settings:
        if setting.precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
            rows.append((setting, "no bf16"))
            continue
        rows.append((setting, measure(model, args.model, setting, device, args.batch_size, args.warmup_steps,
                                      args.steps)))
        print(f"  done: {setting} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    print_table(title, rows, args.batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
