"""Does the search earn its keep? Record a learning-curve table once, then replay searchers on it.

    python -m bench.search_quality record --data DIR --model tiny --out bench/tables/NAME.json \\
        --batch-sizes 4,8 --lr-min 3e-5 --lr-max 3e-2 --lr-points 7 --seeds 0,1 --epochs 6
    python -m bench.search_quality replay bench/tables/A.json bench/tables/B.json ... --seeds 20 \\
        --json out.json --plot out.png
    python -m bench.search_quality choose bench/tables/A.json bench/tables/B.json ... --seeds 50 \\
        --json choice.json
    python -m bench.search_quality record --data DIR --out t.json --quick   # 2 runs x 2 epochs: a check
    python -m bench.search_quality replay t.json --quick                     # 2 replay seeds

`record` trains the grid with the project's own loop outside Ray (`bench.sq_record`); `replay`
drives the searcher and scheduler `tune/study/space.py` builds against that table with a simulated
clock (`bench.sq_replay`), one strategy per line (`bench.sq_strategies`), and prints, per table,
the device time to come within 1 point of the best (`bench.sq_report`), then the default's
worst table; `choose` ranks the candidates by leave-one-table-out (`bench.sq_choose`).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import multiprocessing
import os
import signal
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import torch
from tqdm import tqdm

from bench.common import write_json
from bench.sq_choose import (
    BASELINES,
    GOAL_BEATS,
    GOAL_TIME,
    candidates,
    candidates_table,
    choose,
    loo_table,
    scores,
)
from bench.sq_record import Grid, header_for, log_grid, prepare, record
from bench.sq_replay import Trace
from bench.sq_report import console_table, grid_table, one_seed_warning, pct, plot_tables, summarise
from bench.sq_strategies import GROUPS, Strategy, run_strategy, strategies
from bench.sq_table import Table

# A trial's start and end as the search paid them on 2 CPU cores (`bench.search_overhead
# --trial-seconds 10`, 2026-12-01): trial start -> first epoch 8.4 s, plus last epoch -> trial end
# 1.6 s, less the plain run's 0.3 s.
START_COST_S = 9.7
PLOTTED = "grid,random,random+asha,issue17,default"
PR_SET_PDEATHSIG = 1        # linux/prctl.h
QUICK_STRATEGIES = ("grid", "random", "random+asha", "default", "share=.4")   # `choose` needs a candidate


@dataclass
class Replayed:
    """One table's replays: its strategies' traces and their summary (`bench.sq_report.summarise`)."""

    path: str
    table: Table
    traces: dict[str, list[Trace]]
    grid_s: float
    summary: dict[str, Any]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.search_quality", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="train the grid and write the learning-curve table")
    r.add_argument("--data", required=True, help="dataset folder (e.g. from vidtune synth)")
    r.add_argument("--model", default="tiny", help="model name (default tiny)")
    r.add_argument("--out", required=True, help="the table (JSON); an existing one is continued")
    r.add_argument("--batch-sizes", type=_ints, default=(4, 8), help="batch sizes (default 4,8)")
    r.add_argument("--lr-min", type=float, default=3e-5, help="smallest learning rate of the grid")
    r.add_argument("--lr-max", type=float, default=3e-2, help="largest learning rate of the grid")
    r.add_argument("--lr-points", type=int, default=7, help="log-spaced learning rates (default 7)")
    r.add_argument("--add-lrs", type=_floats, default=(), metavar="LR,LR,..",
                   help="learning rates added to the log-spaced ones, e.g. between two grid points around "
                   "a narrow top (with --reuse of the coarser table, only they are trained)")
    r.add_argument("--seeds", type=_ints, default=(0, 1), help="training seeds per config (default 0,1)")
    r.add_argument("--epochs", type=int, default=6, help="epochs per run (default 6)")
    r.add_argument("--threads", type=int, default=2, help="torch threads per run (default 2)")
    r.add_argument("--jobs", type=int, default=1,
                   help="runs trained at once, each in its own process (default 1); e.g. --jobs 2 "
                   "--threads 1 on 2 cores")
    r.add_argument("--reuse", default=None, metavar="TABLE",
                   help="copy the runs of this earlier table (same model, training config, epochs "
                   "and dataset) that belong to the new grid instead of training them again")
    r.add_argument("--loader-workers", type=int, default=1, help="DataLoader processes (default 1)")
    r.add_argument("--cache-dir", default=None, help="clip cache folder (default the project's)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--quick", action="store_true",
                   help="a tiny grid to check the command runs: batch size 4, 2 learning rates "
                   "(--lr-min, --lr-max), seed 0, 2 epochs")
    p_ = sub.add_parser("replay", help="replay the strategies against recorded tables")
    p_.add_argument("tables", nargs="+", metavar="TABLE", help="table JSONs from `record`")
    _replay_flags(p_)
    p_.add_argument("--json", default=None, help="write the per-table summaries, ratios and worst case here")
    p_.add_argument("--plot", default=None,
                    help="write the best-so-far picture (PNG, a panel per table) here")
    c = sub.add_parser("choose", help="pick the defaults by leave-one-table-out over recorded tables")
    c.add_argument("tables", nargs="+", metavar="TABLE", help="table JSONs from `record` (two or more)")
    _replay_flags(c)
    c.add_argument("--json", default=None, help="write every candidate's scores and the picks here")
    return p


def _replay_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, default=20, help="replay seeds per strategy (default 20)")
    p.add_argument("--concurrency", type=int, default=1, help="trials at once (default 1)")
    p.add_argument("--start-cost-s", type=float, default=START_COST_S,
                   help=f"device seconds each trial pays once to start (default {START_COST_S})")
    p.add_argument("--only", default=None, help="comma-separated strategy names (default all of --group)")
    p.add_argument("--group", choices=GROUPS, default=GROUPS[-1],
                   help="the candidates beside the baselines: issue17's or issue29's (default issue29)")
    p.add_argument("--times", choices=("per-batch", "recorded"), default="per-batch",
                   help="epoch seconds: the median per batch size and epoch (default), or each run's own")
    p.add_argument("--plot-strategies", default=PLOTTED,
                   help=f"comma-separated strategies drawn in the picture (default {PLOTTED})")
    p.add_argument("--target-points", type=float, default=1.0,
                   help="how close to the best seed-mean final val_acc counts as found, in points "
                   "(default 1)")
    p.add_argument("--jobs", type=int, default=1, help="processes replaying at once (default 1)")
    p.add_argument("--quick", action="store_true",
                   help=f"2 replay seeds of {', '.join(QUICK_STRATEGIES)} (unless --only), to check the "
                   "command runs")


class InputError(Exception):
    """A file given to `replay` or `choose` that they cannot read; the message names it."""


def read_inputs(paths: Sequence[str], *, replays: bool) -> dict[str, dict[str, Any]]:
    """Each path's JSON, once it is known to be a whole table from `record` (or, with `replays`, a
    JSON from `replay --json`); else InputError naming the file and what to pass instead. Checked
    before any replay starts, so a wrong file costs nothing."""
    wanted = "a table from `record`" + (" or a JSON from `replay --json`" if replays else "")
    docs = {}
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except OSError as e:
            raise InputError(f"{path}: cannot read it ({e.strerror}); pass {wanted}") from e
        except ValueError as e:
            raise InputError(f"{path}: not JSON ({e}); pass {wanted}") from e
        if isinstance(doc, dict) and {"grid", "runs"} <= set(doc):
            try:
                Table(doc)
            except ValueError as e:
                raise InputError(f"{path}: {e}") from e
        elif not (replays and is_replay(doc)):
            raise InputError(f"{path}: this is not {wanted}{_what_it_is(doc)}")
        docs[path] = doc
    return docs


def _what_it_is(doc: Any) -> str:
    if is_replay(doc):
        return " but a `replay --json` output, which only `choose` takes"
    if isinstance(doc, dict) and "candidates" in doc:
        return " but a `choose --json` output"
    return ""


def is_replay(doc: Any) -> bool:
    """Whether `doc` is what `replay --json` writes: a summary per table, each naming its table."""
    tables = doc.get("tables") if isinstance(doc, dict) else None
    return isinstance(tables, dict) and bool(tables) and all(
        isinstance(t, dict) and "table" in t and "strategies" in t for t in tables.values())


def table_name(path: str) -> str:
    return Path(path).stem


def _replay_one(path: str, times: str, strategy: Strategy, seeds: int, concurrency: int,
                start_cost_s: float) -> list[Trace]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)   # not a line per study and trial
    table = Table.load(path, times=times)
    return [run_strategy(table, strategy, seed, concurrency=concurrency, start_cost_s=start_cost_s)
            for seed in range(seeds)]


def _die_with_parent(parent_pid: int) -> None:
    """A replay worker's initializer: the kernel sends it SIGTERM when the process that started it
    (`parent_pid`) dies, so a killed `replay` or `choose` (`kill PID`, not only Ctrl-C at a
    terminal, which reaches the whole process group) leaves no worker replaying on. A parent that
    died while this worker was still importing sends nothing, hence the check after. Linux only."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)


def replay_tables(args: argparse.Namespace) -> dict[str, Replayed]:
    """Every chosen strategy on every table, `args.seeds` seeds each (in `args.jobs` processes)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    only = args.only.split(",") if args.only else None
    chosen = [s for s in strategies(args.group) if only is None or s.name in only]
    jobs = [(path, s) for path in args.tables for s in chosen]
    traces: dict[str, dict[str, list[Trace]]] = {table_name(p): {} for p in args.tables}
    bar = tqdm(total=len(jobs), desc="replay", unit="strategy")
    if args.jobs <= 1:
        for path, s in jobs:
            traces[table_name(path)][s.name] = _replay_one(path, args.times, s, args.seeds, args.concurrency,
                                                           args.start_cost_s)
            bar.update(1)
    else:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
            futures = {pool.submit(_replay_one, path, args.times, s, args.seeds, args.concurrency,
                                   args.start_cost_s): (path, s) for path, s in jobs}
            for future in as_completed(futures):
                path, s = futures[future]
                traces[table_name(path)][s.name] = future.result()
                bar.update(1)
    bar.close()
    out = {}
    for path in args.tables:
        name = table_name(path)
        table = Table.load(path, times=args.times)
        grid_s = table.grid_seconds(args.start_cost_s) / args.concurrency
        ordered = {s.name: traces[name][s.name] for s in chosen}
        out[name] = Replayed(path, table, ordered, grid_s,
                             summarise(table, ordered, grid_s, points=args.target_points / 100))
    return out


def replay_main(args: argparse.Namespace) -> int:
    replayed = replay_tables(args)
    for r in replayed.values():
        t = r.table
        print(f"table {r.path}: {len(t.configs)} configs x {len(t.seeds)} seeds x {t.epochs} epochs; best "
              f"seed-mean final val_acc {t.best_final_mean:.3f}; grid {r.grid_s:.0f} s (concurrency "
              f"{args.concurrency}); {args.seeds} replay seeds")
        print(grid_table(t))
        print()
        print(console_table(r.summary))
        warning = one_seed_warning(r.summary)
        if warning:
            print(f"note: {warning}")
        print()
    doc = {"seeds": args.seeds, "concurrency": args.concurrency, "start_cost_s": args.start_cost_s,
           "target_points": args.target_points,
           "tables": {name: {"table": r.path, **r.summary} for name, r in replayed.items()}}
    ratios = {name: r.summary["ratios"] for name, r in replayed.items() if "ratios" in r.summary}
    if ratios:
        doc["ratios"] = ratios
        doc["worst"] = worst_case(ratios)
        for name, r in ratios.items():
            print(f"default on {name}: within {args.target_points:g} point(s) at "
                  f"{pct(_finite(r['default_time_to_1pt_vs_grid']))} of the grid's time (median; goal <= "
                  f"{GOAL_TIME:.0%}); >= random+asha at 30% in {r['default_beats_random_asha']:.0%} of seeds "
                  f"(goal >= {GOAL_BEATS:.0%})")
        w = doc["worst"]
        print(f"worst table: {pct(_finite(w['default_time_to_1pt_vs_grid']))} ({w['time_table']}), "
              f"{w['default_beats_random_asha']:.0%} ({w['beats_table']})")
    if args.json:
        write_json(args.json, doc)
    if args.plot:
        plot_tables([(name, r.table, r.traces, r.grid_s) for name, r in replayed.items()], args.plot,
                    names=[n for n in args.plot_strategies.split(",")], points=args.target_points / 100)
    return 0


def _finite(v: float | None) -> float:
    return math.inf if v is None else v


def worst_case(ratios: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The default's worst table for each goal: the longest median time to within 1 point (None,
    never, counts as the longest) and the smallest share of seeds against random + ASHA."""
    slow = max(ratios, key=lambda n: _finite(ratios[n]["default_time_to_1pt_vs_grid"]))
    weak = min(ratios, key=lambda n: ratios[n]["default_beats_random_asha"])
    return {"default_time_to_1pt_vs_grid": ratios[slow]["default_time_to_1pt_vs_grid"], "time_table": slow,
            "default_beats_random_asha": ratios[weak]["default_beats_random_asha"], "beats_table": weak}


def choose_main(args: argparse.Namespace) -> int:
    """Replay the recorded tables among `args.tables`; a replay JSON (`replay --json`) among them
    gives its tables' summaries instead (replayed earlier, e.g. one table at a time)."""
    docs = read_inputs(args.tables, replays=True)
    earlier = {p: d for p, d in docs.items() if is_replay(d)}
    paths = {table_name(p): p for p in args.tables if p not in earlier}
    names = set(paths) | {name for d in earlier.values() for name in d["tables"]}
    if len(names) < 2:
        raise InputError(f"{', '.join(args.tables)}: {len(names)} table by name; leave-one-table-out "
                         "needs two or more")
    fresh = argparse.Namespace(**{**vars(args), "tables": list(paths.values())})
    summaries = {name: r.summary for name, r in (replay_tables(fresh) if paths else {}).items()}
    for d in earlier.values():
        for name, summary in d["tables"].items():
            summaries[name] = summary
            paths[name] = summary["table"]
    if not candidates(scores(summaries)):
        raise InputError(f"{', '.join(args.tables)}: no candidate strategy replayed on every table "
                         f"(the baselines {', '.join(BASELINES)} are not candidates); replay without --only")
    result = choose(summaries)
    print(candidates_table(result))
    print()
    print(loo_table(result))
    print(f"\npicked over all tables: {result['chosen']} (both goals on every table: "
          f"{'yes' if result['chosen_meets_goals_everywhere'] else 'NO'})")
    if args.json:
        write_json(args.json, {"seeds": args.seeds, "concurrency": args.concurrency,
                               "start_cost_s": args.start_cost_s, "goal_time": GOAL_TIME,
                               "goal_beats": GOAL_BEATS,
                               "table_paths": paths, **result})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.quick and args.command == "record":
        args.batch_sizes, args.lr_points, args.add_lrs, args.seeds, args.epochs = (4,), 2, (), (0,), 2
    elif args.quick:     # the GP strategies alone take minutes: the baselines and the default only
        args.seeds, args.only = 2, args.only or ",".join(QUICK_STRATEGIES)
    if args.command == "record":
        torch.set_num_threads(args.threads)
        base, index = prepare(args.data, args.model, loader_workers=args.loader_workers,
                              cache_dir=args.cache_dir)
        lrs = tuple(sorted(set(log_grid(args.lr_min, args.lr_max, args.lr_points)) | set(args.add_lrs)))
        grid = Grid(args.batch_sizes, lrs, args.seeds,
                    args.epochs)
        header = header_for(args.data, index, ["python -m bench.search_quality", *argv], args.threads,
                            jobs=args.jobs)
        table = record(base, index, grid, args.out, header=header, progress=not args.no_progress,
                       reuse=args.reuse, jobs=args.jobs, threads=args.threads)
        print(f"{len(table['runs'])} runs in {args.out}")
        return 0
    try:
        if args.command == "replay":
            read_inputs(args.tables, replays=False)
            return replay_main(args)
        return choose_main(args)
    except InputError as e:
        print(f"python -m bench.search_quality {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
