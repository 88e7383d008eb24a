"""Choosing the search's defaults by leave-one-table-out (issue 29): every candidate strategy is
replayed on every recorded table; for each table in turn, the candidate that does best on the
*other* tables is picked and judged on the one left out, so a default is only trusted on data it
was not chosen on. The default the tool ships is the pick over all tables, and it must meet both
goals on each of them.

The goals (docs/search-defaults.md, checked by tests/test_search_quality.py): within 1 point
of the grid's best seed-mean final val_acc by `GOAL_TIME` of the grid's device time (median over
replay seeds), and at 30 % of the grid's time at least as good as random + ASHA in `GOAL_BEATS`
of the seeds.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from bench.common import format_table

GOAL_TIME = 0.30          # median time to within 1 point, share of the grid's device time
GOAL_BEATS = 0.75         # share of seeds at least as good as random + ASHA at 30 %
BASELINES = ("grid", "random", "random+asha", "default", "before")


@dataclass(frozen=True)
class Score:
    """One strategy on one table: median time to within 1 point (share of the grid's; inf when
    the median seed never got there), share of seeds at least as good as random + ASHA at 30 %,
    share of seeds that got within 1 point at all."""

    time: float
    beats: float
    reached: float

    @property
    def met(self) -> bool:
        return self.time <= GOAL_TIME and self.beats >= GOAL_BEATS


def score(entry: dict[str, Any]) -> Score:
    t = entry["time_to_1pt_vs_grid"]["median"]
    return Score(t if t is not None and math.isfinite(t) else math.inf,
                 entry.get("beats_random_asha_at_30%") or 0.0, entry["reached_share"])


def scores(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Score]]:
    """strategy -> table -> Score, for the strategies every table's summary holds."""
    names = set.intersection(*(set(s["strategies"]) for s in summaries.values()))
    return {n: {t: score(s["strategies"][n]) for t, s in summaries.items()} for n in sorted(names)}


def rank_key(by_table: dict[str, Score], tables: list[str]) -> tuple[float, ...]:
    """How a candidate ranks on `tables` (smaller is better): most tables where both goals are met,
    then most tables where it is at least as good as random + ASHA at 30 % in `GOAL_BEATS` of the
    seeds, then the worst median time to within 1 point, then the worst share of seeds that got
    within 1 point at all (what tells candidates apart where the median seed never gets there),
    then the worst share against random + ASHA, then the mean time."""
    picked = [by_table[t] for t in tables]
    return (-sum(s.met for s in picked), -sum(s.beats >= GOAL_BEATS for s in picked),
            max(s.time for s in picked), -min(s.reached for s in picked), -min(s.beats for s in picked),
            statistics.fmean(min(s.time, 10.0) for s in picked))


def candidates(table_scores: dict[str, dict[str, Score]]) -> list[str]:
    return [n for n in table_scores if n not in BASELINES]


def pick(table_scores: dict[str, dict[str, Score]], tables: list[str]) -> str:
    """The candidate that ranks best on `tables` (ties: the earlier in the candidate list)."""
    names = candidates(table_scores)
    return min(names, key=lambda n: (rank_key(table_scores[n], tables), names.index(n)))


def leave_one_out(table_scores: dict[str, dict[str, Score]]) -> list[dict[str, Any]]:
    """Per table: the candidate picked on the others, and how it does on the one left out."""
    tables = list(next(iter(table_scores.values())))
    rows = []
    for held in tables:
        chosen = pick(table_scores, [t for t in tables if t != held])
        s = table_scores[chosen][held]
        rows.append({"held_out": held, "chosen": chosen, "time": s.time, "beats": s.beats,
                     "reached": s.reached, "met": s.met})
    return rows


def choose(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The leave-one-table-out rows, the pick over all tables and its scores, and every
    candidate's worst case."""
    table_scores = scores(summaries)
    tables = list(summaries)
    overall = pick(table_scores, tables)
    return {"tables": tables, "leave_one_out": leave_one_out(table_scores), "chosen": overall,
            "chosen_scores": {t: vars(s) for t, s in table_scores[overall].items()},
            "chosen_meets_goals_everywhere": all(s.met for s in table_scores[overall].values()),
            "candidates": {n: {"met_on": sum(s.met for s in by.values()),
                               "worst_time": max(s.time for s in by.values()),
                               "worst_beats": min(s.beats for s in by.values()),
                               "worst_reached": min(s.reached for s in by.values()),
                               "per_table": {t: vars(s) for t, s in by.items()}}
                           for n, by in table_scores.items()}}


def _pct(v: float) -> str:
    return f"{v:.0%}" if math.isfinite(v) else "never"


def candidates_table(result: dict[str, Any]) -> str:
    """One row per strategy, best first: per table median time / share >= random + ASHA, and the
    worst case."""
    tables = result["tables"]
    order = sorted(result["candidates"], key=lambda n: rank_key(
        {t: Score(**v) for t, v in result["candidates"][n]["per_table"].items()}, tables))
    rows = []
    for name in order:
        c = result["candidates"][name]
        cells = [f"{_pct(c['per_table'][t]['time'])} / {c['per_table'][t]['beats']:.0%}" for t in tables]
        rows.append([name, *cells, f"{c['met_on']}/{len(tables)}", _pct(c["worst_time"]),
                     f"{c['worst_beats']:.0%}", f"{c['worst_reached']:.0%}"])
    return format_table(["strategy", *tables, "goals met", "worst time", "worst >=r+a", "worst reached"],
                        rows)


def loo_table(result: dict[str, Any]) -> str:
    rows = [[r["held_out"], r["chosen"], _pct(r["time"]), f"{r['beats']:.0%}", f"{r['reached']:.0%}",
             "yes" if r["met"] else "NO"] for r in result["leave_one_out"]]
    return format_table(["held-out table", "picked on the others", "time to 1 pt", ">= r+a @30%", "reached",
                         "goals met"], rows)
