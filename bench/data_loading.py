"""How fast clips come out of the data layer on this machine: prints a table of clips/s.

For each decode size (H = W) and clip length T it measures
  - `VideoClipDataset[i]` called in a loop in this process (decord alone, no batching);
  - `build_loader(...)` with 0, 1, 2 ... DataLoader worker processes (what a training worker
    sees), steady state after the first batch, and the time to that first batch (worker start).
Use it to choose `loader_workers` and the decode size: a training step that takes longer per
clip than the loader delivers waits for data.

    python bench/data_loading.py                                  # synthetic data in a temp folder
    python bench/data_loading.py --root /data/RWF-2000 --sizes 112 224 --frames 16
    python bench/data_loading.py --smoke-test                     # a few seconds, to check it runs
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(REPO_ROOT))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=None,
                   help="dataset to read (any layout datasets.index knows); default: generate a synthetic one")
    p.add_argument("--videos", type=int, default=48, help="size of the generated synthetic dataset (default 48)")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 112, 224], help="decode sizes H = W (default 64 112 224)")
    p.add_argument("--frames", type=int, nargs="+", default=[8, 16], help="clip lengths T (default 8 16)")
    p.add_argument("--frame-stride", type=int, default=2, help="take every k-th frame (default 2)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2],
                   help="DataLoader worker counts to compare (default 0 1 2)")
    p.add_argument("--batch-size", type=int, default=4, help="DataLoader batch size (default 4)")
    p.add_argument("--clips", type=int, default=48, help="clips timed per measurement (default 48)")
    p.add_argument("--smoke-test", action="store_true",
                   help="tiny run to check the script works: 8 videos, size 64, T 8, 8 clips, workers 0 and 1")
    return p


def _check_args(args: argparse.Namespace) -> None:
    checks = [("--videos", [args.videos], 4), ("--sizes", args.sizes, 16), ("--frames", args.frames, 1),
              ("--frame-stride", [args.frame_stride], 1), ("--workers", args.workers, 0),
              ("--batch-size", [args.batch_size], 1), ("--clips", [args.clips], 1)]
    for flag, values, least in checks:
        bad = [v for v in values if v < least]
        if bad:
            raise SystemExit(f"{flag} {bad[0]}: must be >= {least}")
    if args.root is not None and not Path(args.root).exists():
        raise SystemExit(f"--root {args.root}: no such file or folder; give a dataset folder or CSV manifest")


def _videos(args: argparse.Namespace, tmp: str):
    """Training videos (VideoInfo records) of --root, or of a freshly generated synthetic dataset."""
    from datasets.config import DataConfig
    from datasets.index import build_index
    from datasets.synthetic import generate

    root = args.root or str(generate(Path(tmp) / "synthetic", videos=args.videos, seed=0))
    index = build_index(DataConfig(root=root, cache_dir=tmp))
    return root, index.train + index.val


def _time_dataset(ds, clips: int) -> tuple[float, float]:
    """(clips/s, first clip s) reading ds[i] in this process."""
    t0 = time.perf_counter()
    ds[0]
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    for i in range(1, clips + 1):
        ds[i % len(ds)]
    return clips / (time.perf_counter() - t1), first


def _time_loader(ds, *, workers: int, batch_size: int, clips: int) -> tuple[float, float]:
    """(clips/s after the first batch, seconds to the first batch incl. worker start)."""
    from datasets.video import build_loader

    loader = build_loader(ds, batch_size=batch_size, train=True, num_workers=workers, pin_memory=False)
    done, first, t0, t1 = 0, 0.0, time.perf_counter(), 0.0
    while done < clips:
        for x, _ in loader:
            if not first:
                first, t1 = time.perf_counter() - t0, time.perf_counter()
                continue      # the first batch pays for worker start-up: reported apart
            done += len(x)
            if done >= clips:
                break
    rate = done / (time.perf_counter() - t1)
    del loader                # stops persistent workers before the next measurement
    return rate, first


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke_test:
        args.videos, args.sizes, args.frames, args.clips, args.workers = 8, [64], [8], 8, [0, 1]
    _check_args(args)
    from datasets.video import VideoClipDataset

    with tempfile.TemporaryDirectory(prefix="vidtune-bench-") as tmp:
        root, videos = _videos(args, tmp)
        rows = []
        for size in args.sizes:
            for t in args.frames:
                ds = VideoClipDataset(videos, num_frames=t, frame_stride=args.frame_stride,
                                      height=size, width=size, train=True)
                rate, first = _time_dataset(ds, args.clips)
                rows.append((size, t, "Dataset[i] loop", rate, first))
                for w in args.workers:
                    rate, first = _time_loader(ds, workers=w, batch_size=args.batch_size, clips=args.clips)
                    rows.append((size, t, f"DataLoader, {w} worker{'s' if w != 1 else ''}", rate, first))
                print(f"  measured {size} px, T={t}", file=sys.stderr, flush=True)
        src = {(v.width, v.height) for v in videos}
        print(format_table(rows, root=root, n=len(videos), sources=src, args=args))
    return 0


def format_table(rows, *, root: str, n: int, sources: set, args: argparse.Namespace) -> str:
    shown = ", ".join(f"{w}x{h}" for w, h in sorted(sources)[:3]) + (" ..." if len(sources) > 3 else "")
    lines = [
        f"\nClip loading on this machine ({os.cpu_count()} cores): {n} videos in {root} (stored {shown}), "
        f"stride {args.frame_stride}, batch {args.batch_size}, {args.clips} clips per row; "
        f"load average {os.getloadavg()[0]:.1f} (numbers are only comparable on an idle machine)\n",
        f"{'size':>5} {'T':>3}  {'reader':<24} {'clips/s':>8} {'first_s':>8}",
        "-" * 53,
    ]
    for size, t, what, rate, first in rows:
        lines.append(f"{size:>5} {t:>3}  {what:<24} {rate:>8.1f} {first:>8.2f}")
    lines.append("\nfirst_s: time to the first clip (Dataset) or batch (DataLoader: includes starting its workers).")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
