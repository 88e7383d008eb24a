"""The searched hyperparameters, each declared once (`PARAMS`).

A declaration names the `TrainConfig` field a trial sets, the `SearchSpace` option fields that
bound it (or fixed numbers), its scale and how it is printed. Everything that shows or reads a
searched value derives from it: the Tune space (`tune.study.space`), trial names (`tune.running.trial`), the
tables and trials.csv (`tune.outputs.tables`), the plots, the importance, `--warm-start`, the answer's
edge warnings, the console and MLflow's view. Adding a parameter is one entry here (plus its
bound options in `tune.config.options` when a user should set them).

A trial's config carries the searched values under their names; the worker puts them into its
`TrainConfig` by field name, so it needs no declaration.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from vidtune.numbers import short_number, significant

Scale = Literal["choice", "log", "linear"]
# trials.csv writes floats to 3 significant digits: a value written at a bound may read back up to
# half a unit of its last digit (0.5 %) outside it, and still counts as inside.
ROUNDING = 5e-3


@dataclass(frozen=True)
class Param:
    """One searched hyperparameter.

    `low`/`high`: the `SearchSpace` field (or a number) of each bound; for a `choice` parameter,
    `low` is the field holding the values and `high` is None. `switch`: the `SearchSpace` bool
    field that turns searching it on (None: always searched)."""

    name: str            # TrainConfig field; key in Tune's config, trials.csv column, MLflow param
    words: str           # how the console and messages call it: "batch size", "lr"
    column: str          # the table's header: "batch", "lr", "wd"
    short: str           # trial-name prefix: t03-bs8-lr2.5e-4-wd1e-2
    scale: Scale
    low: str | float
    high: str | float | None = None
    switch: str | None = None
    axis: str = ""       # the plot's axis label (default: `words`)

    @property
    def is_choice(self) -> bool:
        return self.scale == "choice"

    @property
    def axis_label(self) -> str:
        return self.axis or self.words

    def domain(self, space: Any) -> Domain | None:
        """What `space` (a `tune.config.options.SearchSpace`, batch sizes resolved) draws this parameter
        from; None when the search does not search it."""
        if self.switch is not None and not getattr(space, self.switch):
            return None
        flag = {f.name: f.metadata.get("flag") for f in dataclasses.fields(space)} \
            if dataclasses.is_dataclass(space) else {}
        flags = "/".join(flag[b] for b in (self.low, self.high) if isinstance(b, str) and flag.get(b))
        if self.is_choice:
            return Domain(self, choices=tuple(sorted(set(getattr(space, str(self.low)) or ()))), flags=flags)
        return Domain(self, low=float(_bound(space, self.low)), high=float(_bound(space, self.high)),
                      flags=flags)

    def cell(self, value: float | None) -> str:
        """The value in the console's table ("-" when the trial has none)."""
        if value is None or not math.isfinite(value):
            return "-"
        return str(int(value)) if self.is_choice else f"{value:.2e}"

    def text(self, value: float | None) -> str:
        """The value in trials.csv: a whole number for a choice, else 3 significant digits ("" for
        none, "nan" when not finite)."""
        if self.is_choice and value is not None and math.isfinite(value):
            return str(int(value))
        return significant(value)

    def parse(self, text: str) -> float | int | None:
        """A trials.csv cell back to a value (None for an empty cell). ValueError when unreadable."""
        text = (text or "").strip()
        if not text:
            return None
        return int(text) if self.is_choice else float(text)

    def name_part(self, value: float) -> str:
        """Its part of a trial's name: `bs8`, `lr2.5e-4`."""
        return f"{self.short}{int(value)}" if self.is_choice else f"{self.short}{short_number(value)}"

    def said(self, value: float) -> str:
        """The value in a sentence: `batch size 8`, `lr 0.00025`."""
        return f"{self.words} {int(value)}" if self.is_choice else f"{self.words} {float(value):.3g}"


def _bound(space: Any, bound: str | float | None) -> float:
    assert bound is not None, "a ranged parameter has both bounds"
    return getattr(space, bound) if isinstance(bound, str) else bound


@dataclass(frozen=True)
class Domain:
    """What one parameter is drawn from in one search: its `choices`, or its `low`..`high` range
    (low == high: fixed, not searched, as Tune's space then holds a constant)."""

    param: Param
    choices: tuple[float, ...] = ()
    low: float = math.nan
    high: float = math.nan
    flags: str = ""      # the options that set it, as a user types them: "--lr-min/--lr-max"

    @property
    def name(self) -> str:
        return self.param.name

    @property
    def where(self) -> str:
        """Its options (`--lr-min/--lr-max`), or its declared range (`0.02..0.3`) when fixed numbers
        bound it."""
        if self.flags:
            return self.flags
        if self.param.is_choice:
            return ",".join(str(int(c)) for c in self.choices)
        return f"{self.low:g}..{self.high:g}"

    @property
    def fixed(self) -> bool:
        return not self.param.is_choice and self.low == self.high

    def contains(self, value: float | None) -> bool:
        """Whether an earlier trial's `value` lies inside (within trials.csv's rounding)."""
        if value is None or not math.isfinite(value):
            return False
        if self.param.is_choice:
            return value in self.choices
        return self.low * (1 - ROUNDING) <= value <= self.high * (1 + ROUNDING)

    def clip(self, value: float) -> float:
        return value if self.param.is_choice else min(max(value, self.low), self.high)

    def position(self, value: float) -> float:
        """Where `value` lies in the range, 0 at `low` to 1 at `high` (log scale when the
        parameter is log-uniform); nan for a choice or a fixed range."""
        if self.param.is_choice or not self.high > self.low or not math.isfinite(value):
            return math.nan
        if self.param.scale == "log":
            if value <= 0 or self.low <= 0:
                return math.nan
            return math.log(value / self.low) / math.log(self.high / self.low)
        return (value - self.low) / (self.high - self.low)

    def describe(self) -> str:
        """`batch sizes [4, 8]`, `lr 0.0001..0.003` (the search's first line)."""
        p = self.param
        if p.is_choice:
            return f"{p.words}s {[int(c) for c in self.choices]}"
        return f"{p.words} {self.low:g}..{self.high:g}"

    def option_values(self) -> dict[str, Any]:
        """The bounds under their option names, as the parent MLflow run's params hold them:
        `{"batch_sizes": "4,8"}`, `{"lr_min": 1e-4, "lr_max": 3e-3}`."""
        p = self.param
        if p.is_choice:
            return {str(p.low): ",".join(str(int(c)) for c in self.choices)}
        return {str(b): v for b, v in ((p.low, self.low), (p.high, self.high)) if isinstance(b, str)}


BATCH_SIZE = Param("batch_size", words="batch size", column="batch", short="bs", scale="choice",
                   low="batch_sizes")
LR = Param("lr", words="lr", column="lr", short="lr", scale="log", low="lr_min", high="lr_max",
           axis="learning rate")
WEIGHT_DECAY = Param("weight_decay", words="weight decay", column="wd", short="wd", scale="log",
                     low="weight_decay_min", high="weight_decay_max", switch="search_weight_decay")

# Every parameter a search may search, in the order the outputs show them. Read as
# `searched.PARAMS` (or through the functions below), never copied at import: a test declares one
# more by replacing this tuple.
PARAMS: tuple[Param, ...] = (BATCH_SIZE, LR, WEIGHT_DECAY)


def by_name(name: str) -> Param | None:
    return next((p for p in PARAMS if p.name == name), None)


def domains(space: Any) -> dict[str, Domain]:
    """{name: Domain} of every parameter `space` searches, in `PARAMS` order."""
    out = {}
    for p in PARAMS:
        d = p.domain(space)
        if d is not None:
            out[p.name] = d
    return out


def values_of(config: dict[str, Any], params: Sequence[Param] | None = None) -> dict[str, float]:
    """The searched values a trial's `config` holds, by name, as numbers."""
    out: dict[str, float] = {}
    for p in params if params is not None else PARAMS:
        if config.get(p.name) is not None:
            out[p.name] = int(config[p.name]) if p.is_choice else float(config[p.name])
    return out
