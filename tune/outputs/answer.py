"""How sure a search's result is, and the one or two sentences a person acts on.

`answer_lines` turns the ranked trials into the sentences that open the console's last block and
the MLflow parent run's description, with `tune.outputs.uncertainty`'s intervals (Wilson's, from the
validation clip count): the best trial; a faster trial that is as
good within the uncertainty, when it uses another batch size and its speed gain is more than the
noise of a speed (`speed_noise`); what one validation clip is worth;
a warning when the best value of a parameter sits at the edge of its searched range, or when the
top trials cannot be told apart; a hint to train longer when most finished trials were best at
their last epoch.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from vidtune.trainer.training.report_keys import Key
from vidtune.tune.config import searched
from vidtune.tune.config.searched import Domain
from vidtune.tune.outputs.results import TrialResult, objective_key, ranked, usable
from vidtune.tune.outputs.uncertainty import accuracy_interval, format_accuracy

# The best value is "at the edge" within this share of a searched range (log-range for a log scale)
# from either end: a TPE search samples the ends rarely, so a best trial this close to one says the
# range is cut.
EDGE_SHARE = 0.1
MIN_EPOCHS_FOR_HINT = 3   # "raise --epochs" only about trials that trained this many epochs or more
# A faster trial is offered only when it is more than this much faster (and more than trials of one
# batch size differ by): two runs of one configuration differ by a few percent (other processes,
# the clip cache, the GPU's clocks), so a smaller gain is as likely noise as a real one.
MIN_SPEED_GAIN = 0.10


def _trial(r: TrialResult) -> str:
    """`t03 (batch 8, lr 2.50e-04)`: its name and its searched values, as the table shows them."""
    values = ", ".join(f"{p.column} {p.cell(r.value(p.name))}" for p in searched.PARAMS
                       if r.value(p.name) is not None)
    return f"{r.label} ({values})"


def speed_noise(rows: Sequence[TrialResult]) -> float:
    """How much two trials' speeds differ by chance: the largest spread of clips/s among trials of
    the same batch size (fastest / slowest - 1; a batch size's speed does not depend on its lr),
    at least MIN_SPEED_GAIN; MIN_SPEED_GAIN when no batch size has two trials with a speed."""
    speeds: dict[int, list[float]] = {}
    for r in usable(rows):
        if math.isfinite(r.clips_per_s) and r.clips_per_s > 0:
            speeds.setdefault(r.batch_size, []).append(r.clips_per_s)
    spreads = [max(s) / min(s) - 1 for s in speeds.values() if len(s) >= 2]
    return max([MIN_SPEED_GAIN, *spreads])


def _edge_warnings(best: TrialResult, domains: Mapping[str, Domain]) -> list[str]:
    """A warning per searched parameter whose best value sits at an edge of what was searched: a
    range's first or last EDGE_SHARE, or the smallest or largest of 3 or more choices."""
    out = []
    for d in domains.values():
        value, p = best.value(d.name), d.param
        if value is None:
            continue
        low_flag, _, high_flag = d.flags.partition("/")
        if p.is_choice:
            values = sorted(d.choices)
            if len(values) >= 3 and value in (values[0], values[-1]):
                side, more = ("smallest", "smaller") if value == values[0] else ("largest", "larger")
                out.append(f"The best {p.words} ({p.cell(value)}) is the {side} one searched: add {more} "
                           f"values to {low_flag or 'its choices'}.")
            continue
        where = d.position(value)
        if not math.isfinite(where) or EDGE_SHARE < where < 1 - EDGE_SHARE:
            continue
        lower = where <= EDGE_SHARE
        widen = (f"lower {low_flag}" if low_flag else "lower its minimum") if lower else \
            (f"raise {high_flag or low_flag}" if high_flag else "raise its maximum")
        out.append(f"The best {p.words} ({value:.2e}) is at the {'lower' if lower else 'upper'} edge of the "
                   f"searched range ({d.low:.2e} to {d.high:.2e}): a {'smaller' if lower else 'larger'} one "
                   f"may be better; {widen}.")
    return out


def _epochs_hint(rows: Sequence[TrialResult]) -> list[str]:
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


def answer_lines(rows: Sequence[TrialResult], *, objective: str, val_clips: int,
                 domains: Mapping[str, Domain] | None = None) -> list[str]:
    """The sentences that open a search's summary, most important first ([] without a usable
    trial). `val_clips`: the validation set's size (0 when unknown: no intervals); `domains`:
    what each parameter was drawn from (`tune.config.searched.domains`; None: no edge warning)."""
    key = objective_key(objective)
    pool = [r for r in ranked(usable(rows), objective) if math.isfinite(getattr(r, key))]
    if not pool:
        return []
    best = pool[0]
    speed = f", {best.clips_per_s:.1f} clips/s" if math.isfinite(best.clips_per_s) else ""
    score = f"val_acc {format_accuracy(best.val_acc, val_clips)}"
    if key != Key.VAL_ACC:   # the interval is an accuracy's (a proportion of clips); F1 has none here
        score = f"{key} {getattr(best, key):.3f}, {score}"
    lines = [f"Best: {_trial(best)}, {score} at epoch {best.best_epoch or best.epochs}{speed}."]
    low, _ = accuracy_interval(best.val_acc, val_clips)
    # Within the uncertainty: its accuracy is inside the best one's 95% interval.
    close = [r for r in pool[1:] if math.isfinite(low) and r.val_acc >= low]
    # Faster: by more than a speed's noise (`speed_noise`), so a gain of 1% is not offered as one.
    noise = speed_noise(rows)
    faster = [r for r in close if r.batch_size != best.batch_size and math.isfinite(r.clips_per_s)
              and math.isfinite(best.clips_per_s) and best.clips_per_s > 0
              and r.clips_per_s / best.clips_per_s - 1 > noise]
    if faster:
        quick = max(faster, key=lambda r: r.clips_per_s)
        gain = 100 * (quick.clips_per_s / best.clips_per_s - 1)
        lines.append(f"{_trial(quick)} is as good within that uncertainty and {gain:.0f}% faster "
                     f"({quick.clips_per_s:.1f} clips/s), giving up {best.val_acc - quick.val_acc:.3f} "
                     "accuracy.")
    if val_clips > 0:
        lines.append(f"The validation set has {val_clips} clips: one clip is {100 / val_clips:.1f} points of "
                     "accuracy, and [low, high] is the 95% interval; more validation clips narrow it "
                     "(a bigger --val-fraction, or more videos in val/ for a dataset split into train/ "
                     "and val/).")
    if close:
        lines.append(f"The top {len(close) + 1} trials are within the best one's uncertainty: their order is "
                     "not settled by this validation set.")
    if domains is not None:
        lines += _edge_warnings(best, domains)
    return lines + _epochs_hint(rows)
