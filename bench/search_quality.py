"""Does the search earn its keep? Record a learning-curve table once, then replay searchers on it.

    python -m bench.search_quality record --data DIR --model tiny --out bench/tables/NAME.json \\
        --batch-sizes 4,8 --lr-min 3e-5 --lr-max 3e-2 --lr-points 7 --seeds 0,1 --epochs 6
    python -m bench.search_quality replay bench/tables/NAME.json --seeds 20 --json out.json --plot out.png

`record` trains the grid with the project's own loop outside Ray (`bench.sq_record`); `replay`
drives the searcher and scheduler `tune/space.py` builds against that table with a simulated
clock (`bench.sq_replay`), one strategy per line (`bench.sq_strategies`), and prints the table
of device time to come within 1 point of the best (`bench.sq_report`).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import optuna
import torch
from tqdm import tqdm

from bench.common import write_json
from bench.sq_record import Grid, header_for, log_grid, prepare, record
from bench.sq_replay import Trace
from bench.sq_report import console_table, grid_table, pct, plot, summarise
from bench.sq_strategies import run_strategy, strategies
from bench.sq_table import Table

# A trial's start and end as the search pays them on 2 CPU cores (BENCHMARKS.md "A search's cost
# around the same trainings", the default table): trial start -> first epoch 8.4 s, plus the
# last epoch -> trial end 1.6 s less the plain run's 0.3 s.
START_COST_S = 9.7
PLOTTED = "grid,random,random+asha,before,default"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


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
    p_ = sub.add_parser("replay", help="replay the strategies against a recorded table")
    p_.add_argument("table", help="the table JSON from `record`")
    p_.add_argument("--seeds", type=int, default=20, help="replay seeds per strategy (default 20)")
    p_.add_argument("--concurrency", type=int, default=1, help="trials at once (default 1)")
    p_.add_argument("--start-cost-s", type=float, default=START_COST_S,
                    help=f"device seconds each trial pays once to start (default {START_COST_S})")
    p_.add_argument("--only", default=None, help="comma-separated strategy names (default all)")
    p_.add_argument("--times", choices=("per-batch", "recorded"), default="per-batch",
                    help="epoch seconds: the median per batch size and epoch (default), or each run's own")
    p_.add_argument("--plot-strategies", default=PLOTTED,
                    help=f"comma-separated strategies drawn in the picture (default {PLOTTED})")
    p_.add_argument("--target-points", type=float, default=1.0,
                    help="how close to the best seed-mean final val_acc counts as found, in points "
                    "(default 1)")
    p_.add_argument("--json", default=None, help="write the summary (and ratios) here")
    p_.add_argument("--plot", default=None, help="write the best-so-far picture (PNG) here")
    return p


def replay_main(args: argparse.Namespace) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)   # not a line per study and trial
    table = Table.load(args.table, times=args.times)
    chosen = [s for s in strategies() if args.only is None or s.name in args.only.split(",")]
    grid_s = table.grid_seconds(args.start_cost_s) / args.concurrency
    traces: dict[str, list[Trace]] = {}
    for strategy in tqdm(chosen, desc="replay", unit="strategy"):
        traces[strategy.name] = [run_strategy(table, strategy, seed, concurrency=args.concurrency,
                                              start_cost_s=args.start_cost_s) for seed in range(args.seeds)]
    summary = summarise(table, traces, grid_s, points=args.target_points / 100)
    print(f"table {args.table}: {len(table.configs)} configs x {len(table.seeds)} seeds x {table.epochs} "
          f"epochs; best seed-mean final val_acc {table.best_final_mean:.3f}; grid {grid_s:.0f} s "
          f"(concurrency {args.concurrency}); {args.seeds} replay seeds")
    print(grid_table(table))
    print()
    print(console_table(summary))
    if "ratios" in summary:
        r = summary["ratios"]
        print(f"default: within {args.target_points:g} point(s) at {pct(r['default_time_to_1pt_vs_grid'])} "
              "of the grid's time "
              f"(median; goal <= 30%); >= random+asha at 30% in {r['default_beats_random_asha']:.0%} "
              "of seeds (goal >= 75%)")
    if args.json:
        write_json(args.json, {"table": args.table, "seeds": args.seeds, "concurrency": args.concurrency,
                               "start_cost_s": args.start_cost_s, **summary})
    if args.plot:
        plot(table, traces, grid_s, args.plot,
             names=[n for n in args.plot_strategies.split(",") if n in traces],
             points=args.target_points / 100)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "record":
        torch.set_num_threads(args.threads)
        base, index = prepare(args.data, args.model, loader_workers=args.loader_workers,
                              cache_dir=args.cache_dir)
        grid = Grid(args.batch_sizes, log_grid(args.lr_min, args.lr_max, args.lr_points), args.seeds,
                    args.epochs)
        header = header_for(args.data, index, ["python -m bench.search_quality", *argv], args.threads,
                            jobs=args.jobs)
        table = record(base, index, grid, args.out, header=header, progress=not args.no_progress,
                       reuse=args.reuse, jobs=args.jobs, threads=args.threads)
        print(f"{len(table['runs'])} runs in {args.out}")
        return 0
    return replay_main(args)


if __name__ == "__main__":
    sys.exit(main())
