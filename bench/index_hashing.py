"""What finding copies costs the index (datasets/duplicates.py): prints a table.

The index finds a video reached twice: hard links by inode (`os.stat`, no byte read), identical
copies by a content hash, computed only for files whose size another file shares and then kept
in the index cache. This script writes `--files` files of `--mb` MB of random bytes into a
temporary folder (page cache warm: every file is read once before timing) and times, per
`--repeats` rounds (medians):

- a plain read of every byte (1 MiB chunks): the floor of any pass over the bytes;
- `sha256` (the index's hash) and `blake2b` of every file;
- the index's duplicate search (`find_duplicates`) when every size is distinct (the usual dataset:
  nothing hashed), and when every file has the same size (the worst case: everything hashed),
  and the same worst case with the hashes in the cache.

    python -m bench.index_hashing                          # 32 files x 8 MB
    python -m bench.index_hashing --files 64 --mb 16 --json hashing.json
    python -m bench.index_hashing --quick                  # 4 files x 1 MB, 1 round: checks it runs
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import format_table, write_json
from vidtune.datasets import duplicates
from vidtune.datasets.records import VideoItem

CHUNK = duplicates.CHUNK_BYTES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=32, help="files in the folder (default 32)")
    p.add_argument("--mb", type=float, default=8.0, help="size of each file, MB (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of each case (default 3)")
    p.add_argument("--dir", default=None, help="where to write the files (default: a temporary folder)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the rows as JSON")
    p.add_argument("--quick", action="store_true",
                   help="under a second, to check the script runs: 4 files x 1 MB, 1 round")
    return p


def read_all(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(CHUNK):
                pass


def hash_all(paths: list[Path], name: str) -> None:
    for path in paths:
        digest = hashlib.new(name)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)


def dedupe(paths: list[Path], cache: dict[Path, str] | None = None) -> int:
    """The index's duplicate search over `paths` as one class of one split; returns files hashed."""
    items = [VideoItem(p, 0, "train") for p in paths]
    stats = {p: os.stat(p) for p in paths}
    known = cache or {}
    found = duplicates.find_duplicates(items, stats, place=lambda it: "train/x",
                                       cached_hash=lambda p, st: known.get(p))
    if cache is not None and not cache:
        cache.update(found.hashes)
    return found.hashed


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_files(folder: Path, files: int, size: int, *, same_size: bool) -> list[Path]:
    paths = []
    for i in range(files):
        path = folder / f"{'same' if same_size else 'distinct'}-{i:04d}.bin"
        n = size if same_size else size - i      # distinct sizes: one byte less each
        path.write_bytes(os.urandom(n))
        paths.append(path)
    return paths


def run(args: argparse.Namespace) -> list[dict]:
    size = int(args.mb * 1e6)
    with tempfile.TemporaryDirectory(prefix="vidtune-hashing-", dir=args.dir) as tmp:
        same = write_files(Path(tmp), args.files, size, same_size=True)
        distinct = write_files(Path(tmp), args.files, size, same_size=False)
        read_all(same + distinct)                   # warm the page cache
        total = sum(p.stat().st_size for p in same)
        cache: dict[Path, str] = {}
        dedupe(same, cache)
        cases = [("plain read of every byte", lambda: read_all(same), total),
                 ("sha256 of every file (the index's hash)", lambda: hash_all(same, "sha256"), total),
                 ("blake2b of every file", lambda: hash_all(same, "blake2b"), total),
                 ("index dedupe, distinct sizes (nothing hashed)", lambda: dedupe(distinct), 0),
                 ("index dedupe, one size (everything hashed)", lambda: dedupe(same), total),
                 ("index dedupe, one size, hashes cached", lambda: dedupe(same, cache), 0)]
        rows = []
        read_s = None
        for name, fn, hashed in cases:
            seconds = timed(fn, args.repeats)
            read_s = read_s or seconds
            rows.append({"case": name, "seconds": seconds, "bytes_hashed": hashed,
                         "gb_per_s": total / seconds / 1e9 if hashed or name.startswith("plain") else None,
                         "x_plain_read": seconds / read_s})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.files, args.mb, args.repeats = 4, 1.0, 1
    for flag, value in (("--files", args.files), ("--repeats", args.repeats)):
        if value < 1:
            raise SystemExit(f"{flag} {value}: must be >= 1")
    if args.mb <= 0:
        raise SystemExit(f"--mb {args.mb}: must be > 0")
    rows = run(args)
    print(f"{args.files} files x {args.mb:g} MB, page cache warm, median of {args.repeats}")
    print(format_table(["case", "s", "GB/s", "x plain read"],
                       [(r["case"], r["seconds"], r["gb_per_s"], r["x_plain_read"]) for r in rows], digits=3))
    if args.json:
        write_json(args.json, {"files": args.files, "mb": args.mb, "repeats": args.repeats,
                               "quick": args.quick, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
