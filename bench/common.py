"""Helpers shared by the benchmarks: text tables, `--json` output (with the machine's facts),
whether this checkout has a module, and the length of a union of time intervals."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def has_module(name: str) -> bool:
    """`name` exists in this checkout, not only in another one installed in editable mode (whose
    import hook answers for the modules this checkout lacks, e.g. when benchmarking an older commit)."""
    spec = importlib.util.find_spec(name)
    return (spec is not None and spec.origin is not None
            and Path(spec.origin).resolve().is_relative_to(REPO_ROOT))


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell: floats with `digits` decimals, NaN/None as '-', anything else as str."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, digits: int = 1) -> str:
    """Fixed-width text table: the first column left-aligned, the others right-aligned."""
    cells = [[fmt(v, digits) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h))
              for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        first, rest = values[0], values[1:]
        right = (f"{v:>{w}}" for v, w in zip(rest, widths[1:], strict=False))
        return "  ".join([f"{first:<{widths[0]}}", *right]).rstrip()

    return "\n".join([line([str(h) for h in headers]), "  ".join("-" * w for w in widths), *map(line, cells)])


def _plain_json(value: Any) -> Any:
    """NaN and inf become null (strict JSON readers reject them); tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    return value


def write_json(path: str | Path, doc: dict[str, Any]) -> Path:
    """Write `doc` (plus `machine`: host facts) as indented strict JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {**doc, "machine": machine_facts()}
    path.write_text(json.dumps(_plain_json(doc), indent=2) + "\n")
    return path


def machine_facts() -> dict[str, Any]:
    """What a reader needs to compare two JSON files: cores, load, Python, git commit."""
    try:
        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=5).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                                     "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=5).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "python": platform.python_version(),
            "platform": platform.platform(), "git_commit": commit, "git_dirty": dirty}


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """`(start, end)` intervals as disjoint ones in order, overlapping or touching ones joined
    (empty ones dropped)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by `(start, end)` intervals (overlaps counted once; empty ones ignored)."""
    return sum(end - start for start, end in merge_intervals(intervals))


def max_overlap(intervals: Iterable[tuple[float, float]]) -> int:
    """The most `(start, end)` intervals open at one moment (an end at t closes before a start at t)."""
    spans = [(s, e) for s, e in intervals if e > s]
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    most = open_now = 0
    for _, step in events:
        open_now += step
        most = max(most, open_now)
    return most
