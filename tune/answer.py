"""How sure a search's result is, and the one or two sentences a person acts on.

An accuracy measured on n validation clips is a proportion: its 95% interval is Wilson's score
interval (Wilson, 1927), which stays inside [0, 1] and is right for small n, unlike the normal
approximation. `answer_lines` turns the ranked trials into the sentences that open the console's
last block and the MLflow parent run's description: the best trial; a faster trial that is as
good within the uncertainty, when it uses another batch size; what one validation clip is worth;
a warning when the best value of a parameter sits at the edge of its searched range, or when the
top trials cannot be told apart.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tune.results import TrialRow, objective_key, ranked, usable

Z_95 = 1.959964   # the standard normal's 97.5% quantile: a two-sided 95% interval
# The best lr is "at the edge" within this share of the searched log-range from either end: a
# TPE search samples the ends rarely, so a best trial this close to one says the range is cut.
LR_EDGE_SHARE = 0.1


def wilson_interval(correct: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of `correct` successes in `n` trials: (low, high) in [0, 1].
    n = 0 gives (0, 1): nothing is known."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= correct <= n:
        raise ValueError(f"correct={correct} must be between 0 and n={n}")
    p = correct / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def accuracy_interval(acc: float, n: int) -> tuple[float, float]:
    """The 95% interval of an accuracy `acc` measured on `n` clips (it is round(acc * n) correct);
    (nan, nan) for a missing accuracy or no clips."""
    if not math.isfinite(acc) or n <= 0:
        return math.nan, math.nan
    return wilson_interval(min(n, max(0, round(acc * n))), n)


def half_width(acc: float, n: int) -> float:
    """Half the width of `accuracy_interval`: the `±` shown beside an accuracy (nan when none)."""
    low, high = accuracy_interval(acc, n)
    return (high - low) / 2


def format_accuracy(acc: float, n: int, digits: int = 3) -> str:
    """`0.750 ±0.15` (the accuracy and its 95% half-width), `0.750` when n is unknown (0), `-`
    when there is no accuracy."""
    if not math.isfinite(acc):
        return "-"
    if n <= 0:
        return f"{acc:.{digits}f}"
    return f"{acc:.{digits}f} ±{half_width(acc, n):.2f}"


@dataclass(frozen=True)
class SearchedRange:
    """What the search tried, to tell when the best value sits at an edge: the lr bounds
    (`--lr-min`, `--lr-max`) and the batch sizes offered (`--batch-sizes`)."""

    lr_min: float
    lr_max: float
    batch_sizes: tuple[int, ...]


def _trial(r: TrialRow) -> str:
    return f"{r.label} (batch {r.batch_size}, lr {r.lr:.2e})"


def _edge_warnings(best: TrialRow, searched: SearchedRange) -> list[str]:
    out = []
    if searched.lr_max > searched.lr_min > 0 and math.isfinite(best.lr) and best.lr > 0:
        span = math.log(searched.lr_max / searched.lr_min)
        where = math.log(best.lr / searched.lr_min) / span
        if where <= LR_EDGE_SHARE:
            out.append(f"The best lr ({best.lr:.2e}) is at the lower edge of the searched range "
                       f"({searched.lr_min:.2e} to {searched.lr_max:.2e}): a smaller one may be better; "
                       "lower --lr-min.")
        elif where >= 1 - LR_EDGE_SHARE:
            out.append(f"The best lr ({best.lr:.2e}) is at the upper edge of the searched range "
                       f"({searched.lr_min:.2e} to {searched.lr_max:.2e}): a larger one may be better; "
                       "raise --lr-max.")
    sizes = sorted(set(searched.batch_sizes))
    if len(sizes) >= 3 and best.batch_size in (sizes[0], sizes[-1]):
        side = "smallest" if best.batch_size == sizes[0] else "largest"
        out.append(f"The best batch size ({best.batch_size}) is the {side} one searched: add "
                   f"{'smaller' if side == 'smallest' else 'larger'} sizes to --batch-sizes.")
    return out


def answer_lines(rows: Sequence[TrialRow], *, objective: str, val_clips: int,
                 searched: SearchedRange | None = None) -> list[str]:
    """The sentences that open a search's summary, most important first ([] without a usable
    trial). `val_clips`: the validation set's size (0 when unknown: no intervals); `searched`:
    the searched ranges (None: no edge warning)."""
    key = objective_key(objective)
    pool = [r for r in ranked(usable(rows), objective) if math.isfinite(getattr(r, key))]
    if not pool:
        return []
    best = pool[0]
    speed = f", {best.clips_per_s:.1f} clips/s" if math.isfinite(best.clips_per_s) else ""
    score = f"val_acc {format_accuracy(best.val_acc, val_clips)}"
    if key != "val_acc":   # the interval is an accuracy's (a proportion of clips); F1 has none here
        score = f"{key} {getattr(best, key):.3f}, {score}"
    lines = [f"Best: {_trial(best)}, {score} at epoch {best.best_epoch or best.epochs}{speed}."]
    low, _ = accuracy_interval(best.val_acc, val_clips)
    # Within the uncertainty: its accuracy is inside the best one's 95% interval.
    close = [r for r in pool[1:] if math.isfinite(low) and r.val_acc >= low]
    faster = [r for r in close if r.batch_size != best.batch_size and math.isfinite(r.clips_per_s)
              and math.isfinite(best.clips_per_s) and r.clips_per_s > best.clips_per_s]
    if faster:
        quick = max(faster, key=lambda r: r.clips_per_s)
        lines.append(f"{_trial(quick)} is as good within that uncertainty and "
                     f"{quick.clips_per_s / best.clips_per_s:.1f}x faster ({quick.clips_per_s:.1f} clips/s), "
                     f"giving up {best.val_acc - quick.val_acc:.3f} accuracy.")
    if val_clips > 0:
        lines.append(f"The validation set has {val_clips} clips: one clip is {100 / val_clips:.1f} points of "
                     "accuracy, and ± is the 95% interval; a bigger --val-fraction narrows it.")
    if close:
        lines.append(f"The top {len(close) + 1} trials are within the best one's uncertainty: their order is "
                     "not settled by this validation set.")
    if searched is not None:
        lines += _edge_warnings(best, searched)
    return lines
