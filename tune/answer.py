"""How sure a search's result is, and the one or two sentences a person acts on.

`answer_lines` turns the ranked trials into the sentences that open the console's last block and
the MLflow parent run's description, with `tune.uncertainty`'s intervals (Wilson's, from the
validation clip count): the best trial; a faster trial that is as
good within the uncertainty, when it uses another batch size; what one validation clip is worth;
a warning when the best value of a parameter sits at the edge of its searched range, or when the
top trials cannot be told apart; a hint to train longer when most finished trials were best at
their last epoch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vidtune.tune.results import TrialRow, objective_key, ranked, usable
from vidtune.tune.uncertainty import accuracy_interval, format_accuracy

# The best lr is "at the edge" within this share of the searched log-range from either end: a
# TPE search samples the ends rarely, so a best trial this close to one says the range is cut.
LR_EDGE_SHARE = 0.1
MIN_EPOCHS_FOR_HINT = 3   # "raise --epochs" only about trials that trained this many epochs or more


@dataclass(frozen=True)
class SearchedRange:
    """What the search tried, to tell when the best value sits at an edge: the lr bounds
    (`--lr-min`, `--lr-max`) and the batch sizes offered (`--batch-sizes`)."""

    lr_min: float
    lr_max: float
    batch_sizes: tuple[int, ...]
    weight_decay: tuple[float, float] | None = None    # (min, max) when searched


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


def _epochs_hint(rows: Sequence[TrialRow]) -> list[str]:
    """A hint to train longer when most trials that ran every epoch (DONE) were best at their last
    one: their accuracy was still rising when training stopped (at least 2 such trials, so one
    lucky last epoch does not speak for the search, and 3 epochs or more: with 1 or 2 the last is
    the best by chance alone half the time or more)."""
    finished = [r for r in rows if r.status == "DONE" and r.epochs >= MIN_EPOCHS_FOR_HINT and r.best_epoch]
    at_last = [r for r in finished if r.best_epoch == r.epochs]
    if len(at_last) < 2 or 2 * len(at_last) <= len(finished):
        return []
    epochs = max(r.epochs for r in finished)
    return [f"{len(at_last)} of {len(finished)} trials that ran all {epochs} epochs were best at their last "
            "one: their accuracy was still rising; raise --epochs for a better model."]


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
                     "accuracy, and [low, high] is the 95% interval; more validation clips narrow it "
                     "(a bigger --val-fraction, or more videos in val/ for a dataset split into train/ "
                     "and val/).")
    if close:
        lines.append(f"The top {len(close) + 1} trials are within the best one's uncertainty: their order is "
                     "not settled by this validation set.")
    if searched is not None:
        lines += _edge_warnings(best, searched)
    return lines + _epochs_hint(rows)
