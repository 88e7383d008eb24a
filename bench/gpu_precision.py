"""Training speed, memory, data wait and MFU of one model on one GPU: precision x cudnn.benchmark
x batch size, from synthetic batches and from real clips (decord per item, or a warm frame cache).

Runs the project's own training loop (`trainer.training.loop.train_one_epoch`: uint8 clips copied to the
GPU, `ClipTransform` there, autocast, GradScaler for fp16, fused AdamW, clipping) with random
weights (no download), a few warm-up steps (cuDNN autotuning happens there), then timed steps:
  - synthetic rows: one pinned batch repeated (no data loading): fp32 / fp16 / bf16 with
    cudnn.benchmark on and off, at each batch size;
  - data rows: the real `VideoClipDataset` + `build_loader` over a generated corpus, decoding
    every clip with decord, or reading a warm frame cache (`datasets.cache`, one row per
    --cache-formats; a jpeg cache is decoded on the GPU as the trainer does), at the first of
    bf16 / --precisions with cudnn.benchmark on, so the time the step waits for data shows.
Each row: clips/s, ms/step, data_wait_frac, peak GPU memory (torch.cuda.max_memory_allocated),
achieved TFLOP/s and MFU: one forward's FLOPs (counted once with FlopCounterMode) x 3 for forward
+ backward, per second, over the device's peak dense FLOP/s (`bench.gpu_flops.PEAK_TFLOPS`, or
--peak-tflops).
fp32 runs with TF32 on (as `configure_backends` sets it for training): its MFU is against the
TF32 peak. Rows run most interesting first; past --max-seconds the rest are skipped and listed.

    python -m bench.gpu_precision --json gpu.json          # H200: mvit_v2_s 16x224x224, batch 8, 16 (< 5 min)
    python -m bench.gpu_precision --model swin3d_t --batch-sizes 16 32 --channels-last
    python -m bench.gpu_precision --quick                  # a GPU: 1 batch size, bf16, 3 timed steps (~1 min)
    python -m bench.gpu_precision --cpu-smoke              # no GPU: the same rows, tiny model, 2 timed steps

Without a CUDA device (and without --cpu-smoke) it refuses with exit 2, as `make gpu-check` does.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import itertools
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from bench.common import format_table, has_module, write_json
from bench.gpu_flops import forward_flops_per_clip, peak_flops
from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index
from vidtune.datasets.synthetic import generate
from vidtune.datasets.transforms import ClipTransform
from vidtune.datasets.video import VideoClipDataset, build_loader
from vidtune.trainer.models.registry import (
    MODEL_NAMES,
    build_model,
    get_spec,
    prepare_input_transform,
    prepare_model_memory_format,
)
from vidtune.trainer.training import precision as prec
from vidtune.trainer.training.loop import make_optimizer, train_one_epoch
from vidtune.trainer.training.precision import is_out_of_memory

# --max-seconds counts from the process's start: Python's start and torch's import are part of the run.
STARTED = psutil.Process().create_time()
REPO_ROOT = Path(__file__).resolve().parents[1]
NO_GPU_EXIT = 2       # no CUDA device: refused, as bench/gpu_check.py does

@dataclass(frozen=True)
class Row:
    source: str               # synthetic | decord | cache-jpeg | cache-raw
    precision: str            # fp32 | fp16 | bf16
    cudnn_benchmark: bool
    batch_size: int
    channels_last: bool = False
    compile: bool = False


    def label(self) -> str:
        extra = "".join([" channels_last" if self.channels_last else "", " compile" if self.compile else ""])
        return (f"{self.source} {self.precision} cudnn.benchmark={'on' if self.cudnn_benchmark else 'off'} "
                f"batch {self.batch_size}{extra}")


@dataclass
class Corpus:
    """The generated videos of the data rows and their warm frame caches (format -> FrameCache)."""

    videos: list = field(default_factory=list)
    caches: dict = field(default_factory=dict)
    note: str = ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mvit_v2_s", choices=MODEL_NAMES,
                   help="registry model (default mvit_v2_s)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16],
                   help="clips per step (default 8 16)")
    p.add_argument("--warmup-steps", type=int, default=3,
                   help="untimed steps first: cuDNN autotuning, allocator (default 3; data rows: at least 2 "
                        "per loader process)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row (default 10)")
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp16", "fp32"],
                   choices=["fp32", "fp16", "bf16"],
                   help="precisions of the synthetic rows (default bf16 fp16 fp32); the data rows use the "
                        "first")
    p.add_argument("--cache-formats", nargs="*", default=["jpeg", "raw"], choices=["jpeg", "raw"],
                   help="frame-cache formats of the data rows (default jpeg raw; none: decord rows only)")
    p.add_argument("--no-data", action="store_true", help="skip the data rows (no corpus generated)")
    p.add_argument("--videos", type=int, default=48, help="videos in the generated corpus (default 48)")
    p.add_argument("--source-size", type=int, default=320,
                   help="frame size of the generated videos in px (default 320)")
    p.add_argument("--loader-workers", type=int, default=8,
                   help="DataLoader processes of the data rows (default 8)")
    p.add_argument("--channels-last", action="store_true",
                   help="also run each precision with channels_last_3d (cudnn.benchmark on)")
    p.add_argument("--compile", action="store_true",
                   help="also run each precision under torch.compile (takes minutes)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense TFLOP/s for the MFU of every row (default: PEAK_TFLOPS for the device "
                        "and precision)")
    p.add_argument("--max-seconds", type=float, default=270,
                   help="time budget from the start; rows that would start past it are skipped and listed "
                        "(default 270)")
    p.add_argument("--device", default=None, help="torch device (default: the first GPU)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run on the CPU instead: tiny model, batch 2, fp32 and bf16, 1 warm-up + 2 timed "
                        "steps, a 10-video corpus (checks the script without a GPU)")
    p.add_argument("--quick", action="store_true",
                   help="a short run to check the script: the first batch size, the first precision, "
                        "1 warm-up + 3 timed steps, a 16-video corpus with a jpeg cache, --max-seconds 120 "
                        "(with --cpu-smoke: a 2-row CPU run)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the rows as JSON")
    return p


def plan_rows(args: argparse.Namespace, on_cuda: bool, corpus_ok: bool) -> list[Row]:
    """Most interesting first, so a spent --max-seconds drops the least useful rows."""
    first = "bf16" if "bf16" in args.precisions else args.precisions[0]
    sizes = args.batch_sizes
    rows = [Row("synthetic", first, True, b) for b in sizes]
    if corpus_ok:
        sources = ["decord", *(f"cache-{f}" for f in args.cache_formats)]
        rows += [Row(src, first, True, b) for b in sizes for src in sources]
    rows += [Row("synthetic", p, True, b) for p in args.precisions if p != first for b in sizes]
    if on_cuda:   # cudnn.benchmark means nothing on the CPU
        rows += [Row("synthetic", p, False, b) for p in args.precisions for b in sizes]
    rows += [Row("synthetic", p, True, sizes[0], channels_last=True) for p in args.precisions
             if args.channels_last]
    rows += [Row("synthetic", p, True, sizes[0], compile=True) for p in args.precisions if args.compile]
    return rows


def make_corpus(tmp: Path, args: argparse.Namespace, spec: Any) -> Corpus:
    """Generate the videos, index them, fill one frame cache per format (where datasets.cache exists)."""
    t0 = time.perf_counter()
    root = generate(tmp / "corpus", videos=args.videos, size=args.source_size, seed=0,
                    workers=min(os.cpu_count() or 1, 16))
    index = build_index(DataConfig(root=str(root), cache_dir=str(tmp)))
    corpus = Corpus(videos=list(index.train) + list(index.val))
    notes = [f"{len(corpus.videos)} generated videos at {args.source_size} px "
             f"({time.perf_counter() - t0:.0f} s)"]
    if args.cache_formats and not has_module("vidtune.datasets.cache"):
        notes.append("no frame cache in this code (datasets/cache.py): cache rows skipped")
    elif args.cache_formats:
        from vidtune.datasets.cache import FrameCache  # optional: older checkouts lack it (above)
        from vidtune.datasets.cache_fill import fill_cache  # optional, as above

        for fmt in args.cache_formats:
            t1 = time.perf_counter()
            try:   # the cache API is young: a failure here costs its rows, not the run
                cfg = DataConfig(root=str(root), clip_cache=True,
                                 clip_cache_dir=str(tmp / f"frames-{fmt}"), clip_cache_format=fmt)
                cache = FrameCache.from_config(cfg)
                fill_cache(corpus.videos, height=spec.height, width=spec.width, cache=cache)
            except Exception as e:  # noqa: BLE001
                notes.append(f"{fmt} cache rows skipped ({type(e).__name__}: {e})")
                continue
            corpus.caches[fmt] = cache
            notes.append(f"{fmt} cache filled in {time.perf_counter() - t1:.0f} s "
                         f"({cache.usage_bytes() / 1e6:.0f} MB)")
    corpus.note = "; ".join(notes)
    return corpus


@contextlib.contextmanager
def batches(row: Row, spec: Any, device: torch.device, corpus: Corpus | None, workers: int,
            clips_needed: int) -> Iterator[Iterator]:
    """An endless-enough iterator of (clips, labels) batches for `row`; loader processes stop on
    exit."""
    on_cuda = prec.is_cuda(device)
    if row.source == "synthetic":
        clips = torch.randint(0, 256, (row.batch_size, spec.num_frames, spec.height, spec.width, 3),
                              dtype=torch.uint8)
        yield itertools.repeat((clips.pin_memory() if on_cuda else clips, torch.arange(row.batch_size) % 2))
        return
    extra = {}
    if row.source.startswith("cache-"):
        cache = corpus.caches[row.source.removeprefix("cache-")]
        extra = dict(cache=cache, encoded=cache.format == "jpeg" and on_cuda)   # as
        # trainer/cluster/worker.py decides
    repeats = math.ceil(clips_needed / len(corpus.videos)) + 1   # one pass, no epoch boundary in the timing
    dataset = VideoClipDataset(corpus.videos * repeats, num_frames=spec.num_frames, frame_stride=2,
                               height=spec.height, width=spec.width, train=True, seed=0, **extra)
    loader = build_loader(dataset, batch_size=row.batch_size, train=True, num_workers=workers,
                          pin_memory=on_cuda)
    it = iter(loader)
    try:
        yield it
    finally:
        del it, loader
        gc.collect()


def measure(model_cpu: torch.nn.Module, row: Row, spec: Any, device: torch.device, source: Iterator,
            warmup_steps: int, steps: int) -> dict[str, float] | str:
    """clips/s, ms/step, data_wait_frac, peak MiB of `row`; the string "OOM" when it does not fit.
    Whatever the row put on the device is freed before this returns, out of memory or not."""
    result: dict[str, float] | str = "OOM"
    with prec.backend_flags(device, cudnn_benchmark=row.cudnn_benchmark):
        try:
            result = _train_row(model_cpu, row, spec, device, source, warmup_steps, steps)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
    # Here, not in the except block: until it ends, the traceback keeps _train_row's frame (the
    # model, optimizer state, activations) alive, and empty_cache could return none of it.
    release(device, compiled=row.compile)
    return result


def _train_row(model_cpu: torch.nn.Module, row: Row, spec: Any, device: torch.device, source: Iterator,
               warmup_steps: int, steps: int) -> dict[str, float]:
    """Train `row` (warm-up, then timed steps); its device state lives in this frame only."""
    policy = prec.choose_precision(row.precision, device)
    model = prepare_model_memory_format(copy.deepcopy(model_cpu).to(device), row.channels_last)
    if row.compile:
        model = torch.compile(model)
    transform = prepare_input_transform(ClipTransform(spec.mean, spec.std, train=True).to(device),
                                        row.channels_last)
    optimizer = make_optimizer(model, lr=1e-4, weight_decay=0.05, device=device)
    run = dict(transform=transform, optimizer=optimizer, policy=policy, device=device,
               scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
               scaler=policy.make_scaler())
    prec.reset_peak_memory(device)
    train_one_epoch(model, itertools.islice(source, warmup_steps), **run)
    stats = train_one_epoch(model, itertools.islice(source, steps), **run)
    busy = stats.data_wait_s + stats.step_time_s
    return {"clips_per_s": stats.clips / stats.epoch_time_s,
            "ms_per_step": 1000 * stats.epoch_time_s / max(1, stats.steps),
            "data_wait_frac": stats.data_wait_s / busy if busy > 0 else 0.0,
            "peak_mib": prec.peak_allocated_mb(device) or math.nan}


def release(device: torch.device, *, compiled: bool = False) -> None:
    """Between rows: collect the last row's objects (reference cycles too), return the cached
    blocks to the driver and reset the peak, so the next row's figures are its own. Call it
    after the row's frames and any exception from them are gone."""
    if compiled:
        torch.compiler.reset()   # dynamo's cache holds the compiled graph and its parameters
    prec.free_memory(device)
    prec.reset_peak_memory(device)


def run_row(model_cpu: torch.nn.Module, row: Row, spec: Any, device: torch.device, corpus: Corpus | None,
            args: argparse.Namespace) -> dict[str, float] | str:
    warmup = args.warmup_steps
    if row.source != "synthetic":
        # The loader's processes start together and fill their prefetch queues (2 batches each)
        # while the first steps run: drain that backlog untimed, or a decoder slower than the
        # GPU would not show in data_wait_frac.
        warmup = max(warmup, 2 * args.loader_workers)
    needed = row.batch_size * (warmup + args.steps + 1)
    with batches(row, spec, device, corpus, args.loader_workers, needed) as source:
        result = measure(model_cpu, row, spec, device, source, warmup, args.steps)
        source = None  # noqa: F841 - the loader's processes stop with its last reference
    gc.collect()
    return result


def with_mfu(result: dict[str, float] | str, row: Row, flops_fwd: float, device: torch.device,
             peak_override: float | None) -> dict[str, Any] | str:
    if isinstance(result, str):
        return result
    achieved = 3 * flops_fwd * result["clips_per_s"]
    peak, _ = peak_flops(device, row.precision, peak_override)
    return {**result, "tflops": achieved / 1e12, "mfu": achieved / peak if peak else math.nan}


def format_rows(rows: list[tuple[Row, dict | str]]) -> str:
    cells = []
    for r, res in rows:
        flags = [r.source, r.precision, r.cudnn_benchmark, r.channels_last, r.compile, r.batch_size]
        if isinstance(res, str):
            cells.append([*flags, res, *["-"] * 5])
        else:
            cells.append([*flags, res["clips_per_s"], res["ms_per_step"], f"{res['data_wait_frac']:.2f}",
                          res["peak_mib"], f"{res['tflops']:.2f}", 100 * res["mfu"]])
    table = format_table(("source", "precision", "cudnn.bench", "ch_last", "compile", "batch", "clips/s",
                          "ms/step", "data_wait", "peak_MiB", "TFLOP/s", "MFU_%"), cells, digits=1)
    return table


def setup(args: argparse.Namespace) -> torch.device | None:
    """The device to measure on (None: nothing to do here), after applying --cpu-smoke."""
    for flag, values, least in (("--batch-sizes", args.batch_sizes, 1), ("--steps", [args.steps], 1),
                                ("--warmup-steps", [args.warmup_steps], 0), ("--videos", [args.videos], 4),
                                ("--loader-workers", [args.loader_workers], 0),
                                ("--source-size", [args.source_size], 16)):
        if min(values) < least:
            raise SystemExit(f"{flag} {min(values)}: must be >= {least}")
    if args.quick:
        args.batch_sizes, args.precisions = args.batch_sizes[:1], args.precisions[:1]
        args.warmup_steps, args.steps, args.videos = 1, 3, 16
        args.cache_formats, args.max_seconds = args.cache_formats[:1], min(args.max_seconds, 120)
    if args.cpu_smoke:
        args.model, args.batch_sizes, args.precisions = "tiny", [2], ["fp32", "bf16"][:1 if args.quick else 2]
        args.warmup_steps, args.steps, args.videos, args.source_size = 1, 2, 10, 112
        args.loader_workers = min(args.loader_workers, 1)
        # steadier on a shared CPU: several OpenMP threads spin-wait for a busy core
        torch.set_num_threads(1)
        return torch.device("cpu")
    device = torch.device(args.device) if args.device else prec.default_device()
    if not prec.is_cuda(device):
        print(f"gpu_precision: refused: torch {torch.__version__} sees no CUDA device here ({device}); this "
              "benchmark needs one GPU (nothing was run; --cpu-smoke checks the script on the CPU)",
              file=sys.stderr)
        return None
    return device


def describe_device(device: torch.device) -> str:
    if not prec.is_cuda(device):
        return f"CPU ({torch.get_num_threads()} threads)"
    capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return f"{torch.cuda.get_device_name(device)} (sm {capability})"


def run_rows(rows: list[Row], model: torch.nn.Module, spec: Any, device: torch.device,
             corpus: Corpus | None, flops_fwd: float,
             args: argparse.Namespace) -> tuple[list[tuple[Row, dict | str]], list[Row]]:
    """(measured rows, skipped rows): a row is skipped when the time so far plus the previous
    row's duration would pass --max-seconds (and so is every row after it)."""
    done: list[tuple[Row, dict | str]] = []
    skipped: list[Row] = []
    last_row_s = 0.0
    no_bf16 = prec.is_cuda(device) and not torch.cuda.is_bf16_supported(including_emulation=False)
    for row in rows:
        if skipped or time.time() - STARTED + last_row_s > args.max_seconds:
            skipped.append(row)
            continue
        if row.precision == "bf16" and no_bf16:
            done.append((row, "no bf16"))
            continue
        t0 = time.perf_counter()
        try:   # one failing row (a decoder error, a model that does not compile) must not end the run
            result = run_row(model, row, spec, device, corpus, args)
        except Exception as e:  # noqa: BLE001
            print(f"  {row.label()} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            result = f"ERROR {type(e).__name__}"
        # after the except block: its traceback held the row's tensors
        release(device, compiled=row.compile)
        done.append((row, with_mfu(result, row, flops_fwd, device, args.peak_tflops)))
        last_row_s = time.perf_counter() - t0
        print(f"  done: {row.label()} ({time.time() - STARTED:.0f} s)", file=sys.stderr, flush=True)
    return done, skipped


def report(args: argparse.Namespace, spec: Any, device: torch.device, flops_fwd: float,
           corpus: Corpus | None, done: list, skipped: list) -> dict[str, Any]:
    """Print the table; return the JSON document."""
    elapsed = time.time() - STARTED
    peaks = {p: peak_flops(device, p, args.peak_tflops) for p in ("bf16", "fp16", "fp32")}
    print(f"\n{args.model} ({spec.num_frames}x{spec.height}x{spec.width}), random weights, "
          f"{describe_device(device)}, torch {torch.__version__}; {args.warmup_steps} warm-up + "
          f"{args.steps} timed steps per row")
    shown = ", ".join(f"{p} {v / 1e12:g}" for p, (v, _) in peaks.items() if v)
    print(f"FLOPs: forward {flops_fwd / 1e9:.2f} GFLOP per clip (FlopCounterMode), "
          "a training step 3x that; "
          + (f"peak TFLOP/s {shown} ({peaks['bf16'][1]}; fp32 rows run TF32)" if shown
             else f"MFU not shown: {peaks['bf16'][1]}"))
    if corpus is not None:
        print(f"data rows: {corpus.note}; {args.loader_workers} loader process(es); source 'decord' decodes "
              "every clip from the files, 'cache-FMT' reads the warm frame cache (jpeg: decoded on the "
              "device)")
    print(format_rows(done))
    if skipped:
        print(f"\nSKIPPED {len(skipped)} row(s): the --max-seconds {args.max_seconds:g} budget was spent "
              f"({elapsed:.0f} s elapsed):\n  " + "\n  ".join(r.label() for r in skipped))
    print(f"\ntotal {elapsed:.0f} s")
    return {"model": args.model, "clip": [spec.num_frames, spec.height, spec.width],
            "device": describe_device(device),
            "torch": torch.__version__, "warmup_steps": args.warmup_steps, "steps": args.steps,
            "flops_per_clip_forward": flops_fwd, "peak_flops": {p: v for p, (v, _) in peaks.items()},
            "peak_source": peaks["bf16"][1], "corpus": corpus.note if corpus else None,
            "loader_workers": args.loader_workers, "budget_s": args.max_seconds, "elapsed_s": elapsed,
            "rows": [{**asdict(r), **(res if isinstance(res, dict) else {"error": res})} for r, res in done],
            "skipped": [asdict(r) for r in skipped]}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = setup(args)
    if device is None:
        return NO_GPU_EXIT
    spec = get_spec(args.model)
    torch.manual_seed(0)
    model = build_model(args.model)    # weights="none": random init, nothing to download
    flops_fwd = forward_flops_per_clip(model, spec, device)
    with tempfile.TemporaryDirectory(prefix="vidtune-gpu-bench-") as tmp:
        corpus = None if args.no_data else make_corpus(Path(tmp), args, spec)
        rows = [r for r in plan_rows(args, prec.is_cuda(device), corpus is not None)
                if not r.source.startswith("cache-") or r.source.removeprefix("cache-") in corpus.caches]
        done, skipped = run_rows(rows, model, spec, device, corpus, flops_fwd, args)
    doc = report(args, spec, device, flops_fwd, corpus, done, skipped)
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
