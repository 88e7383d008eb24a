"""How fast clips come out of the data layer on this machine: prints tables of clips/s.

Decode table: for each decode size (H = W) and clip length T it measures
  - `VideoClipDataset[i]` called in a loop in this process (decord alone, no batching);
  - `build_loader(...)` with 0, 1, 2 ... DataLoader worker processes (what a training worker
    sees), steady state after the first batch, and the time to that first batch (worker start).
Use it to choose `loader_workers` and the decode size: a training step that takes longer per
clip than the loader delivers waits for data.

Clip cache table (`datasets.cache`): on a 240p and a 720p corpus (or --root), one thread, the same
clips (--cache-size, --cache-frames, stride --frame-stride) read by decord directly, through a
cold cache (decode the whole video + write the entry + read), a process's first read of each
written entry (checks the entry's crc32: reads its whole frames file) and a warm one (checked
before), for each format; then DataLoader throughput with 0, 1, 2 workers, warm cache vs decord;
and the disk cost per format.
`--json FILE` writes every row, the ratios (`warm_cache_vs_decord`: the warm cache in the format
a search on this machine stores (auto: raw on a CPU, jpeg with a GPU) vs decord on the first
corpus; the goal is >= 10) and the disk bytes per video and frame.

    python -m bench.data_loading                                  # synthetic data in a temp folder
    python -m bench.data_loading --root /data/RWF-2000 --sizes 112 224 --frames 16
    python -m bench.data_loading --quick                          # a few seconds, to check it runs
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from vidtune.datasets.config import DataConfig
from vidtune.datasets.index import build_index
from vidtune.datasets.synthetic import generate

REPO_ROOT = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=None,
                   help="dataset to read (any layout datasets.index knows); "
                        "default: generate a synthetic one")
    p.add_argument("--videos", type=int, default=48,
                   help="size of the generated synthetic dataset (default 48)")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 112, 224],
                   help="decode sizes H = W (default 64 112 224)")
    p.add_argument("--frames", type=int, nargs="+", default=[8, 16], help="clip lengths T (default 8 16)")
    p.add_argument("--frame-stride", type=int, default=2, help="take every k-th frame (default 2)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2],
                   help="DataLoader worker counts to compare (default 0 1 2)")
    p.add_argument("--batch-size", type=int, default=4, help="DataLoader batch size (default 4)")
    p.add_argument("--clips", type=int, default=48, help="clips timed per measurement (default 48)")
    p.add_argument("--cache-sources", type=int, nargs="+", default=[240, 720],
                   help="stored frame sides of the generated corpora for the cache table (default 240 720)")
    p.add_argument("--cache-videos", type=int, default=16,
                   help="videos in the first generated cache corpus; the others get a quarter, at least 4 "
                        "(default 16)")
    p.add_argument("--cache-size", type=int, default=224,
                   help="decode size H = W of the cache table (default 224)")
    p.add_argument("--cache-frames", type=int, default=16,
                   help="clip length T of the cache table (default 16)")
    p.add_argument("--formats", nargs="+", choices=["jpeg", "raw"], default=["jpeg", "raw"],
                   help="cache formats to measure (default jpeg raw)")
    p.add_argument("--tables", nargs="+", choices=["decode", "cache"], default=["decode", "cache"],
                   help="tables to measure (default both)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds of the warm cache and decord readers; the median is shown "
                        "(default 3)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the rows, ratios and disk costs here")
    p.add_argument("--quick", "--smoke-test", dest="quick", action="store_true",
                   help="tiny run to check the script works: 8 videos, size 64, T 8, 8 clips, workers 0 "
                        "and 1, cache table on the decode table's corpus only")
    return p


def _check_args(args: argparse.Namespace) -> None:
    checks = [("--videos", [args.videos], 4), ("--sizes", args.sizes, 16), ("--frames", args.frames, 1),
              ("--frame-stride", [args.frame_stride], 1), ("--workers", args.workers, 0),
              ("--batch-size", [args.batch_size], 1), ("--clips", [args.clips], 1),
              ("--cache-sources", args.cache_sources, 32), ("--cache-videos", [args.cache_videos], 4),
              ("--cache-size", [args.cache_size], 16), ("--cache-frames", [args.cache_frames], 1),
              ("--rounds", [args.rounds], 1)]
    for flag, values, least in checks:
        bad = [v for v in values if v < least]
        if bad:
            raise SystemExit(f"{flag} {bad[0]}: must be >= {least}")
    if args.root is not None and not Path(args.root).exists():
        raise SystemExit(f"--root {args.root}: no such file or folder; give a dataset folder or CSV "
                         "manifest")


def _videos(args: argparse.Namespace, tmp: str, *, size: int = 112, videos: int | None = None):
    """Videos (VideoInfo records) of --root, or of a freshly generated synthetic dataset."""
    n = videos or args.videos
    root = args.root or str(generate(Path(tmp) / f"synthetic-{size}-{n}", videos=n, size=size, seed=0,
                                     overwrite=True))
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
    from vidtune.datasets.video import build_loader  # imports torch: heavy (seconds), not for --help

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
    if args.quick:
        args.videos, args.sizes, args.frames, args.clips, args.workers = 8, [64], [8], 8, [0, 1]
        args.cache_size, args.cache_frames, args.rounds = 64, 8, 1
    _check_args(args)
    import torch  # heavy (seconds): --help and argument errors answer without it

    torch.set_num_threads(1)     # one core per reader, as in a DataLoader worker
    out: dict = {"rows": []}
    with tempfile.TemporaryDirectory(prefix="vidtune-bench-") as tmp:
        if "decode" in args.tables:
            out["rows"] += decode_table(args, tmp)
        if "cache" in args.tables:
            cache = cache_table(args, tmp)
            out["rows"] += cache.pop("rows")
            out.update(cache)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def decode_table(args: argparse.Namespace, tmp: str) -> list[dict]:
    """The decode table (decord, no cache): rows per decode size, T and reader; prints it."""
    from vidtune.datasets.video import VideoClipDataset  # imports torch: heavy (seconds), not for --help

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
    return [{"table": "decode", "size": size, "frames": t, "reader": what, "clips_per_s": rate,
             "first_s": first} for size, t, what, rate, first in rows]


def _corpora(args: argparse.Namespace, tmp: str) -> list[tuple[str, list]]:
    """(name, videos) of the cache table: --root, the decode table's corpus (--quick), or one
    generated corpus per --cache-sources side (the first with --cache-videos, the others fewer:
    rendering a 720 px video takes seconds)."""
    if args.root or args.quick:
        root, videos = _videos(args, tmp)
        sides = sorted({v.height for v in videos})
        return [(f"{sides[0]}p" if len(sides) == 1 else Path(root).name, videos)]
    out = []
    for k, side in enumerate(args.cache_sources):
        n = args.cache_videos if k == 0 else max(4, args.cache_videos // 4)
        print(f"  generating {n} synthetic videos at {side} x {side}", file=sys.stderr, flush=True)
        out.append((f"{side}p", _videos(args, tmp, size=side, videos=n)[1]))
    return out


def _time_reads(ds, order: list[int], min_s: float = 0.0) -> tuple[float, float]:
    """(clips per second, clips per CPU second of this process) reading ds[i] for i in `order`,
    the whole order repeated until `min_s` has passed. On a busy machine the second one still
    measures the cost of a clip; the first one also measures how much CPU the process got."""
    done, t0, c0 = 0, time.perf_counter(), time.process_time()
    while True:
        for i in order:
            ds[i]
        done += len(order)
        if time.perf_counter() - t0 >= min_s:
            return done / (time.perf_counter() - t0), done / max(time.process_time() - c0, 1e-9)


def _time_first_reads(make_dataset, order: list[int], min_s: float) -> tuple[float, float]:
    """`_time_reads` where every read is a process's first of its entry: each pass over `order`
    (one clip per video) reads through a new dataset and FrameCache (made outside the timing)."""
    done, wall, cpu = 0, 0.0, 0.0
    while wall < min_s or not done:
        ds = make_dataset()
        t0, c0 = time.perf_counter(), time.process_time()
        for i in order:
            ds[i]
        wall, cpu, done = (wall + time.perf_counter() - t0, cpu + time.process_time() - c0,
                           done + len(order))
    return done / wall, done / max(cpu, 1e-9)


def cache_table(args: argparse.Namespace, tmp: str) -> dict:
    """Decord vs the clip cache (cold and warm, per format) on each corpus, the same clips, one
    thread; DataLoader throughput warm vs decord on the first corpus; disk per format. Prints
    the table, returns {"rows", "ratios", "disk", "settings"}."""
    import torch  # heavy (seconds): not for --help

    from vidtune.datasets.cache import resolve_format  # imports torch: as above

    # The format a search on this machine would store (auto: jpeg when training on a GPU, else raw).
    default = resolve_format(DataConfig().clip_cache_format, on_gpu=torch.cuda.is_available())
    rows, loader_rows, disk, ratios = [], [], {}, {"default_format": default, "per_format": {}}
    for k, (corpus, videos) in enumerate(_corpora(args, tmp)):
        readers, caches, corpus_rows = _measure_corpus(args, tmp, corpus, videos)
        rows += corpus_rows
        by = {r["reader"]: r for r in corpus_rows}
        decord = by["decord"]
        for fmt, cache in caches.items():
            warm = by[f"{fmt} warm"]
            first = by[f"{fmt} first read (checks crc32)"]
            ratios["per_format"].setdefault(fmt, {})[corpus] = {
                "warm_vs_decord": warm["clips_per_s"] / decord["clips_per_s"],
                "warm_vs_decord_cpu": warm["clips_per_cpu_s"] / decord["clips_per_cpu_s"],
                "first_read_vs_decord": first["clips_per_s"] / decord["clips_per_s"],
                # CPU time a process's first read of an entry adds (meta.json, the crc32 check)
                "first_read_extra_ms": 1e3 * (1 / first["clips_per_cpu_s"] - 1 / warm["clips_per_cpu_s"])}
            used, frames = cache.usage_bytes(), sum(v.num_frames for v in videos)
            disk.setdefault(fmt, {})[corpus] = dict(bytes_per_video=used / len(videos),
                                                    bytes_per_frame=used / frames)
            if k == 0 and fmt == default:
                ratios["warm_cache_vs_decord"] = ratios["per_format"][fmt][corpus]["warm_vs_decord"]
                ratios["warm_cache_vs_decord_cpu"] = ratios["per_format"][fmt][corpus]["warm_vs_decord_cpu"]
                ratios["warm_cache_corpus"] = corpus
                ratios["first_read_vs_decord"] = ratios["per_format"][fmt][corpus]["first_read_vs_decord"]
                loader_rows = _loader_rows(args, corpus, readers["decord"], readers[f"{fmt} warm"], fmt)
        if "jpeg warm" in readers:
            ratios.setdefault("jpeg_mean_abs_error", _mean_abs_diff(readers["jpeg warm"], readers["decord"]))
        print(f"  measured the cache on {corpus}", file=sys.stderr, flush=True)
    rows += loader_rows
    for r in rows:
        r.update(table="cache", size=args.cache_size, frames=args.cache_frames)
    print(format_cache_table(rows, ratios, disk, args))
    settings = dict(size=args.cache_size, frames=args.cache_frames, stride=args.frame_stride, threads=1,
                    cores=os.cpu_count(), rounds=args.rounds)
    return {"rows": rows, "ratios": ratios, "disk": disk, "settings": settings}


def _measure_corpus(args: argparse.Namespace, tmp: str, corpus: str, videos: list):
    """Rows of one corpus: each cache cold (one pass, every read a miss), then every warm reader,
    each format's first reads (through a fresh FrameCache) and decord in `args.rounds`
    interleaved rounds (a change in the machine's load hits them all alike), each reporting its
    median round. Returns (readers by name, caches by format, rows)."""
    from vidtune.datasets.cache import FrameCache  # imports torch: heavy (seconds), not for --help
    from vidtune.datasets.video import VideoClipDataset  # imports torch: as above

    def dataset(cache=None, encoded=False):
        return VideoClipDataset(videos, num_frames=args.cache_frames, frame_stride=args.frame_stride,
                                height=args.cache_size, width=args.cache_size, train=True, cache=cache,
                                encoded=encoded)

    order = list(range(len(videos)))          # the same clips (epoch 0) for every reader
    readers, caches, cold = {"decord": dataset()}, {}, {}
    for fmt in args.formats:
        caches[fmt] = FrameCache(Path(tmp) / f"clips-{corpus}-{fmt}", format=fmt, max_gb=1000)
        readers[f"{fmt} warm"] = dataset(caches[fmt])
        cold[fmt] = _time_reads(readers[f"{fmt} warm"], order)
        if fmt == "jpeg":   # what a loader worker does when the device decodes (encoded=True)
            readers["jpeg warm, bytes only (device decodes)"] = dataset(caches[fmt], encoded=True)
    rounds: dict[str, list] = {name: [] for name in readers}
    rounds.update({f"{fmt} first read (checks crc32)": [] for fmt in args.formats})
    for _ in range(args.rounds):
        for name, ds in readers.items():
            rounds[name].append(_time_reads(ds, order, min_s=0.5))
        for fmt in args.formats:    # the files are in the page cache: this is the CPU cost of checking
            fresh = lambda fmt=fmt: dataset(  # noqa: E731
                FrameCache(caches[fmt].root, format=fmt, max_gb=1000))
            rounds[f"{fmt} first read (checks crc32)"].append(_time_first_reads(fresh, order, min_s=0.5))
    rows = []

    def row(reader: str, rates: tuple[float, float]) -> None:
        rows.append(dict(corpus=corpus, reader=reader, clips_per_s=rates[0], clips_per_cpu_s=rates[1]))

    row("decord", tuple(statistics.median(r[i] for r in rounds["decord"]) for i in (0, 1)))
    for fmt in args.formats:
        row(f"{fmt} cold (decode all + write)", cold[fmt])
        warm = [n for n in readers if n.startswith(f"{fmt} warm")]
        for name in [f"{fmt} first read (checks crc32)"] + warm:
            row(name, tuple(statistics.median(r[i] for r in rounds[name]) for i in (0, 1)))
    return readers, caches, rows


def _mean_abs_diff(a, b, items: int = 4) -> float:
    """Mean abs difference (0..255) of the first clips of two datasets (jpeg loss vs decord)."""
    return float(np.mean([np.abs(a[i][0].numpy().astype(np.int16) - b[i][0].numpy()).mean()
                          for i in range(min(items, len(a)))]))


def _loader_rows(args: argparse.Namespace, corpus: str, decord_ds, cached_ds, fmt: str) -> list[dict]:
    rows = []
    clips = max(2 * args.clips, 2 * args.batch_size)
    for w in args.workers:
        for what, ds in (("decord", decord_ds), (f"{fmt} warm", cached_ds)):
            rate, first = _time_loader(ds, workers=w, batch_size=args.batch_size, clips=clips)
            rows.append(dict(corpus=corpus, reader=f"DataLoader {w}w, {what}", clips_per_s=rate,
                             first_s=first))
    return rows


def format_cache_table(rows: list[dict], ratios: dict, disk: dict, args: argparse.Namespace) -> str:
    decord = {r["corpus"]: r["clips_per_s"] for r in rows if r["reader"] == "decord"}
    decord_cpu = {r["corpus"]: r["clips_per_cpu_s"] for r in rows if r["reader"] == "decord"}
    loader_decord = {r["reader"].split(",")[0]: r["clips_per_s"] for r in rows
                     if r["reader"].endswith("decord")}
    lines = [f"\nClip cache ({args.cache_frames}-frame clips at {args.cache_size} x {args.cache_size}, "
             f"stride {args.frame_stride}, one thread; corpora are square synthetic videos, e.g. 240p = "
             f"240 x 240; load average {os.getloadavg()[0]:.1f})\n",
             f"{'corpus':<7} {'reader':<40} {'clips/s':>9} {'x decord':>9} {'cpu/s':>9} {'x decord':>9}",
             "-" * 88]
    for r in rows:
        loader = r["reader"].startswith("DataLoader")
        base = loader_decord[r["reader"].split(",")[0]] if loader else decord[r["corpus"]]
        line = f"{r['corpus']:<7} {r['reader']:<40} {r['clips_per_s']:>9.1f} {r['clips_per_s'] / base:>9.1f}"
        if not loader:
            line += f" {r['clips_per_cpu_s']:>9.1f} {r['clips_per_cpu_s'] / decord_cpu[r['corpus']]:>9.1f}"
        lines.append(line)
    lines.append("cpu/s: clips per CPU second of the reading process (the cost of a clip, even on a busy "
                 "machine);\nDataLoader rows: steady state after the first batch, vs decord with as many "
                 "workers.\n")
    for fmt, per in disk.items():
        lines.append(f"disk {fmt:<5} " + "; ".join(f"{c}: {d['bytes_per_video'] / 1e6:.2f} MB/video, "
                                                  f"{d['bytes_per_frame'] / 1e3:.1f} KB/frame"
                                                  for c, d in per.items()))
    if "warm_cache_vs_decord" in ratios:
        lines.append(f"warm {ratios['default_format']} cache vs decord ({ratios['warm_cache_corpus']}): "
                     f"{ratios['warm_cache_vs_decord']:.1f}x clips/s, "
                     f"{ratios['warm_cache_vs_decord_cpu']:.1f}x per CPU second (goal >= 10)")
    for fmt, per in ratios["per_format"].items():
        lines.append(f"first read of a {fmt} entry in a process (meta.json + crc32 of the frames file): "
                     + "; ".join(f"{c}: +{r['first_read_extra_ms']:.2f} ms CPU vs a warm read, "
                                 f"{r['first_read_vs_decord']:.1f}x decord" for c, r in per.items()))
    if "jpeg_mean_abs_error" in ratios:
        lines.append(f"jpeg frames vs decord: mean abs difference {ratios['jpeg_mean_abs_error']:.2f} "
                     "of 255")
    return "\n".join(lines)


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
    lines.append("\nfirst_s: time to the first clip (Dataset) or batch (DataLoader: includes starting its "
                 "workers).")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
