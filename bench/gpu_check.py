"""`make gpu-check`: one check, under 5 minutes on one GPU, that the GPU path does what the design
says. It needs a CUDA device and refuses without one (exit 2).

  1. the precision table of bench/gpu_precision.py (mvit_v2_s, synthetic batches, batch 8,
     bf16 / fp16 / fp32 with cudnn.benchmark on and off; --bench-seconds budget);
  2. on this GPU, the two calls every Train worker makes before training: `choose_precision
     ("auto", device)` gives bf16 on sm 8.0+ (fp16 below) and `configure_backends(device)` turns
     cudnn.benchmark on (step 6 checks what the workers themselves reported);
  3. decoding (bench/gpu_decode.py): clip-cache JPEG entries decoded on the GPU against the same
     entries decoded on the CPU (each frame within JPEG tolerance), and seeded mvit_v2_s steps
     trained on each (model inputs and losses agree; the GPU side decodes inside the training
     loop while the previous step is queued, where nvJPEG once overwrote the step's memory);
  4. learning (bench/learning_check.py): the `tiny` model trained 8 epochs on 200 generated videos
     without Ray, once in fp16 with GradScaler and once in bf16 (where the GPU has it), each
     reaching val_acc 0.8 on 40 balanced validation clips (chance 0.5), as on the CPU in fp32
     (tests/test_learning.py); the steps GradScaler skipped are reported; then what the lease would
     record for this process after freeing (`process_device_mb`) against NVML's used memory of
     the GPU by UUID (`check_process_record`);
  5. a real 4-trial search on the GPU: `vidtune search --model mvit_v2_s --weights none
     --epochs 2 --num-samples 4` on videos generated here (datasets.synthetic), with its own
     MLflow store (SQLite), Ray storage and clip cache in the work folder;
  6. that store, read back with MlflowClient: every trial's child run FINISHED with all its
     epochs and param precision=auto; the workers' own record of what they trained with (tags:
     the precision auto became on this GPU, TF32 and cudnn.benchmark on, device, capability,
     CUDA, driver, torch); one training at a time on each GPU (`concurrent_trainings` == 1 in
     every epoch); tag `gpu_ids` on every child run; clips_per_s and peak_mem_mb > 0;
  7. the search's device lease record (device_lease.json): every trial waited for its GPU without
     a CUDA context there and gave it back having freed its memory, recording its live context
     (above 0) and at most step 4's figure + HANDED_OVER_MB (`check_hand_over`);
  8. one epoch of mvit_v2_s as a worker trains it (trainer.training.run) with --compile and
     --channels-last: Inductor lowers its attention matmuls, where a TF32 setting once crashed it;
  9. the batch probe against a known answer: in a slice of the GPU's memory (--probe-share), the
     size it finds fits, its steady step measured alone from a clean allocator, and one more
     clip does not;
 10. a hub architecture: a tiny random VideoMAE, written with save_pretrained and trained as
     `--model hf:FOLDER` on the learning videos in fp16 and bf16, each learning (val_acc 0.8) and
     reporting its clips/s and peak memory.

Prints a table of the checks; the first that fails ends the run with a line saying what failed
(exit 1); with --keep-going every check runs (a first run on a new GPU shows all that fails).

    make gpu-check                                     # or:
    python -m bench.gpu_check --json gpu-check.json    # --keep DIR keeps the search's files

This module holds the flags and the run; the steps are in bench/gpu_check_steps.py, the checks of
what they produced in bench/gpu_check_results.py.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.common import write_json
from bench.gpu_check_results import format_checks, run_checks
from bench.gpu_check_steps import PARTS, GpuCheck

NO_GPU_EXIT = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-samples", type=int, default=4, help="trials of the search (default 4)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per trial (default 2)")
    p.add_argument("--batch-sizes", default="8,16", help="the search's batch sizes (default 8,16)")
    p.add_argument("--videos", type=int, default=64, help="generated videos, 112 px, 3 s (default 64)")
    p.add_argument("--bench-seconds", type=float, default=60,
                   help="time budget of the precision table (its --max-seconds; default 60)")
    p.add_argument("--search-timeout-s", type=float, default=200,
                   help="the search is interrupted past this (default 200)")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="work folder to keep (videos, MLflow store, Ray results, logs); "
                        "default: a temporary one")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write the checks and figures as JSON")
    p.add_argument("--probe-share", type=float, default=0.05,
                   help="the share of the GPU's memory the batch-probe check probes in (default 0.05: "
                        "a small known answer in seconds)")
    p.add_argument("--part", choices=PARTS, default="all",
                   help="all (default); local: the checks in this process, without Ray (precision, "
                        "decoding, learning, --compile, batch probe); search: the search and what it wrote")
    p.add_argument("--keep-going", action="store_true",
                   help="run every check even after one fails (default: stop at the first)")
    return p


def validate(args: argparse.Namespace) -> None:
    for flag, value, least in (("--num-samples", args.num_samples, 1), ("--epochs", args.epochs, 1),
                               ("--videos", args.videos, 8), ("--bench-seconds", args.bench_seconds, 1),
                               ("--search-timeout-s", args.search_timeout_s, 1)):
        if value < least:
            raise SystemExit(f"gpu-check: {flag} {value:g}: must be >= {least}")
    if not 0 < args.probe_share <= 1:
        raise SystemExit(f"gpu-check: --probe-share {args.probe_share:g}: must be in (0, 1]")


def no_gpu_reason() -> str | None:
    """One line saying why this machine cannot run the check; None when it has a CUDA device."""
    if torch.cuda.is_available():
        return None
    return (f"gpu-check: refused: torch {torch.__version__} "
            f"(CUDA {torch.version.cuda or 'none: a CPU-only build'}) "
            "sees no CUDA device here; this check needs one GPU (nothing was run)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    validate(args)
    reason = no_gpu_reason()
    if reason:
        print(reason, file=sys.stderr)
        return NO_GPU_EXIT
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vidtune-gpu-check-") as tmp:
        work = Path(args.keep).resolve() if args.keep else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        check = GpuCheck(args, work)
        checks = run_checks(check.steps(), keep_going=args.keep_going)
        elapsed = time.perf_counter() - started
        major, minor = torch.cuda.get_device_capability(check.device)
        gpu = f"{torch.cuda.get_device_name(check.device)} (sm {major}.{minor})"
        print(f"\ngpu-check on {gpu}, torch {torch.__version__} (CUDA {torch.version.cuda}), {elapsed:.0f} s")
        print(format_checks(checks))
        failed = next((c for c in checks if not c.passed), None)
        if failed and "\n" in failed.detail:
            print("\n" + failed.detail)
        if args.json:
            write_json(args.json, {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
                                   "elapsed_s": elapsed, "passed": failed is None,
                                   "checks": [asdict(c) for c in checks], **check.figures})
    if failed:
        print(f"gpu-check FAILED: {failed.name}: {failed.detail.splitlines()[0]}", file=sys.stderr)
        return 1
    print("gpu-check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
